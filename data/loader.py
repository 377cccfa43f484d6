"""Reading prepared datasets: token ids in train.bin / val.bin plus meta.json (see data/prepare.py).

Batches are random windows: x = tokens[i : i + T] and y = tokens[i + 1 : i + T + 1], so position t
of y is the token that follows position t of x.
"""

import json
from pathlib import Path

import numpy as np
import torch

from errors import UserError

SPLITS = ("train", "val")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
META_KEYS = ("tokenizer", "vocab_size", "dtype", "train_tokens", "val_tokens", "train_bytes", "val_bytes")


class TokenDataset:
    """A prepared dataset folder: meta.json, train.bin and val.bin."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        self.dtype = TOKEN_DTYPES[self.meta["dtype"]]
        for split in SPLITS:
            path = self.path(split)
            if not path.is_file():
                raise UserError(f"{path} is missing (prepare the dataset again: python data/prepare.py)")
            expected = self.meta[f"{split}_tokens"] * np.dtype(self.dtype).itemsize
            if path.stat().st_size != expected:
                raise UserError(
                    f"{path} holds {path.stat().st_size} bytes but meta.json promises "
                    f"{self.meta[f'{split}_tokens']} {self.meta['dtype']} tokens ({expected} bytes); "
                    f"prepare the dataset again"
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


def read_meta(directory: Path) -> dict:
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise UserError(
            f"no prepared dataset at {directory} (meta.json is missing); bundled datasets "
            f"(shakespeare_char, shakespeare) are prepared on first use, others with "
            f"python data/prepare.py"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{meta_path} is not valid JSON ({e}); prepare the dataset again") from None
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise UserError(f"{meta_path} lacks {', '.join(missing)}; prepare the dataset again")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise UserError(f"{meta_path}: dtype={meta['dtype']!r} is not one of {', '.join(TOKEN_DTYPES)}")
    return meta


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

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, block_size) int64 on the device."""
        tokens = self.dataset.tokens(self.split)
        T = self.block_size
        starts = torch.randint(len(tokens) - T, (self.batch_size,), generator=self.generator)
        windows = np.stack([tokens[i : i + T + 1] for i in starts.tolist()])  # (B, T + 1)
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
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
