"""Where a run's weights start: from scratch, the seeded initial weights of its config (a resumed run
then loads its checkpoint over them), or, when it fine-tunes (train.init_from a run or a Hugging Face
folder, or lora.rank above 0), from finetune/init_from.py, which a run from scratch never reads."""

import difflib
from pathlib import Path

import torch

from data.files import is_hub_id, shipped_run
from data.loader import TokenDataset
from errors import UserError
from model import GPT
from trainer.checkpoint import expected_weights
from trainer.config import CHECKPOINT_NAME, INIT_FROM, Config


class Scratch:
    """A run's start from its config alone: the model as GPT(cfg.model) initialises it, and its
    checkpoints hold every weight."""

    def __init__(self, cfg: Config):
        self.cfg = cfg  # the run's config; a fine-tuning start takes its model's shape from the weights

    def expected_weights(self, cfg: Config) -> dict[str, torch.Tensor]:
        """What a checkpoint of this run holds (names and shapes, on the meta device)."""
        return expected_weights(cfg.model)

    def load(self, model: GPT, cfg: Config, checkpoint_path: Path, resumed: bool) -> None:
        """Put the starting weights into model (built from cfg.model): from scratch, those it has."""

    def saved(self, model_state: dict[str, torch.Tensor]) -> dict:
        """The entries a checkpoint holds of the model: its weights."""
        return {"model": model_state}


def starting_point(cfg: Config, dataset: TokenDataset, checkpoint: dict | None) -> Scratch:
    """Where the run in cfg starts (checkpoint: the one it resumes, or None)."""
    if cfg.train.init_from in INIT_FROM and not cfg.lora.rank:
        return Scratch(cfg)
    from finetune.init_from import FineTune  # fine-tuning's room, read only by a run that fine-tunes

    return FineTune(cfg, dataset, checkpoint)


def check_init_from(init_from: str) -> None:
    """init_from is scratch, resume, a directory, a file (a ckpt.pt or a GGUF file) or a hub id; a typo of
    scratch or resume is named as one, and the run directory of a shipped config that has no checkpoint yet
    (not a hub id) with the command that trains it."""
    path, run = Path(init_from), shipped_run(Path(init_from))
    if run and not any((path / name).is_file() for name in (CHECKPOINT_NAME, "config.json")):
        state = "does not exist yet" if not path.exists() else f"holds no {CHECKPOINT_NAME} yet"
        raise UserError(f"train.init_from={init_from!r} {state}: {run}")
    if init_from in INIT_FROM or Path(init_from).is_dir() or Path(init_from).is_file() or is_hub_id(init_from):
        return
    close = difflib.get_close_matches(init_from, INIT_FROM, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UserError(
        f"train.init_from={init_from!r} is neither {' nor '.join(INIT_FROM)} nor a directory (use scratch for a "
        f"new run, resume to continue the run in train.out_dir, a run directory or ckpt.pt to fine-tune, a "
        f"Hugging Face model folder or hub id, or a GGUF file{hint})"
    )
