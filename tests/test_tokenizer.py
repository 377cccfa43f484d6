import json

import pytest
import tokenizers

import data.tokenizer as tokenizer_module
from data.tokenizer import (
    MAX_VOCAB_SIZE,
    CharTokenizer,
    GPT2Tokenizer,
    JsonTokenizer,
    StreamDecoder,
    tokenizer_from_meta,
    train_bpe,
    vocabulary_fingerprint,
)
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
    clear_gpt2_caches()
    try:
        with pytest.raises(UserError, match="not GPT-2's"):
            GPT2Tokenizer()
    finally:
        clear_gpt2_caches()


def clear_gpt2_caches():
    tokenizer_module.gpt2_encoding.cache_clear()
    tokenizer_module.gpt2_ranks.cache_clear()


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


# A few KB of mixed text: enough merges for multi-byte characters to fall inside tokens.
BPE_CORPUS = (SAMPLE + "naïve café, 東京 and 東京タワー, emoji 🙂🙂 and ünïcödé.\n") * 40


def trained_bpe(vocab_size: int = 400) -> JsonTokenizer:
    return train_bpe([BPE_CORPUS], vocab_size, progress=False)


def test_trained_bpe_round_trips_any_text_and_keeps_its_special_token_first():
    tokenizer = trained_bpe()
    text = "Unseen words, Ωmega and 🚀 rockets\n\ttabs"  # characters the corpus never had: byte tokens
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eot_token == 0 and tokenizer.vocab_size <= 400
    assert len(tokenizer.encode(SAMPLE)) < len(SAMPLE.encode("utf-8")) / 2  # the merges were learnt


def test_bpe_prompt_may_contain_end_of_text_but_corpus_text_may_not():
    tokenizer = trained_bpe()
    assert tokenizer.encode("<|endoftext|>First")[0] == tokenizer.eot_token
    assert tokenizer.eot_token not in tokenizer.encode_array("<|endoftext|>First").tolist()
    assert tokenizer.encode_array(SAMPLE).tolist() == tokenizer.encode(SAMPLE)


@pytest.mark.parametrize("vocab_size", [256, MAX_VOCAB_SIZE + 1])
def test_bpe_vocabulary_below_the_bytes_or_absurdly_large_is_refused(vocab_size):
    with pytest.raises(UserError, match=f"--vocab-size={vocab_size} is outside 257"):
        train_bpe([BPE_CORPUS], vocab_size, progress=False)


def test_bpe_training_cuts_only_pre_tokens_longer_than_its_bound(monkeypatch):
    plain = trained_bpe().to_json()
    monkeypatch.setattr(tokenizer_module, "BPE_TRAINING_PIECE_BYTES", 16)  # longer than BPE_CORPUS's pre-tokens
    assert trained_bpe().to_json() == plain  # text of words learns the same merges
    line = "abcdefghijklmnopqrstuvwxyz" * 400  # one pre-token of 10,400 bytes: quadratic training uncut
    tokenizer = train_bpe([BPE_CORPUS, line], 600, progress=False)
    assert max(len(tokenizer.token_bytes(token)) for token in range(tokenizer.vocab_size)) <= 16
    assert tokenizer.encoding is not None  # encoded as GPT-2 splits, whole pre-tokens, by tiktoken
    assert tokenizer.decode(tokenizer.encode_array(line).tolist()) == line


def test_bpe_on_an_empty_corpus_is_refused():
    with pytest.raises(UserError, match=r"corpus \(or its train split\) is empty"):
        train_bpe(["", ""], 300, progress=False)


def test_streamed_bpe_continuation_equals_decode():
    tokenizer = trained_bpe()
    text = "rocket 🚀 (unseen: single bytes), 東京 and é<|endoftext|>"
    ids = tokenizer.encode(text)
    assert any(_is_incomplete_utf8(tokenizer.token_bytes(t)) for t in ids)
    pieces, _ = stream(tokenizer, ids, stop=())
    assert "".join(pieces) == tokenizer.decode(ids) == text


