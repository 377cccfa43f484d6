"""Does one config's whole run fit within a wall-time budget of another's? The two runs' steps are
timed in alternating blocks in one process, so that both see the same machine.

    python bench/budget.py --reference configs/shakespeare_char_gpt2.toml --candidate configs/shakespeare_char.toml

Timing two whole runs one after the other is what a user sees, but on a machine whose speed drifts
(a shared virtual machine: the same run took 112 to 148 s within the hour here) two such runs
differ by as much as a 10% budget. Here both runs are built as train.py builds them, then blocks of
--block optimizer steps of each are timed in turn, ABBA, for --rounds rounds; each run's step time is
the median of its blocks, so a slow phase of the machine slows both. An evaluation and a checkpoint
of each are timed the same way. From these each whole run is projected (start-up, train.max_iters
steps, an evaluation at step 0, every eval_interval steps and at the end, a checkpoint after each
but the first, as bench/train.py does), and the table gives the candidate's cost over the
reference's and the most steps the candidate could take within --budget of the reference's run.
Start-up (imports, data) is the same for both and taken from the reference.
"""

import time

START = time.perf_counter()  # before the imports: they are part of a run's start-up

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.train import run_parts  # noqa: E402
from data.prepare import ensure_prepared  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="TOML config whose whole run sets the budget")
    parser.add_argument("--candidate", required=True, help="TOML config to fit within the budget")
    parser.add_argument("--budget", type=float, default=1.10, help="allowed cost over the reference (default: 1.10)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds, each run's block once per round (default: 20)")
    parser.add_argument("--block", type=int, default=10, help="optimizer steps per timed block (default: 10)")
    args = parser.parse_args()
    if args.rounds < 2 or args.block < 1 or args.budget <= 0:
        raise UserError("--rounds must be 2 or more, --block 1 or more and --budget positive")
    with tempfile.TemporaryDirectory() as scratch:
        runs = {}
        for name in ("reference", "candidate"):
            cfg = load_config(getattr(args, name), [f"--train.out_dir={scratch}/{name}"])
            ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
            runs[name] = Trainer(cfg)
            if name == "reference":
                startup = time.perf_counter() - START
        steps = {name: [] for name in runs}
        evaluations = {name: [] for name in runs}
        checkpoints = {name: [] for name in runs}
        for trainer in runs.values():
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            trainer.train_step(trainer.cfg.optim.learning_rate).item()  # untimed: first-step allocations
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for name in order:
                trainer = runs[name]
                steps[name].append(timed(functools.partial(block, trainer, args.block)) / args.block)
                if round_ % 5 == 0:
                    evaluations[name].append(timed(trainer.evaluate))
                    checkpoints[name].append(timed(trainer.save))
        for trainer in runs.values():
            trainer.world.stop()
    totals = {}
    print("| run | config | ms/step | steps | evaluations | projected whole run |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, trainer in runs.items():
        step, evaluation, checkpoint = (statistics.median(x[name]) for x in (steps, evaluations, checkpoints))
        parts = run_parts(trainer.cfg.train, startup, step, evaluation, checkpoint)
        totals[name] = sum(count * seconds for _, count, seconds in parts)
        print(
            f"| {name} | {getattr(args, name)} | {1000 * step:.1f} | {parts[1][1]:,} | {parts[2][1]} | "
            f"{totals[name]:.1f} s |"
        )
    ratio = totals["candidate"] / totals["reference"]
    candidate = runs["candidate"].cfg.train
    step = statistics.median(steps["candidate"])
    spare = args.budget * totals["reference"] - totals["candidate"]
    most = candidate.max_iters + int(spare / step)  # evaluations left as they are
    print()
    step_ratio = step / statistics.median(steps["reference"])
    print(
        f"candidate / reference: {ratio:.3f} (budget {args.budget:.2f}); step-time ratio {step_ratio:.3f}; "
        f"within budget: {'yes' if ratio <= args.budget else 'no'}; most candidate steps within budget: about {most:,}"
    )


def block(trainer: Trainer, n: int) -> None:
    for _ in range(n):
        loss = trainer.train_step(trainer.cfg.optim.learning_rate)
    loss.item()  # waits for the device to finish


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


if __name__ == "__main__":
    run_cli(main)
