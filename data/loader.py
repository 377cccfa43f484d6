"""Reading prepared datasets: token ids in train.bin / val.bin plus meta.json (see data/prepare.py).

Batches are random windows: x = tokens[i : i + T] and y = tokens[i + 1 : i + T + 1], so position t
of y is the token that follows position t of x.

A chat dataset (meta.json has "chat", data/prepare.py --chat) also has {split}.mask.bin, a byte per
token: bit 0 says the token is trained, bit 1 that a conversation starts there. Its windows start
where a conversation starts, so that every trained token is read after the whole of its conversation
before it (a conversation that the window's end cuts only loses its tail there), and the targets of
untrained tokens are -1: no loss.
"""

from pathlib import Path

import numpy as np
import torch

from data.files import read_json
from data.tokenizer import TOKENIZER_FILE, tokenizer_json_sha256
from errors import UserError

SPLITS = ("train", "val")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
COUNT_KEYS = ("train_tokens", "val_tokens", "train_bytes", "val_bytes")
META_KEYS = ("tokenizer", "vocab_size", "dtype", *COUNT_KEYS)
TRAINED, CONVERSATION_START = 1, 2  # the bits of a chat dataset's mask byte for each token
SCAN_TOKENS = 1 << 26  # token ids checked at a time (128 MB of uint16): memory stays flat


class TokenDataset:
    """A prepared dataset folder: meta.json, train.bin and val.bin."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        self.dtype = TOKEN_DTYPES[self.meta["dtype"]]
        self.chat = "chat" in self.meta  # conversations, with a mask file per split
        self._starts = {}  # split -> where its conversations start (np.ndarray), read once
        for split in SPLITS:
            files = [(self.path(split), self.dtype)] + ([(self.mask_path(split), np.uint8)] if self.chat else [])
            for path, dtype in files:
                if not path.is_file():
                    raise UserError(f"{path} is missing (prepare the dataset again: python data/prepare.py)")
                expected = self.meta[f"{split}_tokens"] * np.dtype(dtype).itemsize
                if path.stat().st_size != expected:
                    raise UserError(
                        f"{path} holds {path.stat().st_size} bytes but meta.json promises "
                        f"{self.meta[f'{split}_tokens']} {np.dtype(dtype).name} tokens ({expected} bytes); "
                        f"prepare the dataset again"
                    )
            self._check_ids(split)

    def _check_ids(self, split: str) -> None:
        """Every id in the split is below vocab_size: a meta.json that does not belong to the .bin
        (or a dtype that does not match its bytes) would otherwise index past the embedding, a crash
        in the middle of a run (on a GPU, one that takes the process down). One pass over the file
        at start-up."""
        if self.meta[f"{split}_tokens"] == 0:
            return  # nothing to read (and an empty file cannot be memory-mapped); check_fits refuses it
        tokens = self.tokens(split)
        for start in range(0, len(tokens), SCAN_TOKENS):
            chunk = tokens[start : start + SCAN_TOKENS]
            if int(chunk.max()) >= self.vocab_size:
                at = start + int(np.argmax(chunk >= self.vocab_size))
                raise UserError(
                    f"{self.path(split)} holds the token id {int(tokens[at])} at position {at:,}, but meta.json "
                    f"declares vocab_size={self.vocab_size} and dtype {self.meta['dtype']}: the two do not belong "
                    f"together (prepare the dataset again)"
                )

    @property
    def vocab_size(self) -> int:
        return self.meta["vocab_size"]

    def bytes_per_token(self, split: str) -> float:
        """UTF-8 bytes of text per token in a split: converts a loss per token into bits per byte,
        which compares across tokenizers."""
        return self.meta[f"{split}_bytes"] / self.meta[f"{split}_tokens"]

    def path(self, split: str) -> Path:
        return self.directory / f"{split}.bin"

    def mask_path(self, split: str) -> Path:
        return self.directory / f"{split}.mask.bin"

    def mask(self, split: str) -> np.memmap:
        """A chat dataset's mask bytes (bit 0: trained; bit 1: a conversation starts)."""
        return np.memmap(self.mask_path(split), dtype=np.uint8, mode="r")

    def window_starts(self, split: str, block_size: int) -> np.ndarray | None:
        """Where windows of block_size + 1 tokens may start: anywhere (None) for text, at the start of
        a conversation for a chat dataset."""
        if not self.chat:
            return None
        if split not in self._starts:
            self._starts[split] = np.flatnonzero(self.mask(split) & CONVERSATION_START)
        return fitting_starts(self._starts[split], self.meta[f"{split}_tokens"], block_size)

    def tokens(self, split: str) -> np.memmap:
        # A fresh read-only memory map per call: pages read through a long-lived map stay counted
        # against the process, so RAM would creep up over a long run.
        return np.memmap(self.path(split), dtype=self.dtype, mode="r")

    def check_fits(self, block_size: int) -> None:
        for split in SPLITS:
            n_tokens = self.meta[f"{split}_tokens"]
            if n_tokens < block_size + 1:
                raise UserError(
                    f"the {split} split of {self.directory} has {n_tokens} tokens, fewer than "
                    f"model.block_size + 1 = {block_size + 1} (use a smaller block_size or more data)"
                )
        if not self.chat:
            return
        longest = self.meta["chat"]["longest"]
        if longest > block_size:
            raise UserError(
                f"{self.directory} holds a conversation of {longest:,} tokens, longer than model.block_size="
                f"{block_size:,}: it would be cut (prepare it again with --block-size {block_size} and --too-long "
                f"truncate, or train with a larger block_size)"
            )
        for split in SPLITS:
            if not len(self.window_starts(split, block_size)):
                raise UserError(
                    f"no conversation of the {split} split of {self.directory} starts {block_size + 1:,} tokens "
                    f"before its end (use more conversations or a smaller block_size)"
                )
            if not has_trained_target(self.mask(split), block_size):
                raise UserError(
                    f"the {split} split of {self.directory} has no trained token that a window of model.block_size="
                    f"{block_size:,} tokens reaches, so its loss would be a mean over nothing (prepare it again "
                    f"with python data/prepare.py --chat and a --block-size that keeps the replies, up to the "
                    f"model's)"
                )


