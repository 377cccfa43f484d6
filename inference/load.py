"""The one loader of a model to sample from or score: a run directory (by default the newest under
out/), a checkpoint file, or a Hugging Face model folder or hub id. sample.py, eval.py and the
lm-evaluation-harness model all load through here, and each says what it loaded with describe's
words: which run, its step of how many, its last val loss, and whether it stopped early."""

from pathlib import Path

from data.tokenizer import Tokenizer
from errors import UserError
from interop.pretrained import model_from_pretrained
from model import GPT
from trainer.checkpoint import CHECKPOINT_NAME, latest_run, load_checkpoint, model_from_checkpoint
from trainer.config import config_from_dict
from trainer.metrics import METRICS_NAME, read_metrics

RUNS_ROOT = Path("out")  # where train.py writes runs by default, and where the newest is looked for


def load_model(
    out_dir: str | None = None, checkpoint: str | None = None, init_from: str | None = None
) -> tuple[GPT, Tokenizer, str]:
    """The model (on the CPU, in eval mode), its tokenizer and a description of what was loaded:
    the checkpoint file, else init_from (a Hugging Face folder or hub id), else out_dir's
    checkpoint, else the checkpoint of the run under RUNS_ROOT written last."""
    if checkpoint is not None:
        path, chosen = Path(checkpoint), None
    elif init_from is not None:
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
