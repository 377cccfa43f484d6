"""Checkpoints: plain data only (tensors, numbers, strings, dicts), written atomically.

A checkpoint loads with `torch.load(weights_only=True)`, which refuses any pickled object that
could run code. It is written to a temporary file that is flushed to disk and then renamed over
the old one, so a crash mid-write leaves the previous checkpoint intact.
"""

import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from data.files import atomic_open, shipped_run
from data.loader import RandomWindows, check_meta
from errors import UserError
from model import GPT, GPTConfig
from trainer.config import CHECKPOINT_NAME, check_token_keys, config_from_dict
from trainer.objective import Objective

FORMAT_VERSION = 3
# format 2 differs in one meaning only: its QK-norm was RMSNorm whatever model.norm said, where
# format 3's takes model.norm's kind; so a format-2 checkpoint reads as format 3 unless it combines
# qk_norm with LayerNorm blocks, the one model this version no longer builds
READABLE_FORMATS = (2, 3)
# what every checkpoint holds, as Trainer.checkpoint_state writes it
KEY_TYPES = {
    "format_version": int,
    "step": int,
    "config": dict,
    "dataset": dict,
    "model": dict,
    "optimizer": dict,
    "scaler": dict,
    "rng": list,
    "wandb_run_id": str,
}
# a LoRA run's checkpoint also holds "lora": where its frozen base came from and the base's
# fingerprint ({"source": str, "fingerprint": str}, finetune/lora.py), and "name": str, the base as
# train.init_from gave it (older checkpoints lack it); its "model" holds the adapters only
LORA_KEYS = ("source", "fingerprint")
TYPE_NAMES = {int: "an integer", dict: "a table", list: "a list", str: "a string"}


def save_checkpoint(state: dict, path: Path, keep: int = 1) -> None:
    """Write state to path (ckpt.pt). With keep > 1 it is also written as ckpt_STEP.pt beside it, a
    file of its own, and only the newest `keep` of those remain: older weights to go back to. To
    resume from one, copy it over ckpt.pt (the other files are not touched). A write that fails (a
    full disk) is a UserError; the checkpoint already there stays as it was."""
    try:
        _write_checkpoint(state, path, keep)
    except OSError as e:
        raise UserError(
            f"the checkpoint of step {state['step']} could not be written to {path.parent} ({e.strerror or e}); "
            f"{path} is the previous one, unchanged (free some space, or move the run, and resume from it)"
        ) from None


def _write_checkpoint(state: dict, path: Path, keep: int) -> None:
    if keep == 1:
        with atomic_open(path) as f:
            torch.save(state, f)
        return
    step_path = path.with_name(f"{path.stem}_{state['step']:08d}{path.suffix}")
    with atomic_open(step_path) as f:
        torch.save(state, f)
    with atomic_open(path) as f, open(step_path, "rb") as source:
        shutil.copyfileobj(source, f)  # a copy, not a hard link: rewriting one name must not change the other
    # only the names this writes (ckpt_ and a step): a ckpt_best.pt of the user's is never removed
    step_name = re.compile(rf"{re.escape(path.stem)}_\d{{8,}}{re.escape(path.suffix)}")
    written = sorted(p for p in path.parent.iterdir() if step_name.fullmatch(p.name))  # zero-padded: step order
    # a run resumed from an older checkpoint abandons those after it
    abandoned = [p for p in written if p.name > step_path.name]
    for old in abandoned + [p for p in written if p.name <= step_path.name][:-keep]:
        old.unlink()


def rng_state(device: torch.device, batches: RandomWindows, objective: Objective) -> dict:
    """This process's random number generators and where its training batches and objective stand,
    as plain data: a checkpoint's entry for one process."""
    numpy_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "mps": torch.mps.get_rng_state() if device.type == "mps" else None,
        "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]),
        "python": random.getstate(),
        "train_batches": batches.state_dict(),
        "train_objective": objective.state_dict(),
    }


