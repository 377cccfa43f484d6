"""Training speed of one config, and where a whole run's time goes: start-up, steps, evaluations
and checkpoints, each timed on its own; tokens/s, and model FLOPs utilisation where the GPU's peak
is known.

    python bench/train.py --config configs/shakespeare_char.toml --steps 50
    python bench/train.py --config configs/shakespeare_gpt2.toml --steps 50 --train.device=cuda
    python bench/train.py --config configs/gpt2_124m_owt.toml --data.dataset=shakespeare \
        --train.gradient_accumulation_steps=1 --data.batch_size=16 --profile 15
    python bench/train.py --config configs/gpt2_124m_owt.toml --data.dataset=shakespeare \
        --train.gradient_accumulation_steps=1 --batch-sizes 128 96 64 48 32 --json speed.json
    torchrun --standalone --nproc_per_node=1 bench/train.py --config ... --train.parallelism=fsdp

Builds the run exactly as train.py does (same config tree, overrides as --section.key=value), then
times --steps optimizer steps after --warmup untimed ones (compilation, allocator), one evaluation
(after an untimed one when compiled) and one checkpoint. Start-up runs from this script's first line
(imports included) to the moment the first step could start. The second table projects a whole run
of the config from these parts (train.max_iters steps, an evaluation at step 0 unless
train.eval_at_start is off and every train.eval_interval steps, a checkpoint after each but the
first), so it shows where train.py's time would go. Nothing is kept: the run directory is a
temporary one. MFU uses the same FLOPs-per-token count and GPU peak table as metrics.jsonl
(trainer/metrics.py). --batch-sizes tries each micro-batch size (data.batch_size), largest first,
with one uncompiled step, and times the largest whose step fits in the device's memory (an
uncompiled step holds more than a compiled one, so the compiled run fits too). --json PATH also
writes the figures as one JSON object (bench/gpu.py reads it). --profile N prints the N operators
that took the most device (or CPU) time in one more step, from torch.profiler, to show what a step
is made of.
"""

import time

START = time.perf_counter()  # before the imports: they are part of a run's start-up

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments, write_json  # noqa: E402
from data.corpus import ensure_prepared  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from trainer.config import Config, TrainConfig, load_config, override_keys  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.metrics import flops_per_token, total_peak_flops  # noqa: E402


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--config", required=True, help="TOML config file (see configs/)")
    parser.add_count("--steps", default=50, help="timed optimizer steps (default: 50)")
    parser.add_count("--warmup", minimum=0, default=5, help="untimed steps first (default: 5)")
    parser.add_count("--profile", minimum=0, default=0, metavar="N", help="print the N costliest operators of a step")
    parser.add_count("--batch-sizes", nargs="+", metavar="N", help="time the largest of these batch sizes that fits")
    recognised_by = ("tokens_per_sec", "step_seconds", "checkpoint_seconds")  # keys of an earlier --json of this script
    parser.add_json_output("--json", recognised_by, help="also write the figures to this JSON file")
    args, overrides = parser.parse_overrides(override_keys())
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(args.config, [*overrides, f"--train.out_dir={scratch}/run"])
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
        if args.batch_sizes:
            cfg = largest_fitting_batch(cfg, args.batch_sizes, Path(scratch))
        trainer = Trainer(cfg)
        startup = time.perf_counter() - START
        for _ in range(args.warmup):
            trainer.train_step(cfg.optim.learning_rate).item()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = trainer.train_step(cfg.optim.learning_rate)
        loss.item()  # waits for the device to finish the last step
        step_seconds = (time.perf_counter() - start) / args.steps
        if cfg.train.compile:
            trainer.evaluate()  # compiles the model's eval-mode graph: train.py's first evaluation pays that once
        evaluation_seconds = timed(trainer.evaluate)  # returns floats: the device has finished
        trainer.run_dir.path.mkdir(parents=True, exist_ok=True)
        checkpoint_seconds = timed(trainer.save)
        if args.profile:
            print_profile(trainer, cfg.optim.learning_rate, args.profile)
        trainer.world.stop()
    if trainer.world.is_main:
        figures = speed(args, trainer, step_seconds)
        print_speed(figures)
        print()
        print_run_time(trainer.cfg.train, startup, step_seconds, evaluation_seconds, checkpoint_seconds)
        if args.json:
            times = dict(startup_seconds=startup, evaluation_seconds=evaluation_seconds)
            write_json(args.json, figures | times | dict(checkpoint_seconds=checkpoint_seconds))


