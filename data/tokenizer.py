"""Tokenizers: characters, GPT-2's byte-level BPE through tiktoken (offline), or any tokenizer.json
of the Hugging Face `tokenizers` package (one trained by data/prepare.py, or a model folder's).

GPT-2's merge ranks ship beside this file (gpt2.tiktoken, see data/README.md) and are checked
against the sha256 that tiktoken itself expects for its r50k_base encoding, which is GPT-2's.
"""

import base64
import codecs
import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

import numpy as np
import tiktoken
import tokenizers
from tiktoken_ext.openai_public import r50k_pat_str

from errors import UserError

GPT2_RANKS_FILE = Path(__file__).with_name("gpt2.tiktoken")
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
END_OF_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # in a dataset folder whose meta.json says tokenizer="json"
# Special tokens that end a document, in the order they are looked for in a tokenizer.json: GPT-2's and
# Qwen's, Llama 3's, SentencePiece's (Llama 2, Mistral), Gemma's. The first one present is its eot_token.
DOCUMENT_SEPARATORS = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")
BPE_SPECIAL_TOKENS = (END_OF_TEXT,)  # a trained BPE's special tokens, ids 0, 1, ...: the document separator
MAX_VOCAB_SIZE = 1 << 20  # beyond any published tokenizer (Gemma's 262,144): a larger one is a typo
# BPE training counts pair merges within each pre-token, and every merge rescans each pre-token that holds
# the pair, so one huge pre-token (a line of letters with no space or punctuation) makes training quadratic
# in its length: 200 KB took 33 s, 3 MB over 10 minutes. Training cuts longer pre-tokens into pieces of
# this many bytes; text of words, numbers and punctuation has no pre-token this long, so its merges are
# the same with or without the cut. Encoding is not cut: only the merges learnt are bounded.
BPE_TRAINING_PIECE_BYTES = 1024
BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's tokens for single bytes


class ChatFields:
    """What every tokenizer carries for conversations (docs/chat.md): the special tokens it splits
    out of text that a chat template renders (`specials`, string -> id), and the chat template
    itself (jinja text) with the named token strings it is rendered with (`template_variables`,
    e.g. eos_token), or None. `added_specials` are the special tokens added after the tokenizer's
    own ids for the built-in template (data/conversations.py), which a dataset's meta.json records."""

    chat_template: str | None = None
    template_variables: dict[str, str] = {}  # noqa: RUF012 (replaced, never mutated)
    added_specials: tuple[str, ...] = ()

    def with_chat_template(self, template: str, variables: dict[str, str]) -> "Tokenizer":
        self.chat_template, self.template_variables = template, dict(variables)
        return self


class CharTokenizer(ChatFields):
    """One token per character of a fixed vocabulary (stored with the prepared data); special tokens
    added for chat (`specials`) take the ids after the characters'. Character vocabularies have no
    end-of-text token of their own: eot_token is an added <|endoftext|>'s, else None."""

    name = "char"

    def __init__(self, chars: str, specials: tuple[str, ...] = ()):
        self.chars = chars
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.added_specials = tuple(specials)
        self.specials = {token: len(chars) + i for i, token in enumerate(specials)}
        self.vocab_size = len(chars) + len(specials)
        self.eot_token = self.specials.get(END_OF_TEXT)
        codepoints = np.array([ord(ch) for ch in chars], dtype=np.uint32)
        self._order = np.argsort(codepoints)  # ids by code point, for encode_array's binary search
        self._sorted_codepoints = codepoints[self._order]

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        """Encode a prompt; an added special token's string in it becomes that token."""
        ids = []
        for piece, special in split_specials(text, self.specials):
            if special is not None:
                ids.append(special)
            else:
                self._check_known(piece)
                ids.extend(self.stoi[ch] for ch in piece)
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """Encode corpus text into a uint32 array, vectorised, every character as itself (special
        tokens' strings too)."""
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        positions = np.searchsorted(self._sorted_codepoints, codepoints).clip(max=len(self.chars) - 1)
        if not np.array_equal(self._sorted_codepoints[positions], codepoints):
            self._check_known(text)
        return self._order[positions].astype(np.uint32)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.token_bytes(i).decode("utf-8") for i in ids)

    def _check_known(self, text: str) -> None:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:10])
            more = f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""
            raise UserError(
                f"the text has characters outside the model's {len(self.chars)}-character "
                f"vocabulary: {shown}{more} (use only characters of the training corpus)"
            )

    def token_bytes(self, token: int) -> bytes:
        if token >= len(self.chars):
            return self.added_specials[token - len(self.chars)].encode("utf-8")
        return self.chars[token].encode("utf-8")

    def to_json(self) -> str:
        """The vocabulary as a tokenizer.json (a BPE without merges: one token per character, joined back
        by the Fuse decoder), for readers of Hugging Face model folders."""
        model = tokenizers.models.BPE(vocab=self.stoi, merges=[])
        tokenizer = tokenizers.Tokenizer(model)
        tokenizer.decoder = tokenizers.decoders.Fuse()
        tokenizer.add_special_tokens(list(self.added_specials))  # ids after the characters', as here
        return tokenizer.to_str()


