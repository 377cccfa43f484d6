import pytest

import data.tokenizer as tokenizer_module
from data.tokenizer import CharTokenizer, GPT2Tokenizer, StreamDecoder, tokenizer_from_meta
from errors import UserError

SAMPLE = "First Citizen:\nBefore we proceed any further, hear me speak.\n"


def test_char_tokenizer_round_trips():
    tokenizer = CharTokenizer.from_text(SAMPLE)
    ids = tokenizer.encode(SAMPLE)
    assert len(ids) == len(SAMPLE)
    assert tokenizer.decode(ids) == SAMPLE
    assert tokenizer.vocab_size == len(set(SAMPLE))


def test_char_vocabulary_is_sorted_so_ids_are_stable():
    assert CharTokenizer.from_text("cab").encode("abc") == [0, 1, 2]


def test_characters_outside_the_vocabulary_are_named():
    tokenizer = CharTokenizer.from_text(SAMPLE)
    with pytest.raises(UserError, match=r"outside the model's \d+-character vocabulary: '\$', 'é'"):
        tokenizer.encode("First $ café")


def test_gpt2_encodes_hello_world_offline():
    assert GPT2Tokenizer().encode("Hello world") == [15496, 995]


def test_gpt2_round_trips_text_and_unicode():
    tokenizer = GPT2Tokenizer()
    text = SAMPLE + "naïve café, 東京, emoji 🙂\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_gpt2_prompt_may_contain_end_of_text_but_corpus_text_may_not():
    tokenizer = GPT2Tokenizer()
    assert tokenizer.eot_token == 50256 and tokenizer.vocab_size == 50257
    assert tokenizer.encode("<|endoftext|>Hi") == [50256, 17250]
    assert 50256 not in tokenizer.encode_ordinary("<|endoftext|>Hi")


def test_gpt2_rank_file_is_checked_against_its_hash(tmp_path, monkeypatch):
    tampered = tmp_path / "gpt2.tiktoken"
    tampered.write_bytes(tokenizer_module.GPT2_RANKS_FILE.read_bytes() + b"\n")
    monkeypatch.setattr(tokenizer_module, "GPT2_RANKS_FILE", tampered)
    tokenizer_module.gpt2_encoding.cache_clear()
    try:
        with pytest.raises(UserError, match="not GPT-2's"):
            GPT2Tokenizer()
    finally:
        tokenizer_module.gpt2_encoding.cache_clear()


def test_tokenizer_from_metadata():
    assert tokenizer_from_meta({"tokenizer": "char", "chars": "ab"}).encode("ba") == [1, 0]
    assert tokenizer_from_meta({"tokenizer": "gpt2"}).vocab_size == 50257
    with pytest.raises(UserError, match="tokenizer='sentencepiece'"):
        tokenizer_from_meta({"tokenizer": "sentencepiece"})


def test_streamed_bpe_text_never_shows_half_a_character():
    tokenizer = GPT2Tokenizer()
    text = "emoji 🙂 and 東京 and é"
    ids = tokenizer.encode(text)
    # the test means something only if some token holds part of a multi-byte character
    partial = [t for t in ids if _is_incomplete_utf8(tokenizer.token_bytes(t))]
    assert partial
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.feed(t) for t in ids] + [decoder.flush()]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == text


def test_streamed_char_text_matches_decode():
    tokenizer = CharTokenizer.from_text(SAMPLE)
    decoder = StreamDecoder(tokenizer)
    assert "".join(decoder.feed(t) for t in tokenizer.encode(SAMPLE)) == SAMPLE


def _is_incomplete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def stream(tokenizer, ids, stop) -> tuple[list[str], bool]:
    decoder = StreamDecoder(tokenizer, stop)
    pieces = [decoder.feed(token) for token in ids]
    pieces.append(decoder.flush())
    return pieces, decoder.stopped


def test_stream_ends_before_a_stop_string_split_across_tokens():
    tokenizer = CharTokenizer("abcdefg\n")
    pieces, stopped = stream(tokenizer, tokenizer.encode("abc\ndefg"), stop=("c\nd", "zz"))
    assert "".join(pieces) == "ab" and stopped
    # nothing after the stop string is shown, not even the text held back while it could still match
    assert pieces[:2] == ["a", "b"]


def test_text_held_back_for_a_possible_stop_string_is_released_when_it_does_not_match():
    tokenizer = CharTokenizer("abcd")
    pieces, stopped = stream(tokenizer, tokenizer.encode("abcabd"), stop=("abd!",))
    assert "".join(pieces) == "abcabd" and not stopped
    assert pieces[:3] == ["", "", "abc"]  # "a", "ab" might begin the stop string; "abc" cannot
