"""Training speed of one config, and where a whole run's time goes: start-up, steps, evaluations
and checkpoints, each timed on its own; tokens/s, and model FLOPs utilisation where the GPU's peak
is known.

    python bench/train.py --config configs/shakespeare_char.toml --steps 50
    python bench/train.py --config configs/shakespeare_gpt2.toml --steps 50 --train.device=cuda
    python bench/train.py --config configs/gpt2_124m_owt.toml --data.dataset=shakespeare \
        --train.gradient_accumulation_steps=1 --data.batch_size=16 --profile 15
    torchrun --standalone --nproc_per_node=1 bench/train.py --config ... --train.parallelism=fsdp

Builds the run exactly as train.py does (same config tree, overrides as --section.key=value), then
times --steps optimizer steps after --warmup untimed ones (compilation, allocator), one evaluation
and one checkpoint. Start-up runs from this script's first line (imports included) to the moment
the first step could start. The second table projects a whole run of the config from these parts
(train.max_iters steps, an evaluation at step 0 and every train.eval_interval steps, a checkpoint
after each but the first), so it shows where train.py's time would go. Nothing is kept: the run
directory is a temporary one. MFU uses the same FLOPs-per-token count and GPU peak table as
metrics.jsonl (trainer/metrics.py). --profile N prints the N operators that took the most device
(or CPU) time in one more step, from torch.profiler, to show what a step is made of.
"""

import time

START = time.perf_counter()  # before the imports: they are part of a run's start-up

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from data.prepare import ensure_prepared  # noqa: E402
from errors import run_cli  # noqa: E402
from trainer.config import TrainConfig, load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.metrics import flops_per_token, gpu_peak_flops  # noqa: E402


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--config", required=True, help="TOML config file (see configs/)")
    parser.add_count("--steps", default=50, help="timed optimizer steps (default: 50)")
    parser.add_count("--warmup", minimum=0, default=5, help="untimed steps first (default: 5)")
    parser.add_count("--profile", minimum=0, default=0, metavar="N", help="print the N costliest operators of a step")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(args.config, [*overrides, f"--train.out_dir={scratch}/run"])
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
        trainer = Trainer(cfg)
        startup = time.perf_counter() - START
        for _ in range(args.warmup):
            trainer.train_step(cfg.optim.learning_rate).item()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = trainer.train_step(cfg.optim.learning_rate)
        loss.item()  # waits for the device to finish the last step
        step_seconds = (time.perf_counter() - start) / args.steps
        evaluation_seconds = timed(trainer.evaluate)  # returns floats: the device has finished
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint_seconds = timed(trainer.save)
        if args.profile:
            print_profile(trainer, cfg.optim.learning_rate, args.profile)
        trainer.world.stop()
    if trainer.world.is_main:
        print_speed(args, trainer, step_seconds)
        print()
        print_run_time(trainer.cfg.train, startup, step_seconds, evaluation_seconds, checkpoint_seconds)


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def print_speed(args: argparse.Namespace, trainer: Trainer, step_seconds: float) -> None:
    tokens_per_sec = trainer.tokens_per_step / step_seconds
    peak = gpu_peak_flops(trainer.device)
    model_flops = flops_per_token(trainer.cfg.model, trainer.model.num_params())
    mfu = f"{100 * model_flops * tokens_per_sec / peak:.1f}%" if peak else "n/a (no known peak)"
    cuda = trainer.device.type == "cuda"
    device = torch.cuda.get_device_name(trainer.device) if cuda else trainer.device.type
    memory = f"{torch.cuda.max_memory_allocated(trainer.device) / 2**30:.1f} GiB" if cuda else "-"
    dtype = str(trainer.dtype).removeprefix("torch.")
    parallel = f"{trainer.parallel.mode} x{trainer.world.size}" if trainer.world.launched else "single"
    columns = ["config", "device", "dtype", "params", "parallel", "tokens/step", "steps", "ms/step", "tokens/s"]
    columns += ["MFU", "peak memory"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    print(
        f"| {args.config} | {device} ({torch.get_num_threads()} threads) | {dtype} | "
        f"{trainer.model.num_params() / 1e6:.1f}M | {parallel} | {trainer.tokens_per_step:,} | {args.steps} | "
        f"{1000 * step_seconds:.1f} | {tokens_per_sec:,.0f} | {mfu} | {memory} |"
    )


def print_run_time(
    train: TrainConfig, startup: float, step_seconds: float, evaluation_seconds: float, checkpoint_seconds: float
) -> None:
    """A whole run of train.max_iters steps, from the parts' measured times."""
    parts = run_parts(train, startup, step_seconds, evaluation_seconds, checkpoint_seconds)
    total = total_seconds(parts)
    print("| part of a whole run | count | seconds each | seconds | share |")
    print("| --- | --- | --- | --- | --- |")
    for name, count, seconds in parts:
        print(f"| {name} | {count:,} | {seconds:.4g} | {count * seconds:.1f} | {100 * count * seconds / total:.0f}% |")
    print(f"| total | | | {total:.1f} | 100% |")


def run_parts(
    train: TrainConfig, startup: float, step_seconds: float, evaluation_seconds: float, checkpoint_seconds: float
) -> list[tuple[str, int, float]]:
    """The parts of a whole run of train.max_iters steps: (name, count, seconds each)."""
    # as Trainer.fit does: the baseline at step 0, then every eval_interval steps and at the last step,
    # each of these followed by a checkpoint
    checkpoints = train.max_iters // train.eval_interval + (train.max_iters % train.eval_interval != 0)
    return [
        ("start-up (imports, data, model; to the first step)", 1, startup),
        ("optimizer steps", train.max_iters, step_seconds),
        (f"evaluations ({train.eval_iters} batches per split)", checkpoints + 1, evaluation_seconds),
        ("checkpoints", checkpoints, checkpoint_seconds),
    ]


def total_seconds(parts: list[tuple[str, int, float]]) -> float:
    """The whole run's seconds from run_parts' (name, count, seconds each)."""
    return sum(count * seconds for _, count, seconds in parts)


def print_profile(trainer: Trainer, lr: float, rows: int) -> None:
    """One step under torch.profiler; the operators that took the most time, device time first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer.train_step(lr).item()
    sort_by = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    if trainer.world.is_main:
        print(prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    run_cli(main)