def restore_rng_state(rng: dict, device: torch.device, batches: RandomWindows, objective: Objective) -> None:
    """Put back what rng_state saved for this process."""
    torch.set_rng_state(rng["torch"])
    if device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)
    if device.type == "mps" and rng["mps"] is not None:
        torch.mps.set_rng_state(rng["mps"])
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(rng["python"])
    batches.load_state_dict(rng["train_batches"])
    if "train_objective" in rng:  # checkpoints from before prefix-LM have none: nothing was drawn
        objective.load_state_dict(rng["train_objective"])


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint onto the CPU; any problem is a UserError naming the file."""
    if not path.is_file():
        run = shipped_run(Path(path).parent)
        raise UserError(f"no checkpoint at {path}" + (f": {run}" if run else ""))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load fails on damaged files in many ways; each means the same here
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            raise UserError(
                f"refused to load {path}: it holds pickled Python objects that could run code, not just "
                f"tensors and plain data (this trainer never writes such a file: load only checkpoints you trust)"
            ) from None
        raise UserError(
            f"{path} is not a readable checkpoint: truncated or corrupt (use a copy of it, or an older ckpt_STEP.pt)"
        ) from None
    if not isinstance(state, dict) or "format_version" not in state or "model" not in state:
        raise UserError(f"{path} is not a checkpoint written by this trainer (it lacks format_version and model)")
    if state["format_version"] not in READABLE_FORMATS:
        raise UserError(
            f"{path} has checkpoint format {state['format_version']}; this version reads formats "
            f"{' and '.join(map(str, READABLE_FORMATS))}"
        )
    _check_contents(state, path)
    model = state["config"].get("model", {})
    if state["format_version"] == 2 and model.get("qk_norm") and model.get("norm", "layernorm") == "layernorm":
        raise UserError(
            f"{path} was trained with RMSNorm QK-norm in a LayerNorm model (checkpoint format 2); this "
            f"version's QK-norm takes model.norm's kind and no longer builds that model (train it again, "
            f"or use a version of this trainer from before checkpoint format 3)"
        )
    return state


def _check_contents(state: dict, path: Path) -> None:
    """Every entry the trainer writes is there with its type, and every weight is a finite number, so
    that nothing fails later in the middle of resuming or sampling, and nothing is scored or exported
    from weights that are not numbers: a hand-edited, damaged or diverged checkpoint is named here."""
    fix = "the file was edited or damaged: use a copy of it, or an older ckpt_STEP.pt"
    for key, kind in KEY_TYPES.items():
        if key not in state:
            raise UserError(f"{path} lacks its {key!r} entry ({fix})")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise UserError(f"{path}: {key!r} is a {type(state[key]).__name__}, not {TYPE_NAMES[kind]} ({fix})")
    if state["step"] < 0:
        raise UserError(f"{path}: step={state['step']} is negative ({fix})")
    lora = state.get("lora", {key: "" for key in LORA_KEYS})
    strings = isinstance(lora, dict) and all(isinstance(lora.get(key), str) for key in LORA_KEYS)
    if not strings or not isinstance(lora.get("name", ""), str):
        raise UserError(f"{path}: its 'lora' entry is not a table of {' and '.join(LORA_KEYS)} strings ({fix})")
    not_tensors = [name for name, value in state["model"].items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise UserError(f"{path}: the weight {not_tensors[0]!r} is not a tensor ({fix})")
    problem = non_finite(state["model"])
    if problem is not None:
        raise UserError(
            f"{path}: the weight {problem}: the run diverged before this checkpoint was written, or the file "
            f"was damaged (use an older ckpt_STEP.pt, and resume from it with a lower optim.learning_rate)"
        )
    check_meta(state["dataset"], f"the dataset metadata in {path}", fix)
    cfg = config_from_dict(state["config"], source=str(path))
    check_token_keys(cfg.model, state["dataset"]["vocab_size"], f"the dataset {path} was trained on", fix)


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first tensor holding NaN or infinite values, described ("NAME holds 3 NaN and 0 infinite
    values (of 4,096)"), or None: every load and write of weights asks this one question, and each
    caller says what the weights are and what to do. One pass over each tensor; the values are
    counted only once one is found."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            nans, infinities = int(tensor.isnan().sum()), int(tensor.isinf().sum())
            return f"{name} holds {nans:,} NaN and {infinities:,} infinite values (of {tensor.numel():,})"
    return None


def expected_weights(config: GPTConfig) -> dict[str, torch.Tensor]:
    """The tensors (on the meta device: names and shapes) of GPT(config): what a checkpoint of a run
    holds (a LoRA run's holds its adapters instead: finetune/lora.py's expected_adapters)."""
    with torch.device("meta"):
        return GPT(config).state_dict()


def check_weights(expected: dict[str, torch.Tensor], weights: dict, source: str) -> None:
    """Refuse weights that differ from the expected state dict, naming the first missing,
    unexpected or differently shaped tensor."""
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


def run_checkpoint(value: str) -> Path | None:
    """The checkpoint that train.init_from names: a ckpt.pt file, or a run directory holding one;
    None for anything else (scratch, resume, a Hugging Face folder or hub id, a GGUF file)."""
    path = Path(value)
    if path.is_file() and path.suffix != ".gguf":  # a .gguf is llama.cpp's file, read by interop/gguf_read.py
        return path
    return path / CHECKPOINT_NAME if (path / CHECKPOINT_NAME).is_file() else None
