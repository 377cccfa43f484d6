"""What a run records: metrics.jsonl (one JSON object per logged step or evaluation), optionally
Weights & Biases, and model FLOPs utilisation (MFU) on GPUs."""

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from data.files import atomic_open, parse_json, read_text
from errors import UserError
from model import GPTConfig
from trainer.config import WandbConfig

METRICS_NAME = "metrics.jsonl"

# Dense bf16/fp16 tensor-core peak of each GPU model in FLOP/s, from the vendors' datasheets
# (without sparsity). Matched against torch.cuda.get_device_name() in order, so a longer name
# comes before a name it contains ("H100 PCIe" before "H100", "A100" before "A10").
PEAK_FLOPS = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def peak_flops(device_name: str) -> float | None:
    """The table's peak for a GPU name such as 'NVIDIA H100 80GB HBM3', or None if unknown."""
    for pattern, flops in PEAK_FLOPS:
        if pattern in device_name:
            return flops
    return None


def flops_per_token(model_cfg: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus attention's score and
    value products, 12 * n_layer * n_head * head_dim per key a query is counted against (PaLM paper,
    appendix B; n_head * head_dim is n_embd unless head_dim is set). n_params should leave out the
    position embedding, which does no multiply.

    A query is counted against block_size keys, as PaLM and nanoGPT count causal attention (the
    masked half included), or against the attn_window + attn_sinks keys that are all a sliding
    window ever shows it. Other patterns count as causal attention: prefix-LM and block-causal
    attend about as much, and what document masking saves depends on the documents' lengths."""
    keys = model_cfg.block_size
    if model_cfg.attn_window:
        keys = min(keys, model_cfg.attn_window + model_cfg.attn_sinks)
    return 6 * n_params + 12 * model_cfg.n_layer * keys * model_cfg.n_head * model_cfg.head_size


class Throughput:
    """Training speed over the steps since the last measurement: tokens per second and, where the
    GPU's peak is known, model FLOPs utilisation. tokens_before(step) counts the tokens of the steps
    before step (a schedule grows them); MFU counts attention over full block_size rows, so a
    train.block_size_schedule's shorter rows overstate it slightly."""

    def __init__(
        self, tokens_before: Callable[[int], int], flops_per_token: float, peak_flops: float | None, step: int
    ):
        self.tokens_before = tokens_before
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.restart(step)

    def restart(self, step: int) -> None:
        self.step, self.time = step, time.perf_counter()

    def measure(self, step: int) -> dict[str, float]:
        now = time.perf_counter()
        tokens_per_sec = (self.tokens_before(step) - self.tokens_before(self.step)) / (now - self.time)
        self.step, self.time = step, now
        if self.peak_flops is None:
            return {"tokens_per_sec": tokens_per_sec}
        return {"tokens_per_sec": tokens_per_sec, "mfu": self.flops_per_token * tokens_per_sec / self.peak_flops}


class SlowdownWatch:
    """Notices, once per run, a training speed that fell far below what the run showed earlier: on a
    CPU, the sign of other work taking the cores that the run's threads wait for."""

    RATIO = 1 / 3  # slower than this share of the best rate seen ...
    PATIENCE = 3  # ... at this many logged intervals in a row (one slow interval is a hiccup)

    def __init__(self):
        self.best = 0.0
        self.intervals = 0
        self.slow = 0
        self.noticed = False

    def update(self, tokens_per_sec: float) -> float | None:
        """The best rate seen, the first time the rate has stayed below RATIO of it for PATIENCE
        intervals; else None. The first interval, which pays the start-up costs, is not counted."""
        self.intervals += 1
        if self.intervals == 1:
            return None
        self.slow = self.slow + 1 if tokens_per_sec < self.RATIO * self.best else 0
        self.best = max(self.best, tokens_per_sec)
        if self.slow < self.PATIENCE or self.noticed:
            return None
        self.noticed = True
        return self.best


class MetricsLog:
    """Appends records to run_dir/metrics.jsonl (each line written at once) and sends them to wandb."""

    def __init__(
        self, run_dir: Path, wandb_cfg: WandbConfig, run_config: dict, resume_step: int | None, wandb_run_id: str | None
    ):
        self.path = run_dir / METRICS_NAME
        if resume_step is not None and self.path.exists():
            self._drop_records_after(resume_step)
        # unbuffered: each record reaches the file in one write, and a failed write leaves nothing
        # pending that closing the file would try (and fail) to write again
        self.file = open(self.path, "ab", buffering=0)
        self.wandb_run = None
        self.wandb_run_id = wandb_run_id
        if wandb_cfg.enabled:
            import wandb  # imported only when asked for: it takes a while to load

            self.wandb_run = wandb.init(
                project=wandb_cfg.project,
                name=wandb_cfg.run_name or run_dir.name,
                config=run_config,
                dir=str(run_dir),
                mode=wandb_cfg.mode,
                id=wandb_run_id,  # a resumed run continues the same wandb run
                resume="allow" if wandb_run_id else None,
            )
            self.wandb_run_id = self.wandb_run.id

    def log(self, record: dict) -> None:
        """Append record with the time it was written (seconds since 1970: plot.py's wall time)."""
        # allow_nan=False: NaN and Infinity are not JSON; every figure logged is a finite number
        line = json.dumps(record | {"time": round(time.time(), 3)}, allow_nan=False) + "\n"
        try:
            self.file.write(line.encode("utf-8"))
        except OSError as e:  # a full disk: the run cannot record what it does
            raise UserError(
                f"could not add step {record['step']} to {self.path} ({e.strerror}); the run stops, its last "
                f"checkpoint kept (free some space and resume)"
            ) from None
        if self.wandb_run is not None:
            values = {key: value for key, value in record.items() if key != "step"}
            self.wandb_run.log(values, step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def _drop_records_after(self, step: int) -> None:
        """A resumed run logs the steps after its checkpoint again; drop the old copies."""
        kept = [line for line, record_step in read_records(self.path) if record_step <= step]
        with atomic_open(self.path) as f:
            f.write("".join(kept).encode("utf-8"))


def read_records(path: Path) -> list[tuple[str, int]]:
    """Each record line of a metrics.jsonl with its step (see `_parsed_records`)."""
    return [(line, record["step"]) for line, record in _parsed_records(path)]


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order, as dicts (see `_parsed_records`)."""
    return [record for _, record in _parsed_records(path)]


def _parsed_records(path: Path) -> list[tuple[str, dict]]:
    """Each record line of a metrics.jsonl with its record: the one place that says what a record is,
    for resuming, plot.py and bench/ alike. A last line that is not JSON is left out: the run died
    while writing it. Any other line that is not a record (hand-edited, or damaged: not JSON, a
    value that is null, a string or not there) is a UserError naming it, before anything is written
    or drawn."""
    lines = read_text(path, errors="replace").splitlines(keepends=True)
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, f"{path} line {number}")
        except UserError:
            if number == len(lines):
                break
            record = None
        problem = _record_problem(record)
        if problem:
            raise UserError(
                f"{path} line {number} is not a record of this trainer ({problem}): {line.strip()!r:.60} "
                f"(every record is a JSON object of numbers with a whole-number step; correct or delete that line)"
            )
        records.append((line, record))
    return records


def _record_problem(record: object) -> str | None:
    """What keeps a parsed line from being a record the trainer writes, or None."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if "step" not in record:
        return "it has no step"
    for key, value in record.items():
        # bool is an int subclass in Python, but true is no number of steps or loss
        if key == "step" and (type(value) is not int or value < 0):
            return f"step={value!r} is not a whole number of 0 or more"
        if type(value) not in (int, float):
            return f"{key}={value!r} is not a number"
    return None


def gpu_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


def total_peak_flops(device: torch.device, processes: int) -> float | None:
    """The peak of a run's GPUs together, one per process (each on the same kind of GPU as this
    one): what a run's MFU, from the tokens/s of all processes, is taken against."""
    peak = gpu_peak_flops(device)
    return None if peak is None else peak * processes
