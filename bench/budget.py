r"""Does one config's whole run fit within a wall-time budget of another's? The two runs' steps are
timed in alternating blocks in one process, so that both see the same machine.

    python bench/budget.py --reference configs/shakespeare_char_gpt2.toml --candidate configs/shakespeare_char.toml
    python bench/budget.py --reference configs/shakespeare_char_gpt2.toml --candidate configs/shakespeare_char.toml \
        --train.max_iters=1550    # overrides apply to the candidate (its decay follows max_iters)

Timing two whole runs one after the other is what a user sees, but on a machine whose speed drifts
(a shared virtual machine: the same run took 112 to 148 s within the hour here) two such runs
differ by as much as a 10% budget. Here both runs are built as train.py builds them, then blocks of
--block optimizer steps of each are timed in turn, ABBA, for --rounds rounds; each run's step time
is the median of its blocks, so a slow phase of the machine slows both. An evaluation and a
checkpoint of each are timed every fifth round, in the same alternation. From the medians each whole
run is projected (start-up, train.max_iters steps, an evaluation at step 0 unless eval_at_start is
off, every eval_interval steps and at the end, a checkpoint after each but the first, as
bench/train.py does), and the table gives the candidate's cost over the reference's and the most
steps the candidate could take within --budget of the reference's run (with the evaluation and
checkpoint that steps past an evaluation point bring). Start-up (imports, data) is the same for both
and taken from the reference.
"""

import time

START = time.perf_counter()  # before the imports: they are part of a run's start-up

import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from bench.train import run_parts, timed, total_seconds  # noqa: E402
from data.corpus import ensure_prepared  # noqa: E402
from errors import run_cli  # noqa: E402
from trainer.config import TrainConfig, load_config, override_keys  # noqa: E402
from trainer.loop import Trainer  # noqa: E402


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--reference", required=True, help="TOML config whose whole run sets the budget")
    parser.add_argument("--candidate", required=True, help="TOML config to fit within the budget")
    parser.add_amount("--budget", default=1.10, help="allowed cost over the reference (default: 1.10)")
    # two rounds at least: a median of one block per run would be one sample of a drifting machine
    parser.add_count("--rounds", minimum=2, default=20, help="rounds, each run's block once per round (default: 20)")
    parser.add_count("--block", default=10, help="optimizer steps per timed block (default: 10)")
    args, overrides = parser.parse_overrides(override_keys())  # --section.key=value, for the candidate
    with tempfile.TemporaryDirectory() as scratch:
        runs = {}
        for name in ("reference", "candidate"):
            changes = overrides if name == "candidate" else []
            cfg = load_config(getattr(args, name), [*changes, f"--train.out_dir={scratch}/{name}"])
            ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
            runs[name] = Trainer(cfg)
            if name == "reference":
                startup = time.perf_counter() - START
        steps = {name: [] for name in runs}
        evaluations = {name: [] for name in runs}
        checkpoints = {name: [] for name in runs}
        for trainer in runs.values():
            trainer.run_dir.path.mkdir(parents=True, exist_ok=True)
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
    totals, timings = {}, {}
    print("| run | config | ms/step | steps | evaluations | projected whole run |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, trainer in runs.items():
        timings[name] = tuple(statistics.median(x[name]) for x in (steps, evaluations, checkpoints))
        parts = run_parts(trainer.cfg.train, startup, *timings[name])
        totals[name] = total_seconds(parts)
        print(
            f"| {name} | {getattr(args, name)} | {1000 * timings[name][0]:.1f} | {parts[1][1]:,} | {parts[2][1]} | "
            f"{totals[name]:.1f} s |"
        )
    ratio = totals["candidate"] / totals["reference"]
    step_ratio = timings["candidate"][0] / timings["reference"][0]
    most = most_steps(runs["candidate"].cfg.train, startup, timings["candidate"], args.budget * totals["reference"])
    print()
    print(
        f"candidate / reference: {ratio:.3f} (budget {args.budget:.2f}); step-time ratio {step_ratio:.3f}; "
        f"within budget: {'yes' if ratio <= args.budget else 'no'}; most candidate steps within budget: {most:,}"
    )


def most_steps(train: TrainConfig, startup: float, timings: tuple[float, float, float], limit: float) -> int:
    """The most steps a run like train may take with its whole run, the evaluations and checkpoints
    that more steps bring included, within limit seconds (0 if even one step is over)."""

    def fits(n: int) -> bool:
        return total_seconds(run_parts(dataclasses.replace(train, max_iters=n), startup, *timings)) <= limit

    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low); grow high until it does not fit
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # the whole run's time never shrinks with more steps
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def block(trainer: Trainer, n: int) -> None:
    for _ in range(n):
        loss = trainer.train_step(trainer.cfg.optim.learning_rate)
    loss.item()  # waits for the device to finish


if __name__ == "__main__":
    run_cli(main)
