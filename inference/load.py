"""The one loader of a model to sample from or score: a run directory (by default the newest under
out/), a checkpoint file, or a Hugging Face model folder or hub id. sample.py, eval.py and the
lm-evaluation-harness model all load through here, and each says what it loaded with describe's
words: which run, its step of how many, its last val loss, and whether it stopped early."""

import argparse
from pathlib import Path

import torch

from data.tokenizer import Tokenizer, tokenizer_from_meta
from errors import UserError
from inference.decode_step import PRECISION_CHOICES
from model import GPT, GPTConfig
from trainer.checkpoint import CHECKPOINT_NAME, check_weights, expected_weights, load_checkpoint
from trainer.config import config_from_dict
from trainer.metrics import METRICS_NAME, read_metrics
from trainer.runtime import check_fits_in_memory

RUNS_ROOT = Path("out")  # where train.py writes runs by default, and where the newest is looked for


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that pick the model to load, as sample.py and serve.py take them: --out-dir or --init-from
    (neither: the newest run), then --device, --dtype and --precision (the products' precision)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--out-dir", help=f"run directory holding {CHECKPOINT_NAME} (default: the most recent run under {RUNS_ROOT}/)"
    )
    source.add_argument(
        "--init-from",
        help="a Hugging Face model folder (config.json, model.safetensors or shards, tokenizer.json) of a family "
        "in docs/models.md, or a hub id (owner/name), fetched through the Hugging Face cache, or a GGUF file "
        "(MODEL.gguf, of llama.cpp, Ollama or LM Studio), dequantized",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the model is cast to this; auto: bfloat16 on GPUs from Ampere on, float16 on older ones, else float32",
    )
    parser.add_argument(
        "--precision",
        default="auto",
        choices=PRECISION_CHOICES,
        help="on an x86-64 CPU, the linear layers' weights in float32, float16, bfloat16 or int8 (one scale per "
        "output row), the rest of a float32 model staying float32; auto: the model's dtype (docs/sampling.md)",
    )


def load_model(
    out_dir: str | None = None, checkpoint: str | None = None, init_from: str | None = None
) -> tuple[GPT, Tokenizer, str]:
    """The model (on the CPU, in eval mode), its tokenizer and a description of what was loaded:
    the checkpoint file, else init_from (a Hugging Face folder or hub id), else out_dir's
    checkpoint, else the checkpoint of the run under RUNS_ROOT written last."""
    if checkpoint is not None:
        path, chosen = Path(checkpoint), None
    elif init_from is not None:
        from interop.pretrained import model_from_pretrained  # Hugging Face folders' room: a run needs none of it

        model, tokenizer, folder = model_from_pretrained(init_from, key="--init-from")
        return model, tokenizer, str(folder)
    elif out_dir is not None:
        path, chosen = Path(out_dir) / CHECKPOINT_NAME, None
    else:
        path, chosen = latest_run(RUNS_ROOT) / CHECKPOINT_NAME, f"the newest run under {RUNS_ROOT}/"
    state = load_checkpoint(path)
    model, tokenizer = model_from_checkpoint(state, path)
    facts = [fact for fact in (chosen, describe_checkpoint(state, path)) if fact]
    return model, tokenizer, f"{path} ({'; '.join(facts)})"


def describe_checkpoint(state: dict, path: Path) -> str:
    """Its step of the run's train.max_iters, whether the run stopped before them (a Ctrl-C, a
    preemption, or a run still training), and the last val loss the run directory's metrics.jsonl
    records up to that step."""
    step = state["step"]
    max_iters = config_from_dict(state["config"], source=str(path)).train.max_iters
    progress = f"step {step:,} of {max_iters:,}" + (", interrupted" if step < max_iters else "")
    return f"{progress}, {_last_val_loss(path.parent / METRICS_NAME, step)}"


def _last_val_loss(metrics: Path, step: int) -> str:
    if not metrics.is_file():
        return f"no {METRICS_NAME} beside it, so no val loss"
    try:
        records = read_metrics(metrics)
    except UserError:  # a damaged log says nothing about the weights, which load on their own
        return f"val loss unknown ({metrics} is damaged)"
    evaluations = [r for r in records if "val_loss" in r and r["step"] <= step]
    if not evaluations:
        return "no val loss recorded yet"
    last = evaluations[-1]
    return f"val loss {last['val_loss']:.4f} at step {last['step']:,}"


def latest_run(root: Path) -> Path:
    """The run directory under root whose checkpoint was written last."""
    checkpoints = sorted(root.glob(f"*/{CHECKPOINT_NAME}"), key=lambda p: p.stat().st_mtime)
    if not checkpoints:
        raise UserError(
            f"no run with a checkpoint under {root}/ (train one first: python train.py --config "
            f"configs/shakespeare_char.toml, or pass --out-dir)"
        )
    return checkpoints[-1].parent


def model_from_checkpoint(checkpoint: dict, path: Path) -> tuple[GPT, Tokenizer]:
    """The trained model (on the CPU, in eval mode) and the tokenizer of its dataset."""
    cfg = config_from_dict(checkpoint["config"], source=str(path))
    params = cfg.model.num_params()
    check_fits_in_memory(
        4 * params,
        torch.device("cpu"),
        f"the {params:,} float32 parameters of the model that the config in {path} describes",
        "load it on a machine with more memory",
    )
    if "lora" in checkpoint:  # adapters only: the frozen base is read again from where it came from
        from finetune.init_from import lora_model  # fine-tuning's room: a plain run's sampling never reads it

        model = lora_model(checkpoint, path, cfg.model, cfg.lora)
    else:
        # names and shapes only, before the model is allocated
        check_weights(expected_weights(cfg.model), checkpoint["model"], f"the weights in {path}")
        model = GPT(cfg.model)
        model.load_state_dict(checkpoint["model"])
    tokenizer = tokenizer_from_meta(checkpoint["dataset"])
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    return model.eval(), tokenizer


class PromptTooLong(UserError):
    """A prompt of more tokens than the model's context."""


def check_prompt(prompt: str, ids: list[int], config: GPTConfig) -> None:
    """A prompt's ids are what `generate` takes: 1 to block_size of them, and a whole block for a
    block-causal model; else a UserError naming the prompt (PromptTooLong past the context)."""
    if not ids:  # a tokenizer.json whose pre-tokenizer removes all of it (spaces between words)
        raise UserError(f"the prompt {prompt!r:.60} encodes to no tokens: give a prompt with text the tokenizer keeps")
    if len(ids) > config.block_size:
        raise PromptTooLong(
            f"the prompt is {len(ids)} tokens but the model's context is block_size={config.block_size} "
            f"tokens (shorten the prompt)"
        )
    if len(ids) < config.attn_block:
        raise UserError(
            f"the prompt is {len(ids)} tokens but a block-causal model (model.attn_block={config.attn_block}) "
            f"predicts each block from the complete block before it (give a prompt of at least {config.attn_block} "
            f"tokens)"
        )