def sentencepiece_style() -> JsonTokenizer:
    """A tokenizer.json built as Llama 2's is: '▁' for spaces, byte-fallback tokens <0xNN> for what the
    vocabulary lacks, a decoder that strips the space before the first word."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token in ["▁", "t", "h", "e", "a", "▁t", "▁th", "▁the", "▁a"]:
        vocab[token] = len(vocab)
    merges = [("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a")]
    model = tokenizers.models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.normalizer = tokenizers.normalizers.Sequence(
        [tokenizers.normalizers.Prepend("▁"), tokenizers.normalizers.Replace(" ", "▁")]
    )
    decoders = tokenizers.decoders
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<s>", "</s>"])
    return JsonTokenizer(tokenizer.to_str())


def test_sentencepiece_style_tokens_stream_as_their_bytes_and_spaces():
    tokenizer = sentencepiece_style()
    assert tokenizer.eot_token == 2  # </s> separates documents
    prompt, continuation = tokenizer.encode("the"), tokenizer.encode("a thé 東</s>")  # "▁a ..."
    assert tokenizer.decode(prompt + continuation) == "the a thé 東</s>"
    assert tokenizer.token_bytes(tokenizer.encode("é")[-1]) == "é".encode()[-1:]  # a byte-fallback token
    # what sample.py shows after the prompt: the continuation's leading space included
    pieces, _ = stream(tokenizer, continuation, stop=())
    assert tokenizer.decode(prompt) + "".join(pieces) == tokenizer.decode(prompt + continuation)


def test_a_file_that_is_not_a_tokenizer_is_refused_in_one_line(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0"}')
    with pytest.raises(
        UserError, match=r"tokenizer.json is not a tokenizer.json that the tokenizers package can load \("
    ):
        JsonTokenizer.from_file(path)
    with pytest.raises(UserError, match="is not a file"):
        JsonTokenizer.from_file(tmp_path / "missing.json")


def test_json_tokenizer_metadata_rebuilds_it_and_fingerprints_its_vocabulary():
    small, large = trained_bpe(300), trained_bpe(400)
    meta = {
        "tokenizer": "json",
        "vocab_size": small.vocab_size,
        "tokenizer_json": small.to_json(),
        "tokenizer_sha256": small.sha256,
    }
    rebuilt = tokenizer_from_meta(meta)
    assert rebuilt.encode(SAMPLE) == small.encode(SAMPLE)
    other = {**meta, "tokenizer_json": large.to_json(), "tokenizer_sha256": large.sha256}
    assert vocabulary_fingerprint(meta) != vocabulary_fingerprint(other)
    assert vocabulary_fingerprint(meta) == vocabulary_fingerprint(dict(meta))


def test_a_trained_bpe_is_encoded_by_tiktoken_with_the_tokenizers_packages_ids():
    tokenizer = trained_bpe()
    assert tokenizer.encoding is not None  # GPT-2's scheme: the fast encoder
    text = BPE_CORPUS + "  x\n\n\t 12345 can't 'tis ĳ 🚀\u00a0end  " + SAMPLE.upper()
    assert tokenizer.encode_array(text).tolist() == tokenizer.corpus_tokenizer.encode(text).ids
    prompt = "Before<|endoftext|>we 🙂"
    assert tokenizer.encode(prompt) == tokenizer.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert sentencepiece_style().encoding is None  # '▁' and byte fallback: the tokenizers package encodes it


def test_gpt2_as_a_tokenizer_json_encodes_as_gpt2_in_both_encoders():
    gpt2 = GPT2Tokenizer()
    rebuilt = JsonTokenizer(gpt2.to_json())
    assert (rebuilt.vocab_size, rebuilt.eot_token) == (50257, 50256) and rebuilt.encoding is not None
    text = SAMPLE + "naïve café, 東京 🙂 can't  stop\n\n"
    ids = gpt2.encode_ordinary(text)
    assert rebuilt.corpus_tokenizer.encode(text).ids == rebuilt.encode_array(text).tolist() == ids
    assert rebuilt.encode("Hello<|endoftext|>") == gpt2.encode("Hello<|endoftext|>")


def test_char_vocabulary_as_a_tokenizer_json_keeps_its_ids():
    chars = CharTokenizer.from_text(SAMPLE)
    rebuilt = JsonTokenizer(chars.to_json())
    assert rebuilt.encode(SAMPLE) == chars.encode(SAMPLE) and rebuilt.decode(chars.encode(SAMPLE)) == SAMPLE
    assert [rebuilt.token_bytes(i) for i in range(chars.vocab_size)] == [ch.encode() for ch in chars.chars]


def test_a_bpe_whose_ids_do_not_follow_its_merges_is_left_to_the_tokenizers_package():
    state = json.loads(trained_bpe().to_json())
    vocab = state["model"]["vocab"]
    before, last = sorted(vocab, key=vocab.get)[-2:]  # the last two merges, given each other's ids
    vocab[before], vocab[last] = vocab[last], vocab[before]
    tokenizer = JsonTokenizer(json.dumps(state))
    assert tokenizer.encoding is None  # tiktoken would apply the two merges in the wrong order
    assert tokenizer.encode_array(SAMPLE).tolist() == tokenizer.corpus_tokenizer.encode(SAMPLE).ids


# Tokenizer.json files of each kind the tokenizers package builds offline, trained on a few words.
WORDS = ["hello world, this is a test of the tokenizer", "abc def ghi jkl"] * 50
KNOWN = "hello world, this is a test"


def wordlevel() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(WORDS, tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    return tokenizer


def wordpiece() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=True)  # strips accents too
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(WORDS, tokenizers.trainers.WordPieceTrainer(vocab_size=100, special_tokens=["[UNK]"]))
    return tokenizer


def metaspace_bpe() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", fuse_unk=True))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(WORDS, tokenizers.trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>"]))
    return tokenizer


def unigram() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.SentencePieceUnigramTokenizer()  # folds runs of spaces into one, as SentencePiece does
    tokenizer.train_from_iterator(WORDS, 60, unk_token="<unk>", special_tokens=["<unk>"], show_progress=False)
    return tokenizer._tokenizer


def byte_level_nfc() -> tokenizers.Tokenizer:
    """Qwen's scheme (NFC first), so not the tiktoken twin's; its post-processor trims offsets, and the
    file asks for truncation at 4 tokens."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.normalizer = tokenizers.normalizers.NFC()
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.post_processor = tokenizers.processors.ByteLevel(trim_offsets=True)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(WORDS, tokenizers.trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet))
    tokenizer.enable_truncation(4)
    return tokenizer