def largest_fitting_batch(cfg: Config, batch_sizes: list[int], scratch: Path) -> Config:
    """cfg with data.batch_size the largest of batch_sizes whose uncompiled training step fits in the
    device's memory. Each size is tried in a Trainer of its own, freed before the next."""
    for batch_size in sorted(batch_sizes, reverse=True):
        train = dataclasses.replace(cfg.train, compile=False, out_dir=str(scratch / f"probe-{batch_size}"))
        probe_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=batch_size), train=train)
        probe = None
        try:
            probe = Trainer(probe_cfg)
            probe.train_step(cfg.optim.learning_rate).item()
            fits = True
        except torch.OutOfMemoryError:  # the answer this probe asks for, not an error: try the next size
            fits = False
        finally:
            if probe is not None:
                probe.run_dir.release()
            del probe
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if fits:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # the timed run's peak memory is its own, not the probe's
            print(f"micro-batch: {batch_size} sequences, the largest of {batch_sizes} whose step fits")
            return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=batch_size))
    raise UserError(f"--batch-sizes {batch_sizes}: no micro-batch of these sizes fits in the device's memory")


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def speed(args: argparse.Namespace, trainer: Trainer, step_seconds: float) -> dict:
    """The measured speed and what it was measured on. MFU (a fraction) and the peak FLOP/s it is
    taken against are None where the device's peak is not known; peak memory is None off CUDA."""
    tokens_per_sec = trainer.tokens_per_step / step_seconds
    peak = total_peak_flops(trainer.device, trainer.world.size)  # tokens_per_step counts every process's tokens
    model_flops = flops_per_token(trainer.cfg.model, trainer.model.num_params())
    cuda = trainer.device.type == "cuda"
    return {
        "config": args.config,
        "device": torch.cuda.get_device_name(trainer.device) if cuda else trainer.device.type,
        "threads": torch.get_num_threads(),
        "dtype": str(trainer.dtype).removeprefix("torch."),
        "compile": trainer.cfg.train.compile,
        "params": trainer.model.num_params(),
        "parallel": f"{trainer.parallel.mode} x{trainer.world.size}" if trainer.world.launched else "single",
        "batch_size": trainer.cfg.data.batch_size,
        "block_size": trainer.cfg.model.block_size,
        "tokens_per_step": trainer.tokens_per_step,
        "steps": args.steps,
        "step_seconds": step_seconds,
        "tokens_per_sec": tokens_per_sec,
        "flops_per_token": model_flops,
        "peak_flops": peak,
        "mfu": model_flops * tokens_per_sec / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None,
    }


def print_speed(figures: dict) -> None:
    mfu = f"{100 * figures['mfu']:.1f}%" if figures["mfu"] is not None else "n/a (no known peak)"
    memory = f"{figures['peak_memory_gib']:.1f} GiB" if figures["peak_memory_gib"] is not None else "-"
    columns = ["config", "device", "dtype", "params", "parallel", "tokens/step", "steps", "ms/step", "tokens/s"]
    columns += ["MFU", "peak memory"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    print(
        f"| {figures['config']} | {figures['device']} ({figures['threads']} threads) | {figures['dtype']} | "
        f"{figures['params'] / 1e6:.1f}M | {figures['parallel']} | {figures['tokens_per_step']:,} | "
        f"{figures['steps']} | {1000 * figures['step_seconds']:.1f} | {figures['tokens_per_sec']:,.0f} | {mfu} | "
        f"{memory} |"
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
    # as Trainer.fit does: the baseline at step 0 (unless eval_at_start is off), then every eval_interval
    # steps and at the last step, each of these followed by a checkpoint
    checkpoints = train.max_iters // train.eval_interval + (train.max_iters % train.eval_interval != 0)
    evaluations = checkpoints + train.eval_at_start
    return [
        ("start-up (imports, data, model; to the first step)", 1, startup),
        ("optimizer steps", train.max_iters, step_seconds),
        (f"evaluations ({train.eval_iters} batches per split)", evaluations, evaluation_seconds),
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