class GPT2Tokenizer(ChatFields):
    """GPT-2's byte-level BPE (50,257 tokens, <|endoftext|> = 50256); special tokens added for chat
    take the ids 50257, 50258, ..."""

    name = "gpt2"

    def __init__(self, specials: tuple[str, ...] = ()):
        self.added_specials = tuple(specials)
        self.encoding = gpt2_encoding(self.added_specials)
        self.vocab_size = self.encoding.n_vocab
        self.eot_token = self.encoding.eot_token
        self.specials = {token: self.encoding.encode_single_token(token) for token in self.encoding.special_tokens_set}

    def encode(self, text: str) -> list[int]:
        """Encode a prompt; a literal special token's string (<|endoftext|>) in it becomes that token."""
        return self.encoding.encode(text, allowed_special="all")

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

    def to_json(self) -> str:
        """GPT-2's BPE as a tokenizer.json, built from the shipped ranks (the same vocabulary, merges
        and ids as the tokenizer.json of Hugging Face's gpt2), for readers of model folders."""
        ranks = gpt2_ranks()
        vocab = {byte_level_spelling(token): rank for token, rank in ranks.items()}
        merged = [token for token in sorted(ranks, key=ranks.get) if len(token) > 1]  # in the order learnt
        merges = [tuple(map(byte_level_spelling, merge_pair(ranks, token))) for token in merged]
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=merges))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        tokenizer.add_special_tokens([END_OF_TEXT, *self.added_specials])  # id 50256 (the next after the ranks), ...
        return tokenizer.to_str()


