"""The tokenizer a GGUF file carries (llama.cpp, Ollama, LM Studio), as the tokenizer.json of the
`tokenizers` package, with its chat template and named special tokens.

llama.cpp's byte-level BPE (tokenizer.ggml.model "gpt2") is GPT-2's kind: the tokens spelled in GPT-2's
byte alphabet, the merges, and a pre-tokenizer named by tokenizer.ggml.pre, the split before BPE, which
this file writes as the tokenizer.json that splits the same way (PRE_TOKENIZERS; interop/gguf.py reads
the same table the other way when it writes a file). Control tokens (type 3) are special added tokens,
user-defined ones (type 4) added tokens. SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama
2, Mistral, TinyLlama) and other splits are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.tokenizer import JsonTokenizer, byte_level_bytes
from errors import UserError

if TYPE_CHECKING:  # gguf is imported where a file is read: a folder's model needs none of it
    import gguf

GGUF_SUFFIX = ".gguf"
# the split patterns of byte-level BPEs (a tokenizer.json's Split before a ByteLevel) and the llama.cpp
# pre-tokenizer that splits as each does: Qwen2's (Qwen2.5, Qwen3; digits one at a time) and Llama 3's (up to three)
SPLIT_PATTERNS = {
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""": "qwen2",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""": "llama-bpe",
}  # fmt: skip
GPT2_SPLIT = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
# llama.cpp's pre-tokenizers as tokenizer.json's: GPT-2's split; SmolLM2's, every digit its own piece before
# GPT-2's split (llama.cpp: \p{N}, then GPT-2's pattern); a Split by a pattern before a plain ByteLevel
PRE_TOKENIZERS = {
    "gpt-2": GPT2_SPLIT,
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, GPT2_SPLIT]},
    **{
        name: {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        }
        for pattern, name in SPLIT_PATTERNS.items()
    },
}
NORMALIZERS = {"qwen2": {"type": "NFC"}}  # Qwen2's tokenizer.json composes characters first
CONTROL, USER_DEFINED = 3, 4  # gguf's token types (llama.cpp's llama_token_type) that are added tokens
# tokenizer.ggml.<role>_token_id -> the name of the token a chat template reads (tokenizer_config.json's)
SPECIAL_ROLES = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}


def open_gguf(path: Path, key: str) -> gguf.GGUFReader:
    """A GGUF file opened for reading (memory-mapped: a tensor is read when used); a file that is not one
    is a UserError naming key and path."""
    if not Path(path).is_file():
        raise UserError(f"{key}={str(path)!r} is not a file (give a .gguf file from llama.cpp, Ollama or LM Studio)")
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # a damaged or foreign file fails GGUFReader in many ways; each means "not readable"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{key}={str(path)!r} is not a readable GGUF file ({reason})") from None


def field(reader: gguf.GGUFReader, key: str, default: object = None) -> object:
    """A metadata value as plain Python (str, int, bool, a list); a float32 as the shortest decimal that
    rounds to it (1e-05, not 9.999999747378752e-06: what the writer's config held)."""
    if key not in reader.fields:
        return default
    entry = reader.fields[key]
    value = entry.contents()
    import gguf  # loaded already: the reader is gguf's

    if entry.types == [gguf.GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


def gguf_tokenizer(reader: gguf.GGUFReader, source: str) -> JsonTokenizer:
    """The tokenizer of an opened GGUF file (source: its path), with the file's chat template and the
    special tokens it names; a tokenizer this file does not rebuild is refused by name."""
    model, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")
    if model != "gpt2":
        kind = "SentencePiece" if model == "llama" else "no tokenizer" if model is None else repr(model)
        raise UserError(
            f"{source} holds tokenizer.ggml.model={model!r} ({kind}): only llama.cpp's byte-level BPE ('gpt2': "
            f"GPT-2's, SmolLM2's, Qwen's, Llama 3's kind) is read from a GGUF file"
        )
    if pre not in PRE_TOKENIZERS:
        raise UserError(
            f"{source} holds tokenizer.ggml.pre={pre!r}, a split before BPE this reader does not rebuild "
            f"(it reads {', '.join(PRE_TOKENIZERS)})"
        )
    tokens = field(reader, "tokenizer.ggml.tokens", [])
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    added = [
        {"id": token_id, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": kind != CONTROL, "special": kind == CONTROL}
        for token_id, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (CONTROL, USER_DEFINED)
    ]  # fmt: skip
    alphabet = byte_level_bytes()
    plain = {entry["id"] for entry in added}
    if not all(char in alphabet for token_id, token in enumerate(tokens) if token_id not in plain for char in token):
        raise UserError(f"{source}: its tokens are not spelled in bytes, as a byte-level BPE's are")
    special = {
        name: field(reader, f"tokenizer.ggml.{role}_token_id")
        for role, name in SPECIAL_ROLES.items()
        if field(reader, f"tokenizer.ggml.{role}_token_id") is not None
    }
    state = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": NORMALIZERS.get(pre),
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": _post_processor(reader, tokens, special),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {token: token_id for token_id, token in enumerate(tokens)},
            "merges": _merges(field(reader, "tokenizer.ggml.merges", []), tokens),
        },
    }  # fmt: skip
    tokenizer = JsonTokenizer(json.dumps(state, ensure_ascii=False), source=source)
    template = field(reader, "tokenizer.chat_template")
    if template is not None:
        variables = {name: tokens[token_id] for name, token_id in special.items() if 0 <= token_id < len(tokens)}
        tokenizer.with_chat_template(template, variables)
    return tokenizer


def _merges(merges: list[str], tokens: list[str]) -> list[str]:
    """The merges llama.cpp can apply: those whose two parts and result are tokens (a merge whose result
    is none never applies there, and the tokenizers package refuses it: a character vocabulary's export
    carries one such, since llama.cpp wants at least one merge)."""
    vocab = set(tokens)
    pairs = [merge.split(" ", 1) for merge in merges]
    return [f"{a} {b}" for a, b in pairs if a in vocab and b in vocab and a + b in vocab]


def _post_processor(reader: gguf.GGUFReader, tokens: list[str], special: dict[str, int]) -> dict | None:
    """The tokenizer.json post-processor that puts bos before a text and eos after it where the file says
    llama.cpp adds them (tokenizer.ggml.add_bos_token, add_eos_token), as a model folder's does; none
    where it adds neither. (sample.py and the datasets add none: this is what an export writes again.)"""
    around = [
        (role, special.get(f"{role}_token"))
        for role in ("bos", "eos")
        if field(reader, f"tokenizer.ggml.add_{role}_token") and special.get(f"{role}_token") is not None
    ]
    if not around:
        return None

    def piece(role: str, token_id: int) -> dict:
        return {"SpecialToken": {"id": tokens[token_id], "type_id": 0}}

    before = [piece(role, token_id) for role, token_id in around if role == "bos"]
    after = [piece(role, token_id) for role, token_id in around if role == "eos"]
    return {
        "type": "TemplateProcessing",
        "single": [*before, {"Sequence": {"id": "A", "type_id": 0}}, *after],
        "pair": [*before, {"Sequence": {"id": "A", "type_id": 0}}, *after, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            tokens[token_id]: {"id": tokens[token_id], "ids": [token_id], "tokens": [tokens[token_id]]}
            for _, token_id in around
        },
    }
