"""The thread policy of train.threads = 0 against fixed counts, on a quiet machine and on one this
script keeps busy itself: training tokens/s of one config at 1 and 2 threads and at the count the
policy chooses under each load.

    python bench/threads.py --config configs/shakespeare_char.toml --steps 100 --loads 0 1 2 --repeats 3

For each load N in --loads, N processes each spin one core in a busy loop (the other work of a
shared machine; each is stopped at the end of its load, and ends by itself after --load-seconds
whatever happens); after a second for them to get going, the policy chooses its count
(trainer/runtime.py auto_threads, the same call train.py makes), then each thread count in turn,
--repeats times in rotation, runs --warmup untimed and --steps timed optimizer steps of the config's
model, built as train.py builds it (overrides as --section.key=value). The table gives the median
tokens/s of each, and the policy's against each fixed count: above 1 where it chose better. Load 0
is only as quiet as the machine is: the line above the table says how idle its cores were.
Nothing is kept: the run directory is a temporary one.
"""

import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from data.corpus import ensure_prepared  # noqa: E402
from errors import run_cli  # noqa: E402
from trainer.config import load_config, override_keys  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.runtime import auto_threads, idle_cores, usable_cores  # noqa: E402

FIXED = (1, 2)  # the thread counts the policy is compared with


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--config", default="configs/shakespeare_char.toml", help="TOML config file (see configs/)")
    parser.add_count("--steps", default=50, help="timed optimizer steps per measurement (default: 50)")
    parser.add_count("--warmup", minimum=0, default=5, help="untimed steps before each measurement (default: 5)")
    parser.add_count("--repeats", default=1, help="measurements of each thread count per load (default: 1)")
    parser.add_count(
        "--loads",
        nargs="+",
        minimum=0,
        help="busy-loop processes to run beside it (default: 0, 1, one per usable core)",
    )
    parser.add_amount("--load-seconds", default=900.0, help="the longest a busy loop lives (default: 900)")
    args, overrides = parser.parse_overrides(override_keys())
    loads = args.loads if args.loads is not None else sorted({0, 1, usable_cores()})
    with tempfile.TemporaryDirectory() as scratch:
        # explicit threads: the policy is what is measured, not what builds the trainer
        cfg = load_config(args.config, [*overrides, f"--train.out_dir={scratch}/run", "--train.threads=1"])
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
        trainer = Trainer(cfg)
        size = f"{trainer.model.num_params() / 1e6:.2f}M parameters, {trainer.tokens_per_step:,} tokens per step"
        print(f"{args.config}: {size}")
        idle = idle_cores(1.0)
        print(f"usable cores: {usable_cores()}; idle before any load: {'unknown' if idle is None else f'{idle:.1f}'}")
        rows = [measure_under_load(trainer, load, args) for load in loads]
        trainer.run_dir.release()
    print_table(rows)


def measure_under_load(trainer: Trainer, load: int, args) -> dict:
    """The policy's choice and the median tokens/s of each thread count while `load` busy loops run."""
    spinners = [
        multiprocessing.get_context("fork").Process(target=spin, args=(time.monotonic() + args.load_seconds,))
        for _ in range(load)
    ]
    try:
        for spinner in spinners:
            spinner.start()
        time.sleep(1.0)  # the busy loops are running before the policy looks
        chosen, why = auto_threads()
        counts = sorted({*FIXED, chosen})
        rates: dict[int, list[float]] = {count: [] for count in counts}
        for _ in range(args.repeats):
            for count in counts:
                rates[count].append(tokens_per_sec(trainer, count, args.warmup, args.steps))
    finally:
        for spinner in spinners:
            spinner.terminate()
            spinner.join()
    return {"load": load, "chosen": chosen, "why": why} | {count: statistics.median(r) for count, r in rates.items()}


def spin(deadline: float) -> None:
    """One core's worth of other work, until the deadline at the latest."""
    while time.monotonic() < deadline:
        pass


def tokens_per_sec(trainer: Trainer, threads: int, warmup: int, steps: int) -> float:
    torch.set_num_threads(threads)
    lr = trainer.cfg.optim.learning_rate
    for _ in range(warmup):
        trainer.train_step(lr).item()
    start = time.perf_counter()
    for _ in range(steps):
        loss = trainer.train_step(lr)
    loss.item()
    return trainer.tokens_per_step * steps / (time.perf_counter() - start)


def print_table(rows: list[dict]) -> None:
    print()
    print(
        "| busy loops | policy's choice (why) | tokens/s at 1 thread | at 2 threads | at the choice "
        "| choice / 1 thread | choice / 2 threads |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        chosen = row[row["chosen"]]
        print(
            f"| {row['load']} | {row['chosen']} ({row['why']}) | {row[1]:,.0f} | {row[2]:,.0f} | {chosen:,.0f} | "
            f"{chosen / row[1]:.2f} | {chosen / row[2]:.2f} |"
        )


if __name__ == "__main__":
    run_cli(main)