def merge_pair(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two tokens whose merge made token in a byte-level BPE given by its ranks: byte pair encoding
    of token's bytes, merging the pair of lowest rank each time, stops at two parts (every token of a
    BPE is made by merging two tokens of lower rank)."""
    parts = [bytes([byte]) for byte in token]
    while len(parts) > 2:
        joined = [ranks.get(left + right, len(ranks)) for left, right in itertools.pairwise(parts)]
        first = joined.index(min(joined))
        parts[first : first + 2] = [parts[first] + parts[first + 1]]
    return parts[0], parts[1]


class UnencodableText(UserError):
    """Text that a tokenizer read from a file cannot encode: the first part it would lose (a character,
    or the span read as its unknown token) and where that starts in the text (0-based characters)."""

    def __init__(self, lost: str, position: int, source: str, reason: str):
        self.lost, self.position, self.source, self.reason = lost, position, source, reason
        super().__init__(self.message())

    def message(self, offset: int = 0) -> str:
        """The one-line refusal, the position counted from offset characters before the text (where the
        text is a piece of a longer one)."""
        return (
            f"the text has characters that {self.source} cannot encode: {self.lost!r} at character "
            f"{self.position + offset:,} ({self.reason}; use only text its vocabulary covers)"
        )


class JsonTokenizer(ChatFields):
    """Any tokenizer that the `tokenizers` package loads from a tokenizer.json: a byte-level BPE
    trained by data/prepare.py, or the tokenizer of a Hugging Face model folder (Llama, Qwen, ...).

    Token ids are the file's own. The file's text is kept (`to_json`) so that a dataset and a checkpoint
    can carry it, and identifies the vocabulary by its sha256. The encoder's post-processor (a BOS
    token some models add) is not applied: datasets separate documents with eot_token instead; nor
    is a truncation or padding the file asks for: every character of a text is encoded.

    Text the vocabulary cannot encode is refused (UnencodableText), as CharTokenizer refuses it: a
    tokenizer.json may hold no unknown token (a character vocabulary exported by sample.py --export
    has none), and then the `tokenizers` package drops such characters without a word.
    See encoded_ids for how a loss is seen.
    """

    name = "json"

    def __init__(self, text: str, source: str = "tokenizer.json"):
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the tokenizers package raises a plain Exception for a file it cannot read
            raise UserError(
                f"{source} is not a tokenizer.json that the tokenizers package can load ({str(e).splitlines()[0]}); "
                f"give the tokenizer.json of a trained tokenizer or of a Hugging Face model folder"
            ) from None
        self.source = source
        self.text = text
        self.sha256 = tokenizer_json_sha256(text)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)  # token string -> id
        if not vocab:
            raise UserError(f"{source} has an empty vocabulary; give a trained tokenizer.json")
        self.vocab_size = max(vocab.values()) + 1  # ids may have holes; every id must fit the embedding
        added = self.tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        specials = {token.content: token_id for token_id, token in added.items() if token.special}
        # text is split at every added token's string before the model reads it, as the tokenizers package does
        self.specials = {token.content: token_id for token_id, token in added.items()}
        self.eot_token = next((specials[s] for s in DOCUMENT_SEPARATORS if s in specials), None)
        self.prompt_tokenizer = plain_encoder(text)
        # corpus text is encoded with special-token strings as plain text, as GPT2Tokenizer's encode_ordinary does
        self.corpus_tokenizer = plain_encoder(text)
        self.corpus_tokenizer.encode_special_tokens = True
        state = json.loads(text)
        self.unknown = unknown_token(state["model"], vocab)  # (id, text) of the model's unknown token, or None
        self.byte_table = token_byte_table(self.tokenizer, state, self.vocab_size, added)
        self.encoding = tiktoken_twin(state, added)  # None: encoded by the tokenizers package

    @classmethod
    def from_file(cls, path: Path) -> "JsonTokenizer":
        path = Path(path)
        if not path.is_file():
            raise UserError(f"--tokenizer={str(path)!r} is not a file (give a tokenizer.json, char, gpt2 or bpe)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path} is not UTF-8 text, so not a tokenizer.json") from None
        return cls(text, source=str(path))

    def encode(self, text: str) -> list[int]:
        """Encode a prompt; a special token's string in it (e.g. <|endoftext|>) becomes that token."""
        if self.encoding is not None:  # the tiktoken twin: every byte is a token, nothing is lost
            return self.encoding.encode(text, allowed_special="all")
        return self.encoded_ids(self.prompt_tokenizer, text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Encode corpus text into a uint32 array: special-token strings in it are plain text."""
        if self.encoding is not None:
            return self.encoding.encode_to_numpy(text, disallowed_special=())
        return self.encoded_ids(self.corpus_tokenizer, text).astype(np.uint32)

    def encoded_ids(self, encoder: tokenizers.Tokenizer, text: str) -> np.ndarray:
        """The ids of text, or UnencodableText naming the first part its vocabulary cannot encode. The
        Encoding's offsets (the characters each token stands for) show the two ways a vocabulary loses
        text, at the cost of one pass over them: a span read as the model's unknown token (WordLevel,
        WordPiece, Unigram, a BPE that has one; byte fallback spares it), or characters that no token
        stands for (a BPE with no unknown token drops them). Characters that the file's normalizer or
        pre-tokenizer removes by design (the spaces between a WordLevel's words, runs of spaces that
        SentencePiece folds into one) are not a vocabulary's loss: they are looked for only when some
        character has no token. Byte-level BPEs cover every character."""
        encoding = encoder.encode(text, add_special_tokens=False)
        ids = np.array(encoding.ids, dtype=np.int64)
        unknown = self._unknown_spans(text, ids, encoding.offsets)
        covered = coverage(encoding.offsets, len(text))
        dropped = None if covered.all() else first_dropped(encoder, text, covered)
        if dropped is not None and (not unknown or dropped < unknown[0][0]):
            raise UnencodableText(text[dropped], dropped, self.source, "it has no token for it and would drop it")
        if unknown:
            start, end = unknown[0]
            reason = f"it would read them as its unknown token {self.unknown[1]!r}"
            raise UnencodableText(text[start:end], start, self.source, reason)
        return ids

    def _unknown_spans(self, text: str, ids: np.ndarray, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The (start, end) characters read as the unknown token, unless the text spells that token."""
        if self.unknown is None:
            return []
        unknown_id, spelling = self.unknown
        spans = (offsets[i] for i in np.flatnonzero(ids == unknown_id))
        return [(start, end) for start, end in spans if text[start:end] != spelling]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        return self.byte_table[token]

    def to_json(self) -> str:
        """The tokenizer.json text, as given."""
        return self.text


