"""Checkpoints: plain data only (tensors, numbers, strings, dicts), written atomically.

A checkpoint loads with `torch.load(weights_only=True)`, which refuses any pickled object that
could run code. It is written to a temporary file that is flushed to disk and then renamed over
the old one, so a crash mid-write leaves the previous checkpoint intact.
"""

import pickle
import shutil
from pathlib import Path

import torch

from data.files import atomic_open
from data.tokenizer import Tokenizer, tokenizer_from_meta
from errors import UserError
from model import GPT
from trainer.config import config_from_dict

CHECKPOINT_NAME = "ckpt.pt"
FORMAT_VERSION = 2
REQUIRED_KEYS = ("format_version", "step", "config", "dataset", "model")


def save_checkpoint(state: dict, path: Path, keep: int = 1) -> None:
    """Write state to path (ckpt.pt). With keep > 1 it is also written as ckpt_STEP.pt beside it, a
    file of its own, and only the newest `keep` of those remain: older weights to go back to. To
    resume from one, copy it over ckpt.pt (the other files are not touched)."""
    if keep == 1:
        with atomic_open(path) as f:
            torch.save(state, f)
        return
    step_path = path.with_name(f"{path.stem}_{state['step']:08d}{path.suffix}")
    with atomic_open(step_path) as f:
        torch.save(state, f)
    with atomic_open(path) as f, open(step_path, "rb") as source:
        shutil.copyfileobj(source, f)  # a copy, not a hard link: rewriting one name must not change the other
    written = sorted(path.parent.glob(f"{path.stem}_*{path.suffix}"))  # zero-padded steps: in step order
    # a run resumed from an older checkpoint abandons those after it
    abandoned = [p for p in written if p.name > step_path.name]
    for old in abandoned + [p for p in written if p.name <= step_path.name][:-keep]:
        old.unlink()


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint onto the CPU; any problem is a UserError naming the file."""
    if not path.is_file():
        raise UserError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise UserError(
                f"refused to load {path}: it holds pickled Python objects that could run code, "
                f"not just tensors and plain data (only load checkpoints you trust, and never "
                f"with weights_only=False)"
            ) from None
        raise UserError(f"{path} is not a readable checkpoint ({_first_line(e)})") from None
    except Exception as e:  # torch.load fails on damaged files in many ways; each means the same here
        raise UserError(f"{path} is not a readable checkpoint: truncated or corrupt ({_first_line(e)})") from None
    if not isinstance(state, dict) or any(key not in state for key in REQUIRED_KEYS):
        raise UserError(f"{path} is not a checkpoint written by this trainer (it lacks {', '.join(REQUIRED_KEYS)})")
    if state["format_version"] != FORMAT_VERSION:
        raise UserError(
            f"{path} has checkpoint format {state['format_version']}; this version reads format {FORMAT_VERSION}"
        )
    return state


def load_weights(model: torch.nn.Module, weights: dict, source: str) -> None:
    """model.load_state_dict(weights), with a mismatch named: the first missing, unexpected or
    differently shaped tensor."""
    expected = model.state_dict()
    missing = [name for name in expected if name not in weights]
    unexpected = [name for name in weights if name not in expected]
    if missing or unexpected:
        what = f"lack {missing[0]}" if missing else f"have {unexpected[0]}, which the model has not"
        raise UserError(
            f"{source} do not fit the model: they {what} ({len(missing)} missing, {len(unexpected)} unexpected)"
        )
    for name, tensor in expected.items():
        if weights[name].shape != tensor.shape:
            raise UserError(
                f"{source} do not fit the model: {name} has shape {tuple(weights[name].shape)}, "
                f"the model needs {tuple(tensor.shape)} (check the model.* config against the checkpoint's)"
            )
    model.load_state_dict(weights)


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
    model = GPT(cfg.model)
    load_weights(model, checkpoint["model"], f"the weights in {path}")
    tokenizer = tokenizer_from_meta(checkpoint["dataset"])
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    return model.eval(), tokenizer
