"""Every text file the programs read is decoded one way (data/files.py TEXT_ENCODING): UTF-8, with a
leading byte-order mark, which some Windows editors write, skipped. Each reader gives the same result
for a file with the mark as for the same file without it."""

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

import sample
from data.loader import read_meta
from data.sources import open_corpus
from interop.families import FAMILY_BY_TYPE, hf_config, tensors_to_hf
from interop.hf import load_dir, write_safetensors
from tests.conftest import tiny_config, tiny_model
from trainer.config import is_run_config, load_config, run_config_toml
from trainer.metrics import read_metrics

BYTE_ORDER_MARK = b"\xef\xbb\xbf"
GPT2 = FAMILY_BY_TYPE["gpt2"]


def corpus_texts(path: Path) -> list[str]:
    return [text for batch in open_corpus(str(path), streaming=True).text_batches(16) for text in batch]


def prompts(path: Path) -> list[str]:
    return sample.read_prompts(argparse.Namespace(prompt_file=str(path), prompt=None), default="\n")


def gpt2_config(path: Path) -> object:
    """The model config of a GPT-2 directory whose config.json is the file at path."""
    model = tiny_model(vocab_size=64)
    with open(path.parent / "model.safetensors", "wb") as f:
        write_safetensors(tensors_to_hf(model.state_dict(), model.config, GPT2), f, metadata={"format": "pt"})
    return load_dir(path.parent)[1]


def meta(path: Path) -> dict:
    return read_meta(path.parent)


READERS: dict[str, tuple[str, Callable[[Path, Path], str], Callable[[Path], object]]] = {
    # name: (file name, its text given the data folder and a run folder, what the program reads from it)
    "config": ("bom.toml", lambda data, run: "[model]\nn_layer = 3\n", lambda path: load_config(str(path), [])),
    "run-config": ("config.toml", lambda data, run: run_config_toml(tiny_config(run, data)), is_run_config),
    "prompt-file": ("prompts.txt", lambda data, run: "ROMEO:\n\nJULIET:\n", prompts),
    "corpus-txt": ("corpus.txt", lambda data, run: "First Citizen: speak.\n", corpus_texts),
    "corpus-jsonl": ("corpus.jsonl", lambda data, run: '{"text": "a"}\n{"text": "b"}\n', corpus_texts),
    "meta-json": ("meta.json", lambda data, run: (data / "shakespeare_char" / "meta.json").read_text(), meta),
    "metrics-jsonl": ("metrics.jsonl", lambda data, run: '{"step": 1, "loss": 4.2}\n', read_metrics),
    "gpt2-config-json": (
        "config.json",
        lambda data, run: json.dumps(
            hf_config(tiny_model(vocab_size=64).config, GPT2, bos_token_id=None, eos_token_id=None)
        ),
        gpt2_config,
    ),
}


@pytest.mark.parametrize("reader", READERS)
def test_a_byte_order_mark_is_skipped_by_every_reader(reader, tmp_path, data_dir):
    name, text, read = READERS[reader]
    content = text(data_dir, tmp_path / "run").encode("utf-8")
    results = []
    for folder, prefix in (("plain", b""), ("marked", BYTE_ORDER_MARK)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes(prefix + content)
        results.append(read(tmp_path / folder / name))
    plain, marked = results
    assert plain and plain == marked  # is_run_config: True for both
    assert "\ufeff" not in repr(marked)