def plain_encoder(text: str) -> tokenizers.Tokenizer:
    """The tokenizer of a tokenizer.json as encode uses it: no post-processor (with no special tokens
    added, it would only move offsets: ByteLevel's trim_offsets leaves spaces outside every token),
    no truncation (a classifier's 512 tokens would cut a document short) and no padding."""
    encoder = tokenizers.Tokenizer.from_str(text)
    encoder.post_processor = None
    encoder.no_truncation()
    encoder.no_padding()
    return encoder


def unknown_token(model: dict, vocab: dict[str, int]) -> tuple[int, str] | None:
    """The id and text of the token a tokenizer.json's model reads unknown text as, if it has one:
    unk_token for BPE, WordPiece and WordLevel, unk_id for Unigram."""
    if model.get("type") == "Unigram":
        unk_id = model.get("unk_id")
        return None if unk_id is None else (unk_id, model["vocab"][unk_id][0])
    spelling = model.get("unk_token")
    return (vocab[spelling], spelling) if spelling in vocab else None


def coverage(offsets: list[tuple[int, int]], length: int) -> np.ndarray:
    """Which of the length characters of a text lie in some (start, end) span of offsets."""
    if not offsets:
        return np.zeros(length, dtype=bool)
    flat = itertools.chain.from_iterable(offsets)  # np.fromiter reads this 3 times faster than a list of pairs
    spans = np.fromiter(flat, dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)  # (spans, 2)
    opened = np.bincount(spans[:, 0], minlength=length + 1)
    closed = np.bincount(spans[:, 1], minlength=length + 1)
    return np.cumsum(opened - closed)[:length] > 0  # spans over each character


def handed_to_model(encoder: tokenizers.Tokenizer, text: str) -> np.ndarray:
    """Which characters of text the encoder's normalizer and pre-tokenizer keep for its model."""
    pretokenized = tokenizers.PreTokenizedString(text)
    if encoder.normalizer is not None:
        pretokenized.normalize(encoder.normalizer.normalize)
    if encoder.pre_tokenizer is not None:
        encoder.pre_tokenizer.pre_tokenize(pretokenized)
    splits = pretokenized.get_splits(offset_referential="original", offset_type="char")
    return coverage([offsets for _, offsets, _ in splits], len(text))


def first_dropped(encoder: tokenizers.Tokenizer, text: str, covered: np.ndarray) -> int | None:
    """The first character of text that its model drops (handed to it, yet in no token), given which
    characters the encoding's tokens cover; None if the characters without a token are only those
    that the normalizer or pre-tokenizer removes. A BPE that drops a character shifts the offsets of the
    rest of its word, so they do not say which character it was: a bisection on the text's beginnings
    finds it (the shortest beginning that loses a character ends with it)."""

    def loses(end: int, covered: np.ndarray) -> bool:
        return bool((handed_to_model(encoder, text[:end]) & ~covered).any())

    if not loses(len(text), covered):
        return None
    kept, lost = 0, len(text)  # text[:kept] loses nothing, text[:lost] loses a character
    while lost - kept > 1:
        middle = (kept + lost) // 2
        offsets = encoder.encode(text[:middle], add_special_tokens=False).offsets
        kept, lost = (kept, middle) if loses(middle, coverage(offsets, middle)) else (middle, lost)
    return lost - 1