def fitting_starts(starts: np.ndarray, n_tokens: int, block_size: int) -> np.ndarray:
    """Of a chat split's conversation starts, those a window of block_size + 1 tokens fits after,
    before the split's end (it holds n_tokens)."""
    return starts[starts <= n_tokens - block_size - 1]


def has_trained_target(mask: np.ndarray, block_size: int) -> bool:
    """Whether a chat split's mask bytes give some window a trained target. Windows of block_size + 1
    tokens start where a conversation starts, block_size + 1 tokens or more before the split's end (as
    RandomWindows draws them); their targets are their tokens after the first. Read in chunks: stops at
    the first chunk that has one, which is almost always the first."""
    starts = fitting_starts(np.flatnonzero(mask & CONVERSATION_START), len(mask), block_size)
    if not len(starts):
        return False
    for first in range(0, len(mask), SCAN_TOKENS):
        trained = first + np.flatnonzero(mask[first : first + SCAN_TOKENS] & TRAINED)
        before = np.searchsorted(starts, trained) - 1  # the last window start before each trained token
        if np.any((before >= 0) & (trained - starts[before.clip(min=0)] <= block_size)):
            return True
    return False


def read_meta(directory: Path) -> dict:
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise UserError(
            f"no prepared dataset at {directory} (meta.json is missing); bundled datasets "
            f"(shakespeare_char, shakespeare) are prepared on first use, others with "
            f"python data/prepare.py"
        )
    meta = read_json(meta_path, advice="; prepare the dataset again")
    if isinstance(meta, dict) and meta.get("tokenizer") == "json":
        meta["tokenizer_json"] = read_tokenizer_file(directory / TOKENIZER_FILE)
    return check_meta(meta, str(meta_path), "prepare the dataset again")


