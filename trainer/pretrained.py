"""Hugging Face GPT-2 directories for training and sampling: load one to fine-tune or sample from,
export a trained model to one. The file format itself is in model/hf_gpt2.py."""

import dataclasses
import json
import pickle
import struct
from pathlib import Path

import torch

from data.files import atomic_open, check_writable_dir, make_dir
from data.tokenizer import GPT2Tokenizer, Tokenizer
from errors import UserError
from model import GPT, GPTConfig
from model.hf_gpt2 import gpt2_difference, hf_config, load_gpt2_dir, state_dict_to_hf, write_safetensors
from trainer.config import Config

WEIGHTS_NAME = "model.safetensors"
# the attention pattern keys and their plain causal values
PATTERN_DEFAULTS = {
    name: getattr(GPTConfig(), name)
    for name in (
        "attn_window",
        "attn_sinks",
        "attn_prefix_lm",
        "attn_block",
        "attn_documents",
        "attn_document_positions",
    )
}


def load_gpt2(path: Path, key: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and weights of a GPT-2 directory; any problem is a UserError naming key and path."""
    if not path.is_dir():
        raise UserError(f"{key}={str(path)!r} is not a directory (give a Hugging Face GPT-2 directory)")
    try:
        config, state = load_gpt2_dir(path)
    except (ValueError, OSError, pickle.UnpicklingError, struct.error, KeyError) as e:
        raise UserError(f"{key}={str(path)!r} cannot be loaded: {e}") from None
    _check_gpt2_vocabulary(config, path, key)
    return config, state


def _check_gpt2_vocabulary(config: GPTConfig, path: Path, key: str) -> None:
    """A GPT-2 directory is read and written with GPT-2's BPE: its vocabulary holds those tokens, and
    may be padded beyond them (50304 computes faster), as the extra ids are never sampled (sampling
    draws among the tokenizer's ids) nor trained towards (no data holds them). A smaller vocabulary
    belongs to another tokenizer."""
    gpt2_tokens = GPT2Tokenizer().vocab_size
    if config.vocab_size < gpt2_tokens:
        raise UserError(
            f"{key}={str(path)!r} holds a model of vocab_size={config.vocab_size} ({path / 'config.json'}), fewer "
            f"than the {gpt2_tokens:,} tokens of GPT-2's BPE, the tokenizer of every GPT-2 directory here: it was "
            f"trained with another tokenizer, which cannot be used (a GPT-2 vocabulary padded beyond "
            f"{gpt2_tokens:,}, such as 50304, can)"
        )


def model_from_gpt2_dir(path: Path, key: str) -> tuple[GPT, Tokenizer]:
    """The GPT-2 model in a directory (on the CPU, in eval mode) and GPT-2's BPE tokenizer."""
    config, state = load_gpt2(path, key)
    model = GPT(config)
    model.load_state_dict(state)
    return model.eval(), GPT2Tokenizer()


def with_gpt2_shape(cfg: Config, gpt2: GPTConfig, dataset_meta: dict) -> Config:
    """The run's config for fine-tuning the GPT-2 weights in train.init_from.

    The model's shape (n_layer, n_head, n_embd, vocab_size, bias) is the directory's; model.block_size
    may shorten its context (the position table is cropped); model.dropout is the run's own.
    """
    source = cfg.train.init_from
    if dataset_meta["tokenizer"] != "gpt2":
        raise UserError(
            f"train.init_from={source!r} holds GPT-2 weights, which read GPT-2 BPE tokens, but "
            f"data.dataset={cfg.data.dataset!r} was prepared with the {dataset_meta['tokenizer']!r} tokenizer "
            f"(use a GPT-2 BPE dataset: the bundled 'shakespeare', or python data/prepare.py --tokenizer gpt2)"
        )
    if cfg.model.block_size > gpt2.block_size:
        raise UserError(
            f"model.block_size={cfg.model.block_size} is longer than the {gpt2.block_size} positions of the "
            f"GPT-2 weights in train.init_from={source!r} (use at most {gpt2.block_size})"
        )
    _require_gpt2_architecture(
        cfg.model, f"train.init_from={source!r} holds GPT-2 weights", "fine-tuning keeps GPT-2's architecture"
    )
    shape = {name: getattr(gpt2, name) for name in ("n_layer", "n_head", "n_embd", "vocab_size", "bias")}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))


def crop_positions(state: dict[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """The weights with the position table cut to the first block_size positions."""
    return state | {"transformer.wpe.weight": state["transformer.wpe.weight"][:block_size]}


def export_gpt2(model: GPT, tokenizer: Tokenizer, directory: Path) -> None:
    """Write config.json and model.safetensors that transformers' GPT2LMHeadModel.from_pretrained
    loads. The weights keep their dtype; a model trained without biases gets zero biases."""
    patterned = [key for key, plain in PATTERN_DEFAULTS.items() if getattr(model.config, key) != plain]
    if patterned:
        key = patterned[0]
        raise UserError(
            f"--export writes a GPT-2 directory, whose attention is plain causal, but this model was trained with "
            f"model.{key}={str(getattr(model.config, key)).lower()} (only models without an attention pattern export)"
        )
    check_writable_dir(directory, "--export")
    held = _model_files(directory)
    if held:
        raise UserError(
            f"--export={str(directory)!r} already holds a model ({', '.join(held)}), which the export would "
            f"replace: export into a new or empty directory"
        )
    _require_gpt2_architecture(
        model.config, "--export writes a GPT-2 model", "only a model with GPT-2's architecture can be exported"
    )
    if tokenizer.name != "gpt2":
        raise UserError(
            f"--export writes a GPT-2 directory, whose readers use GPT-2 BPE, but this model reads "
            f"{tokenizer.name!r} tokens (export a model trained on a GPT-2 BPE dataset)"
        )
    make_dir(directory)
    config = hf_config(model.config, tokenizer.eot_token)
    config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    with atomic_open(directory / WEIGHTS_NAME) as f:
        write_safetensors(state_dict_to_hf(model), f, metadata={"format": "pt"})
    with atomic_open(directory / "config.json") as f:
        f.write((json.dumps(config, indent=2) + "\n").encode("utf-8"))


def _model_files(directory: Path) -> list[str]:
    """The files of a Hugging Face model in directory: its config and weights, in any format."""
    if not directory.is_dir():
        return []
    weights = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
    return sorted(p.name for p in directory.iterdir() if p.name == "config.json" or p.name.endswith(weights))


def _require_gpt2_architecture(config: GPTConfig, context: str, reason: str) -> None:
    """One line naming the first architecture key in which config is not GPT-2, if any."""
    difference = gpt2_difference(config)
    if difference is not None:
        key, value, gpt2 = difference
        raise UserError(
            f"{context}, but model.{key}={json.dumps(value)} is not GPT-2's {json.dumps(gpt2)} ({reason}: "
            f"set model.{key}={json.dumps(gpt2)})"
        )