def tokenizer_json_sha256(text: str) -> str:
    """What identifies a tokenizer.json's vocabulary in a dataset's metadata (tokenizer_sha256)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_bpe_vocab_size(vocab_size: int | None) -> None:
    if vocab_size is None:
        raise UserError("--tokenizer=bpe trains a BPE and needs its size: pass --vocab-size (e.g. 4096)")
    smallest = len(BPE_SPECIAL_TOKENS) + 256
    if not smallest <= vocab_size <= MAX_VOCAB_SIZE:
        raise UserError(
            f"--vocab-size={vocab_size} is outside {smallest:,}..{MAX_VOCAB_SIZE:,} (a byte-level BPE holds the "
            f"256 bytes and {len(BPE_SPECIAL_TOKENS)} special token; 1,024 to 65,536 is usual)"
        )


def train_bpe(
    texts: Iterable[str], vocab_size: int, *, length: int | None = None, progress: bool = True
) -> JsonTokenizer:
    """A byte-level BPE of vocab_size tokens trained on texts (GPT-2's scheme: GPT-2's split pattern,
    merges over UTF-8 bytes, so any text encodes with no unknown token). Ids: BPE_SPECIAL_TOKENS first,
    then the 256 bytes, then the merges in the order they were learnt. Merges are learnt within pieces
    of at most BPE_TRAINING_PIECE_BYTES, so that a text with no spaces trains in seconds. length is
    the number of texts, for the progress bar (the tokenizers package's, shown on a terminal)."""
    check_bpe_vocab_size(vocab_size)
    pre_tokenizers = tokenizers.pre_tokenizers
    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    # each byte is one character after ByteLevel, so the bound is in bytes (see BPE_TRAINING_PIECE_BYTES)
    bounded = pre_tokenizers.Split(tokenizers.Regex(f".{{1,{BPE_TRAINING_PIECE_BYTES}}}"), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, bounded])
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=progress,
    )
    characters = 0

    def counted() -> Iterator[str]:
        nonlocal characters
        for text in texts:
            characters += len(text)
            yield text

    tokenizer.train_from_iterator(counted(), trainer=trainer, length=length)
    if characters == 0:
        raise UserError("the corpus (or its train split) is empty: there is no text to train the tokenizer on")
    tokenizer.pre_tokenizer = split  # encoding splits as GPT-2 does, pre-tokens of any length whole
    return JsonTokenizer(tokenizer.to_str())


def tiktoken_twin(state: dict, added: dict) -> tiktoken.Encoding | None:
    """The tokenizer.json's BPE as a tiktoken Encoding, which encodes the same text into the same ids
    several times faster (docs/benchmarks.md), when the file follows GPT-2's scheme exactly, as the
    BPE trained by train_bpe and GPT-2's own tokenizer.json do: a BPE over UTF-8 bytes in GPT-2's
    alphabet, split by GPT-2's pattern, no normalizer, only special added tokens, every token of two
    bytes or more made by exactly one merge, and ids growing with the merges' order. Then tiktoken's
    rule (merge the adjacent pair whose joined token has the lowest id) is the tokenizers package's
    (apply the earliest learnt merge). Anything else (another split pattern, SentencePiece's '▁' and
    byte fallback, a normalizer) gives None: the tokenizers package encodes it."""
    model, pre_tokenizer = state.get("model") or {}, state.get("pre_tokenizer") or {}
    plain_bpe = model.get("type") == "BPE" and not any(
        model.get(key) for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
    )
    gpt2_split = pre_tokenizer.get("type") == "ByteLevel" and pre_tokenizer.get("use_regex") is True
    plain_specials = all(
        token.special and not (token.lstrip or token.rstrip or token.single_word) for token in added.values()
    )
    text_untouched = not pre_tokenizer.get("add_prefix_space") and state.get("normalizer") is None
    if not (plain_bpe and gpt2_split and text_untouched and plain_specials):
        return None
    vocab = {token: token_id for token, token_id in model["vocab"].items() if token_id not in added}
    if not all(char in byte_level_bytes() for token in vocab for char in token):
        return None
    ranks = {bytes(byte_level_bytes()[char] for char in token): token_id for token, token_id in vocab.items()}
    merges = [pair.split(" ", 1) if isinstance(pair, str) else pair for pair in model["merges"]]
    merged_ids = [vocab.get(left + right) for left, right in merges]
    single_bytes = sum(len(token) == 1 for token in ranks)
    if (
        single_bytes != 256
        or len(merges) != len(ranks) - 256
        or None in merged_ids
        or any(later <= earlier for earlier, later in itertools.pairwise(merged_ids))
    ):
        return None
    return tiktoken.Encoding(
        name="tokenizer.json",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={token.content: token_id for token_id, token in added.items()},
    )


