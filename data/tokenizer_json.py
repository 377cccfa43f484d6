"""Our tokenizers as tokenizer.json, the `tokenizers` package's format that transformers'
AutoTokenizer reads: what an exported model folder carries.

A character vocabulary becomes a BPE model with no merges (each character its own token, in our
ids) and a decoder that joins the characters as they are; GPT-2's byte-level BPE is rebuilt from
the shipped merge ranks (data/gpt2.tiktoken): the vocabulary in the byte-to-character spelling of
GPT-2's files, and the merges recovered from the ranks.
"""

from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, gpt2_encoding


def tokenizer_json(tokenizer) -> str:
    """tokenizer.json for a tokenizer of ours (one read from a tokenizer.json writes it back)."""
    if isinstance(tokenizer, CharTokenizer):
        return char_tokenizer_json(tokenizer.chars)
    if isinstance(tokenizer, GPT2Tokenizer):
        return gpt2_tokenizer_json()
    return tokenizer.to_json()


def tokenizer_config(tokenizer) -> dict:
    """tokenizer_config.json: the plain fast tokenizer over tokenizer.json, adding no tokens of its own
    and leaving decoded spaces as they are (so decoding gives exactly the text sample.py prints)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if tokenizer.eot_token is not None:
        config |= {"eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    return config


def char_tokenizer_json(chars: str) -> str:
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(chars)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()  # the characters joined, with nothing between them
    return tokenizer.to_str()


@lru_cache(maxsize=1)
def gpt2_tokenizer_json() -> str:
    ranks = gpt2_encoding()._mergeable_ranks  # token bytes -> id, the ids GPT-2's files use
    spell = byte_spelling()
    vocab = {"".join(spell[b] for b in token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _last_merge(token, rank, ranks)
            merges.append(("".join(spell[b] for b in left), "".join(spell[b] for b in right)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # with GPT-2's splitting rule
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(END_OF_TEXT, special=True, normalized=False)])
    assert tokenizer.token_to_id(END_OF_TEXT) == len(ranks)  # 50256, as in GPT2Tokenizer
    return tokenizer.to_str()


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts whose merge makes token: byte-pair encoding of its bytes with every merge of a
    lower rank leaves exactly two."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best, i = min(pairs)
        assert best < rank, f"the ranks cannot build {token!r}"  # GPT-2's ranks always can
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def byte_spelling() -> dict[int, str]:
    """GPT-2's files spell each byte as a printable character: printable Latin-1 bytes as themselves,
    the others (controls, space, ...) as the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in spelling]
    spelling |= {b: chr(256 + n) for n, b in enumerate(others)}
    return spelling