def read_tokenizer_file(path: Path) -> str:
    """The text of a dataset's tokenizer.json. It joins the metadata in memory (`tokenizer_json`), so a
    checkpoint, which keeps the metadata, carries its tokenizer and needs no dataset folder to sample."""
    if not path.is_file():
        raise UserError(
            f"{path} is missing, and the dataset's token ids mean nothing without it; prepare the dataset again"
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text, so not a tokenizer.json; prepare the dataset again") from None


def check_meta(meta: object, source: str, fix: str) -> dict:
    """A dataset's metadata (from meta.json, or the copy a checkpoint keeps) with every key the
    trainer and sampler read, of the right type; else a UserError naming source and ending in fix."""
    if not isinstance(meta, dict):
        raise UserError(f"{source} holds a {type(meta).__name__}, not the metadata of a prepared dataset; {fix}")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise UserError(f"{source} lacks {', '.join(missing)}; {fix}")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise UserError(f"{source}: dtype={meta['dtype']!r} is not one of {', '.join(TOKEN_DTYPES)}; {fix}")
    for key in COUNT_KEYS:
        if not _is_count(meta[key]):
            raise UserError(f"{source}: {key}={meta[key]!r} is not a whole number of 0 or more; {fix}")
    if not _is_count(meta["vocab_size"]) or meta["vocab_size"] == 0:
        raise UserError(f"{source}: vocab_size={meta['vocab_size']!r} is not a positive whole number; {fix}")
    added = check_chat_meta(meta, source, fix)
    if meta["tokenizer"] == "char":
        chars = meta.get("chars")
        if not isinstance(chars, str) or len(chars) + added != meta["vocab_size"]:
            raise UserError(
                f"{source}: chars must be the {meta['vocab_size'] - added} characters of the char tokenizer's "
                f"vocabulary, not {chars!r:.40}; {fix}"
            )
    elif meta["tokenizer"] == "json":
        text = meta.get("tokenizer_json")
        if not isinstance(text, str) or tokenizer_json_sha256(text) != meta.get("tokenizer_sha256"):
            raise UserError(
                f"{source}: the tokenizer.json is not the one the dataset was tokenized with (its sha256 is not "
                f"tokenizer_sha256={meta.get('tokenizer_sha256')!r}); {fix}"
            )
    elif meta["tokenizer"] != "gpt2":
        raise UserError(f"{source}: tokenizer={meta['tokenizer']!r} is not 'char', 'gpt2' or 'json'; {fix}")
    return meta


def check_chat_meta(meta: dict, source: str, fix: str) -> int:
    """A chat dataset's "chat" entry, checked: the template (text), the special tokens added (a list of
    strings) and the longest conversation (a count). Returns how many tokens were added."""
    if "chat" not in meta:
        return 0
    chat = meta["chat"]
    valid = (
        isinstance(chat, dict)
        and isinstance(chat.get("template"), str)
        and isinstance(chat.get("variables", {}), dict)
        and isinstance(chat.get("added_specials"), list)
        and all(isinstance(token, str) for token in chat["added_specials"])
        and _is_count(chat.get("longest"))
    )
    if not valid:
        raise UserError(f"{source}: chat={chat!r:.60} lacks a template, added_specials or longest; {fix}")
    return len(chat["added_specials"])


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class RandomWindows:
    """Batches of random windows from one split, drawn with a generator of their own so that the
    sequence of batches depends only on the seed (and can be saved and restored)."""

    def __init__(
        self,
        dataset: TokenDataset,
        split: str,
        batch_size: int,
        block_size: int,
        seed: int,
        device: torch.device,
    ):
        self.dataset = dataset
        self.split = split
        self.batch_size = batch_size
        self.block_size = block_size
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(
        self, batch_size: int | None = None, block_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, T) int64 on the device: batch_size windows of block_size tokens, the
        sampler's own sizes where not given (a training schedule gives each step's); y is -1 where no
        loss is taken (a chat dataset's untrained tokens)."""
        tokens = self.dataset.tokens(self.split)
        B, T = batch_size or self.batch_size, block_size or self.block_size
        allowed = self.dataset.window_starts(self.split, T)  # None: anywhere
        if allowed is None:
            starts = torch.randint(len(tokens) - T, (B,), generator=self.generator).tolist()
        else:
            starts = allowed[torch.randint(len(allowed), (B,), generator=self.generator).numpy()].tolist()
        windows = np.stack([tokens[i : i + T + 1] for i in starts])  # (B, T + 1)
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if allowed is not None:
            mask = self.dataset.mask(self.split)
            trained = np.stack([mask[i + 1 : i + T + 1] & TRAINED for i in starts]).astype(bool)  # (B, T): y's
            y = y.masked_fill(torch.from_numpy(~trained), -1)
        if self.device.type == "cuda":
            # pinned host memory lets the copy run asynchronously with the GPU's work
            return (
                x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True),
            )
        return x.to(self.device), y.to(self.device)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