def token_byte_table(tokenizer: tokenizers.Tokenizer, state: dict, vocab_size: int, added: dict) -> list[bytes]:
    """The bytes of text that each token id stands for when it follows other tokens, so that streaming
    a continuation token by token (StreamDecoder) shows what decoding the whole sequence shows.

    - byte-level BPE (GPT-2, Qwen, Llama 3, the BPE trained by data/prepare.py): each character of a
      token is one byte in GPT-2's printable alphabet (byte_level_alphabet);
    - SentencePiece-style vocabularies (Llama 2, Mistral): "<0xNN>" tokens are the byte NN, which may be
      part of a longer UTF-8 character; other tokens are read through the file's own decoder, behind a
      plain token, so that a leading "▁" becomes the space it is (the decoder strips it only at the start);
    - added tokens (special or not) are their text.
    Ids that no token has (holes in the vocabulary) stand for no text."""
    byte_level = '"ByteLevel"' in json.dumps(state.get("decoder"))
    byte_fallback = bool(state["model"].get("byte_fallback"))
    table = [b""] * vocab_size
    ordinary = []  # ids read through the decoder
    alphabet = byte_level_bytes()
    for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items():
        if token_id in added:
            continue
        match = BYTE_FALLBACK_TOKEN.fullmatch(token) if byte_fallback else None
        if byte_level:
            table[token_id] = b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode("utf-8") for c in token)
        elif match:
            table[token_id] = bytes([int(match.group(1), 16)])
        else:
            ordinary.append(token_id)
    if ordinary:
        anchor = min(ordinary)
        head = tokenizer.decode([anchor], skip_special_tokens=False)
        decoded = tokenizer.decode_batch([[anchor, token_id] for token_id in ordinary], skip_special_tokens=False)
        for token_id, text in zip(ordinary, decoded, strict=True):
            if not text.startswith(head):  # a decoder whose output is not additive: the token read alone
                text = head + tokenizer.decode([token_id], skip_special_tokens=False)
            table[token_id] = text[len(head) :].encode("utf-8")
    for token_id, token in added.items():
        table[token_id] = token.content.encode("utf-8")
    return table


@lru_cache(maxsize=1)
def byte_level_bytes() -> dict[str, int]:
    """The byte that each character of byte_level_alphabet spells."""
    return {char: byte for byte, char in enumerate(byte_level_alphabet())}


def byte_level_spelling(token: bytes) -> str:
    """How a byte-level BPE's tokenizer.json spells a token: each byte as its byte_level_alphabet character."""
    alphabet = byte_level_alphabet()
    return "".join(alphabet[byte] for byte in token)


@lru_cache(maxsize=1)
def byte_level_alphabet() -> tuple[str, ...]:
    """GPT-2's map from bytes to printable characters, in byte order: a byte that prints as itself
    (ASCII '!'..'~', Latin-1 '¡'..'¬' and '®'..'ÿ') keeps its code point; the 68 others (controls, space,
    soft hyphen) take the code points 256, 257, ... in byte order. Byte-level BPE vocabularies spell
    their tokens in this alphabet."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = iter(range(256, 512))
    return tuple(chr(byte) if byte in printable else chr(next(others)) for byte in range(256))


Tokenizer = CharTokenizer | GPT2Tokenizer | JsonTokenizer


@lru_cache(maxsize=1)
def gpt2_ranks() -> dict[bytes, int]:
    """GPT-2's merge ranks (token bytes -> id) from the shipped rank file, checked against its hash."""
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
    return ranks


