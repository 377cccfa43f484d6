"""Tokenizers: characters, or GPT-2's byte-level BPE through tiktoken, offline.

GPT-2's merge ranks ship beside this file (gpt2.tiktoken, see data/README.md) and are checked
against the sha256 that tiktoken itself expects for its r50k_base encoding, which is GPT-2's.
"""

import base64
import codecs
import hashlib
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

from errors import UserError

GPT2_RANKS_FILE = Path(__file__).with_name("gpt2.tiktoken")
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
END_OF_TEXT = "<|endoftext|>"


class CharTokenizer:
    """One token per character of a fixed vocabulary (stored with the prepared data)."""

    name = "char"
    eot_token = None  # character vocabularies have no end-of-text token

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.vocab_size = len(chars)
        codepoints = np.array([ord(ch) for ch in chars], dtype=np.uint32)
        self._order = np.argsort(codepoints)  # ids by code point, for encode_array's binary search
        self._sorted_codepoints = codepoints[self._order]

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        self._check_known(text)
        return [self.stoi[ch] for ch in text]

    def encode_array(self, text: str) -> np.ndarray:
        """Encode corpus text into a uint32 array, vectorised: the same ids as encode."""
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        positions = np.searchsorted(self._sorted_codepoints, codepoints).clip(max=self.vocab_size - 1)
        if not np.array_equal(self._sorted_codepoints[positions], codepoints):
            self._check_known(text)
        return self._order[positions].astype(np.uint32)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def _check_known(self, text: str) -> None:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise UserError(
                f"the text has characters outside the model's {self.vocab_size}-character "
                f"vocabulary: {shown}{more} (use only characters of the training corpus)"
            )

    def token_bytes(self, token: int) -> bytes:
        return self.chars[token].encode("utf-8")


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 tokens, <|endoftext|> = 50256)."""

    name = "gpt2"

    def __init__(self):
        self.encoding = gpt2_encoding()
        self.vocab_size = self.encoding.n_vocab
        self.eot_token = self.encoding.eot_token

    def encode(self, text: str) -> list[int]:
        """Encode a prompt; a literal <|endoftext|> in it becomes the end-of-text token."""
        return self.encoding.encode(text, allowed_special={END_OF_TEXT})

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode corpus text: special-token strings in it are treated as plain text."""
        return self.encoding.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        """Encode corpus text into a uint32 array, as encode_ordinary does, without building a
        Python list (several times faster for a large text)."""
        return self.encoding.encode_to_numpy(text, disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(token)


Tokenizer = CharTokenizer | GPT2Tokenizer


@lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2's encoding built from the shipped rank file, with no network access."""
    data = GPT2_RANKS_FILE.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise UserError(
            f"{GPT2_RANKS_FILE} has sha256 {digest}, not GPT-2's {GPT2_RANKS_SHA256} "
            f"(restore the file from the project's repository)"
        )
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: len(ranks)},
        explicit_n_vocab=len(ranks) + 1,
    )


def vocabulary_fingerprint(meta: dict) -> str:
    """A short hash of what the token ids of a prepared dataset (or a checkpoint, which carries the
    same metadata) stand for: the tokenizer, its size and its mapping (for characters, which
    character each id is; GPT-2's ranks are fixed by GPT2_RANKS_SHA256). Equal fingerprints mean
    that text becomes the same ids."""
    mapping = meta.get("chars") if meta.get("tokenizer") == "char" else GPT2_RANKS_SHA256
    identity = {"tokenizer": meta.get("tokenizer"), "vocab_size": meta.get("vocab_size"), "mapping": mapping}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def tokenizer_from_meta(meta: dict) -> Tokenizer:
    """The tokenizer a prepared dataset (or a checkpoint, which carries the same metadata) was made with."""
    kind = meta.get("tokenizer")
    if kind == "char":
        return CharTokenizer(meta["chars"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise UserError(f"tokenizer={kind!r} in the dataset metadata is unknown (expected 'char' or 'gpt2')")


class StreamDecoder:
    """Turns token ids into text one token at a time, stopping at the first stop string.

    A BPE token can end in the middle of a multi-byte UTF-8 character; the incremental decoder
    holds such bytes back until the character is complete, so streamed text never shows a
    half-character. Bytes that never form valid UTF-8 become U+FFFD, as in tiktoken's decode.
    Text that could be the start of a stop string is held back too, until it is known not to be;
    once a stop string appears, the text before it is the end of the sample (`stopped` is set).
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = tuple(s for s in stop if s)
        self.pending = ""  # decoded text held back: it may begin a stop string
        self.stopped = False

    def feed(self, token: int) -> str:
        """The text that this token completes (empty once a stop string has appeared)."""
        if self.stopped:
            return ""
        return self._release(self.decoder.decode(self.tokenizer.token_bytes(token)))

    def flush(self) -> str:
        """The text still held back, at the end of the sample."""
        if self.stopped:
            return ""
        text = self._release(self.decoder.decode(b"", final=True))
        text, self.pending = text + self.pending, ""
        return text

    def _release(self, text: str) -> str:
        text = self.pending + text
        found = [index for index in (text.find(stop) for stop in self.stop) if index >= 0]
        if found:
            self.stopped, self.pending = True, ""
            return text[: min(found)]
        held = max((_overlap(text, stop) for stop in self.stop), default=0)
        self.pending = text[len(text) - held :]
        return text[: len(text) - held]


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of text that is the beginning of stop."""
    for size in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