def character_export() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(CharTokenizer.from_text(KNOWN).to_json())


# kind -> (its tokenizer.json, text beyond its vocabulary, what is lost and where, how)
LOSSY = {
    "characters-exported": (character_export, "hello wörld", "'ö' at character 7", "it has no token for it"),
    "wordlevel": (wordlevel, "hello wörld", "'wörld' at character 6", "unknown token '[UNK]'"),
    "wordpiece": (wordpiece, "hello 東京", "'東' at character 6", "unknown token '[UNK]'"),
    "metaspace-bpe-with-unk": (metaspace_bpe, "this is é", "'é' at character 8", "unknown token '<unk>'"),
    "unigram": (unigram, "a test of ö", "'ö' at character 10", "unknown token '<unk>'"),
}


@pytest.mark.parametrize("kind", LOSSY)
def test_a_tokenizer_json_refuses_text_its_vocabulary_cannot_encode(kind):
    build, text, lost, reason = LOSSY[kind]
    built = build()
    tokenizer = JsonTokenizer(built.to_str(), source="models/x/tokenizer.json")
    assert tokenizer.encode(KNOWN) == tokenizer.encode_array(KNOWN).tolist() == built.encode(KNOWN).ids
    for encode in (tokenizer.encode, tokenizer.encode_array):  # prompts and corpus text alike
        with pytest.raises(UserError, match="characters that models/x/tokenizer.json cannot encode: ") as e:
            encode(f"{text}, and more")
        assert lost in str(e.value) and reason in str(e.value)


@pytest.mark.parametrize("kind", ["characters-exported", "wordlevel"])
def test_the_first_lost_character_is_named_even_where_the_offsets_after_it_shift(kind):
    """A BPE without an unknown token drops a character and shifts the offsets of the rest of its word."""
    tokenizer = JsonTokenizer(LOSSY[kind][0]().to_str())
    text = KNOWN + " " + KNOWN.replace("test", "tést") + " ¿"
    first = text.index("tést") if kind == "wordlevel" else text.index("é")  # the unknown word, or the character
    with pytest.raises(UserError, match=f"at character {first} "):
        tokenizer.encode(text)


def sentencepiece_byte_fallback() -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(sentencepiece_style().to_json())


@pytest.mark.parametrize("build", [sentencepiece_byte_fallback, byte_level_nfc])
def test_byte_fallback_and_byte_level_tokenizer_jsons_encode_any_text_whole(build):
    """No refusal where nothing is lost, and nothing cut: a file's truncation and trimmed offsets are ignored."""
    tokenizer = JsonTokenizer(build().to_str())
    text = "hello wörld  naïve\n東京 🙂 " * 3
    ids = tokenizer.encode_array(text).tolist()
    assert tokenizer.encode(text) == ids and len(ids) > 4
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("build,text", [(wordlevel, "hello   world\n"), (unigram, "hello   world")])
def test_what_a_pre_tokenizer_or_normalizer_removes_by_design_is_not_refused(build, text):
    """A WordLevel's spaces between words and SentencePiece's runs of spaces folded into one are
    the tokenizer's design, not characters outside its vocabulary."""
    built = build()
    assert JsonTokenizer(built.to_str()).encode(text) == built.encode(text).ids
