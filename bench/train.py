"""Training speed of one config: tokens/s, and model FLOPs utilisation where the GPU's peak is known.

    python bench/train.py --config configs/shakespeare_char.toml --steps 50
    python bench/train.py --config configs/shakespeare_gpt2.toml --steps 50 --train.device=cuda
    python bench/train.py --config configs/gpt2_124m_owt.toml --data.dataset=shakespeare \
        --train.gradient_accumulation_steps=1 --data.batch_size=16 --profile 15
    torchrun --standalone --nproc_per_node=1 bench/train.py --config ... --train.parallelism=fsdp

Builds the run exactly as train.py does (same config tree, overrides as --section.key=value), then
times --steps optimizer steps after --warmup untimed ones (compilation, allocator). Nothing is
written: no run directory, no checkpoint. MFU uses the same FLOPs-per-token count and GPU peak
table as metrics.jsonl (trainer/metrics.py). --profile N prints the N operators that took the most
device (or CPU) time in one more step, from torch.profiler, to show what a step is made of.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.prepare import ensure_prepared  # noqa: E402
from errors import run_cli  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.metrics import flops_per_token, gpu_peak_flops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="TOML config file (see configs/)")
    parser.add_argument("--steps", type=int, default=50, help="timed optimizer steps (default: 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest operators of a step")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(args.config, [*overrides, f"--train.out_dir={scratch}/run"])
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
        trainer = Trainer(cfg)
        for _ in range(args.warmup):
            trainer.train_step(cfg.optim.learning_rate).item()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = trainer.train_step(cfg.optim.learning_rate)
        loss.item()  # waits for the device to finish the last step
        seconds = time.perf_counter() - start
        if args.profile:
            print_profile(trainer, cfg.optim.learning_rate, args.profile)
        trainer.world.stop()
    if not trainer.world.is_main:
        return
    tokens_per_sec = trainer.tokens_per_step * args.steps / seconds
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
        f"{1000 * seconds / args.steps:.1f} | {tokens_per_sec:,.0f} | {mfu} | {memory} |"
    )


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