@lru_cache(maxsize=4)
def gpt2_encoding(added: tuple[str, ...] = ()) -> tiktoken.Encoding:
    """GPT-2's encoding built from the shipped rank file, with no network access; added special
    tokens take the ids after <|endoftext|>."""
    ranks = gpt2_ranks()
    specials = {token: len(ranks) + i for i, token in enumerate((END_OF_TEXT, *added))}
    return tiktoken.Encoding(
        name="gpt2" if not added else "gpt2+chat",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens=specials,
        explicit_n_vocab=len(ranks) + len(specials),
    )


def split_specials(text: str, specials: dict[str, int]) -> Iterator[tuple[str, int | None]]:
    """text as pieces: (ordinary text, None) and (a special token's string, its id), in order. At each
    place the longest special token that starts there is taken, as the tokenizers package does."""
    if not specials:
        yield text, None
        return
    pattern = "|".join(re.escape(token) for token in sorted(specials, key=len, reverse=True))
    start = 0
    for match in re.finditer(pattern, text):
        if match.start() > start:
            yield text[start : match.start()], None
        yield match.group(), specials[match.group()]
        start = match.end()
    if start < len(text):
        yield text[start:], None


def with_special_tokens(tokenizer: "Tokenizer", tokens: tuple[str, ...]) -> "Tokenizer":
    """The tokenizer with the special tokens among `tokens` that it lacks added after its own ids (the
    vocabulary grows by their count), in that order; the others keep their ids."""
    missing = tuple(token for token in tokens if token not in tokenizer.specials)
    if isinstance(tokenizer, CharTokenizer):
        return CharTokenizer(tokenizer.chars, (*tokenizer.added_specials, *missing))
    if isinstance(tokenizer, GPT2Tokenizer):
        return GPT2Tokenizer((*tokenizer.added_specials, *missing))
    grown = tokenizers.Tokenizer.from_str(tokenizer.text)
    base = grown.get_vocab_size(with_added_tokens=True)
    grown.add_special_tokens(list(missing))
    json_tokenizer = JsonTokenizer(grown.to_str(), source=tokenizer.source)
    json_tokenizer.added_specials = (*tokenizer.added_specials, *missing)
    if json_tokenizer.vocab_size != base + len(missing):
        raise UserError(f"{tokenizer.source}: adding {', '.join(missing)} did not give them new ids after its own")
    return json_tokenizer


def vocabulary_fingerprint(meta: dict) -> str:
    """A short hash of what the token ids of a prepared dataset (or a checkpoint, which carries the
    same metadata) stand for: the tokenizer, its size and its mapping (for characters, which
    character each id is; GPT-2's ranks are fixed by GPT2_RANKS_SHA256; a tokenizer.json by its
    sha256). Equal fingerprints mean that text becomes the same ids."""
    kind = meta.get("tokenizer")
    mapping = {"char": meta.get("chars"), "json": meta.get("tokenizer_sha256")}.get(kind, GPT2_RANKS_SHA256)
    identity = {"tokenizer": meta.get("tokenizer"), "vocab_size": meta.get("vocab_size"), "mapping": mapping}
    added = (meta.get("chat") or {}).get("added_specials")
    if added:  # a vocabulary without added tokens keeps the fingerprint it always had
        identity["added_specials"] = added
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def tokenizer_from_meta(meta: dict) -> Tokenizer:
    """The tokenizer a prepared dataset (or a checkpoint, which carries the same metadata) was made with."""
    kind = meta.get("tokenizer")
    chat = meta.get("chat") or {}
    added = tuple(chat.get("added_specials", ()))
    if kind == "char":
        tokenizer = CharTokenizer(meta["chars"], added)
    elif kind == "gpt2":
        tokenizer = GPT2Tokenizer(added)
    elif kind == "json":  # its added tokens are in the tokenizer.json itself
        tokenizer = JsonTokenizer(meta["tokenizer_json"], source="the tokenizer.json of the dataset metadata")
        tokenizer.added_specials = added
    else:
        raise UserError(f"tokenizer={kind!r} in the dataset metadata is unknown (expected 'char', 'gpt2' or 'json')")
    if chat:
        tokenizer.with_chat_template(chat["template"], chat.get("variables", {}))
    return tokenizer


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
