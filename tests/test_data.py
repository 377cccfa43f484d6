import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data.corpus import CORPUS_DIR, ensure_prepared, prepare_text
from data.loader import RandomWindows, TokenDataset
from data.tokenizer import tokenizer_from_meta
from errors import UserError

CORPUS = (CORPUS_DIR / "tinyshakespeare.txt").read_text(encoding="utf-8")


def test_char_split_matches_nanogpt(data_dir):
    meta = json.loads((data_dir / "shakespeare_char" / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"]) == (1_003_854, 111_540)
    assert meta["vocab_size"] == 65 and meta["dtype"] == "uint16" and meta["tokenizer"] == "char"


def test_bpe_split_matches_nanogpt(bpe_data_dir):
    meta = json.loads((bpe_data_dir / "shakespeare" / "meta.json").read_text())
    assert (meta["train_tokens"], meta["val_tokens"]) == (301_966, 36_059)
    assert meta["vocab_size"] == 50257 and meta["tokenizer"] == "gpt2"


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare"])
def test_prepared_splits_decode_back_to_the_corpus(name, data_dir, bpe_data_dir):
    dataset = TokenDataset((data_dir if name == "shakespeare_char" else bpe_data_dir) / name)
    tokenizer = tokenizer_from_meta(dataset.meta)
    text = "".join(tokenizer.decode(dataset.tokens(split).tolist()) for split in ("train", "val"))
    assert text == CORPUS


def test_uint32_is_used_when_the_vocabulary_exceeds_uint16(tmp_path):
    # about 68,000 distinct characters (surrogates cannot be encoded, so they are left out)
    text = "".join(chr(c) for c in range(0x100, 0x100 + 70_000) if not 0xD800 <= c < 0xE000)
    meta = prepare_text(text, "char", tmp_path / "wide", source="generated")
    assert meta["vocab_size"] > 65_536 and meta["dtype"] == "uint32"
    dataset = TokenDataset(tmp_path / "wide")
    assert dataset.tokens("train").dtype == np.uint32
    assert tokenizer_from_meta(dataset.meta).decode(dataset.tokens("val").tolist()) == text[-meta["val_tokens"] :]


def write_counting_dataset(directory, n_tokens=1000, vocab=500):
    """A dataset whose tokens count up (mod vocab), so any window is easy to recognise."""
    directory.mkdir(parents=True)
    tokens = (np.arange(n_tokens) % vocab).astype(np.uint16)
    for split in ("train", "val"):
        tokens.tofile(directory / f"{split}.bin")
    meta = {"tokenizer": "char", "chars": "x" * vocab, "vocab_size": vocab, "dtype": "uint16"}
    meta |= {f"{split}_{count}": n_tokens for split in ("train", "val") for count in ("tokens", "bytes")}
    (directory / "meta.json").write_text(json.dumps(meta))
    return TokenDataset(directory)


def test_batches_are_windows_with_targets_shifted_by_one(tmp_path):
    dataset = write_counting_dataset(tmp_path / "count")
    windows = RandomWindows(dataset, "train", batch_size=64, block_size=16, seed=0, device=torch.device("cpu"))
    x, y = windows.next_batch()
    assert x.shape == y.shape == (64, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])  # y is x moved left by one
    assert torch.equal(y[:, -1], (x[:, -1] + 1) % 500)  # plus the token after the window
    assert torch.equal(torch.diff(x, dim=1) % 500, torch.ones(64, 15, dtype=torch.int64))  # contiguous
    assert x.max() < 500 and y.max() < 500 and x[:, 0].max() <= 1000 - 17


def test_sampler_state_restores_the_same_batches(tmp_path):
    dataset = write_counting_dataset(tmp_path / "count")
    windows = RandomWindows(dataset, "train", 4, 16, seed=0, device=torch.device("cpu"))
    windows.next_batch()
    state = windows.state_dict()
    expected = windows.next_batch()
    fresh = RandomWindows(dataset, "train", 4, 16, seed=123, device=torch.device("cpu"))
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.next_batch(), expected, strict=True))


def test_missing_dataset_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"no prepared dataset at .*nothing \(meta.json is missing\)"):
        TokenDataset(tmp_path / "nothing")


def test_dataset_smaller_than_the_context_is_a_clear_error(tmp_path):
    dataset = write_counting_dataset(tmp_path / "small", n_tokens=40)
    with pytest.raises(UserError, match=r"train split .* has 40 tokens, fewer than model.block_size \+ 1 = 65"):
        dataset.check_fits(64)


def test_data_file_of_the_wrong_length_is_a_clear_error(tmp_path):
    write_counting_dataset(tmp_path / "count")
    with open(tmp_path / "count" / "val.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(UserError, match=r"val.bin holds 2001 bytes but meta.json promises 1000 uint16 tokens"):
        TokenDataset(tmp_path / "count")


def test_empty_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="is empty"):
        prepare_text("", "char", tmp_path / "empty", source="empty.txt")
    assert not (tmp_path / "empty").exists()


def test_bundled_dataset_is_prepared_once_on_first_use(tmp_path, capsys):
    ensure_prepared("shakespeare_char", str(tmp_path))
    assert "preparing the bundled dataset" in capsys.readouterr().out
    meta_file = tmp_path / "shakespeare_char" / "meta.json"
    written = meta_file.stat().st_mtime_ns
    ensure_prepared("shakespeare_char", str(tmp_path))
    assert capsys.readouterr().out == ""
    assert meta_file.stat().st_mtime_ns == written


def test_unknown_dataset_is_not_prepared(tmp_path):
    ensure_prepared("my_corpus", str(tmp_path))
    assert not (tmp_path / "my_corpus").exists()


def resident_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the resident set size from /proc")
def test_drawing_batches_does_not_grow_resident_memory(tmp_path):
    # 64 MiB of tokens per split. A memory map kept open keeps every page it has touched resident
    # (the kernel maps whole runs of pages around each one read); a fresh map per batch releases them.
    dataset = write_counting_dataset(tmp_path / "big", n_tokens=32 << 20)
    cpu = torch.device("cpu")
    RandomWindows(dataset, "val", batch_size=64, block_size=4096, seed=0, device=cpu).next_batch()  # warm up
    before = resident_kib()
    windows = RandomWindows(dataset, "train", batch_size=64, block_size=4096, seed=0, device=cpu)
    for _ in range(200):
        windows.next_batch()
    assert resident_kib() - before < 16 << 10  # KiB: a quarter of the split
