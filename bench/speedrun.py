r"""nanoGPT's CPU recipe, or another config of ours, beside a config of ours, on one machine in one run:
each one's whole process (start to exit) and the final val loss it reaches, and how many times faster
ours is.

    python bench/speedrun.py --nanogpt ~/nanoGPT --config configs/shakespeare_char.toml --repeats 3 --threads 1
    python bench/speedrun.py --nanogpt ~/nanoGPT --config configs/shakespeare_char.toml --train.max_iters=400
    python bench/speedrun.py --against configs/shakespeare_char.toml --config configs/shakespeare_char_speedrun.toml \
        --repeats 6 --seeds 1337 1338 1339 --threads 1

--nanogpt is a checkout of https://github.com/karpathy/nanoGPT; it is never written to. Its files
are copied into a scratch folder, with this project's bundled Shakespeare as the input.txt its
data/shakespeare_char/prepare.py would otherwise download, and prepared there, untimed (ours is
prepared beforehand too); nanoGPT then writes its checkpoints into the copy. Each round runs
nanoGPT's recipe, as its README gives it for a CPU,

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
        --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
        --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

and `python train.py --config CONFIG` (overrides as --section.key=value apply to it), in this
Python, one after the other, in turns (ABBA: nanoGPT first in even rounds, ours in odd ones), so a
machine whose speed drifts slows both. Both get --threads torch threads (default: torch's own count
here, which nanoGPT uses: ours through --train.threads, both through OMP_NUM_THREADS). The val
loss is each program's own estimate at its last evaluation: nanoGPT's last `step N: train loss X,
val loss Y` line, ours the last val_loss of metrics.jsonl. The table gives each run, then the
medians and the ratio of nanoGPT's median wall time to ours (with each round's ratio); --json PATH
also writes them.

--against CONFIG takes a config of ours as the reference instead of nanoGPT: `python train.py
--config CONFIG` in the same turns, with the same threads (the overrides apply to --config alone).
Both are then runs of this trainer, so both are scored on the whole val split by bench/val.py's
measure (the same windows for both, after each run's exit: untimed) rather than by the trainer's
estimate. --seeds gives our runs (and --against's) a train.seed each round, in turn: round r takes
the (r mod n)-th of the n seeds, so rounds of several seeds show the spread that a seed brings.
"""

import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.ablation import final_val_loss, whole_process  # noqa: E402
from bench.arguments import BenchArguments, write_json  # noqa: E402
from bench.val import STRIDE, score_run  # noqa: E402
from data.corpus import CORPUS_DIR, ensure_prepared  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from trainer.config import load_config, override_keys  # noqa: E402

NANOGPT_RECIPE = [
    "train.py",
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--max_iters=2000",
    "--lr_decay_iters=2000",
    "--dropout=0.0",
]
NANOGPT_FILES = ("train.py", "config/train_shakespeare_char.py", "data/shakespeare_char/prepare.py")
# nanoGPT's estimate_loss line, printed at every evaluation
NANOGPT_EVALUATION = re.compile(r"^step (\d+): train loss (\S+), val loss (\S+)$", re.MULTILINE)
FIGURES = ("threads", "reference", "ours", "wall_ratio")  # keys of an earlier --json of this script


def main() -> None:
    parser = BenchArguments(__doc__)
    reference = parser.add_mutually_exclusive_group(required=True)
    reference.add_argument("--nanogpt", type=Path, metavar="DIR", help="a checkout of nanoGPT: its CPU recipe")
    reference.add_argument("--against", metavar="CONFIG", help="a TOML config of ours as the reference instead")
    parser.add_argument("--config", required=True, help="our TOML config to run beside the reference")
    parser.add_count("--repeats", default=3, help="rounds, each program's whole run once per round (default: 3)")
    default_threads = torch.get_num_threads()
    parser.add_count("--threads", default=default_threads, help=f"torch threads of both (default: {default_threads})")
    # a seed as train.seed takes it: a config integer (64 bits)
    seeds = dict(minimum=-(2**63), maximum=2**63 - 1, nargs="+", metavar="SEED")
    parser.add_count("--seeds", **seeds, help="train.seed of our runs, one per round in turn (default: the configs')")
    parser.add_json_output("--json", FIGURES, help="also write the figures to this JSON file")
    args, overrides = parser.parse_overrides(override_keys())
    ours = {"ours": (args.config, overrides)}  # the runs of this trainer: name -> (config, overrides)
    if args.nanogpt is not None:
        check_nanogpt(args.nanogpt)
    else:
        ours["reference"] = (args.against, [])
    # a bad config ends the bench before anything runs
    own_seeds = {name: load_config(config, changes).train.seed for name, (config, changes) in ours.items()}
    cfg = load_config(args.config, overrides)
    ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads)}
    runs = {"reference": [], "ours": []}
    with tempfile.TemporaryDirectory() as scratch:
        if args.nanogpt is not None:
            nanogpt = copy_nanogpt(args.nanogpt, Path(scratch) / "nanogpt", env)
        for round_ in range(args.repeats):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for name in order:
                if name not in ours:  # nanoGPT
                    wall, stdout = whole_process([sys.executable, *NANOGPT_RECIPE], nanogpt, env)
                    row = dict(wall_s=wall, val_loss=nanogpt_val_loss(stdout))
                else:
                    config, changes = ours[name]
                    seed = own_seeds[name] if args.seeds is None else args.seeds[round_ % len(args.seeds)]
                    run_dir = Path(scratch) / f"{name}-{round_}"
                    command = [sys.executable, str(ROOT / "train.py"), "--config", config, *changes]
                    command += [f"--train.seed={seed}", f"--train.out_dir={run_dir}", f"--train.threads={args.threads}"]
                    wall, _ = whole_process(command, Path.cwd(), env)
                    val_loss = our_val_loss(run_dir, whole_split=args.against is not None)
                    row = dict(wall_s=wall, val_loss=val_loss, seed=seed)
                runs[name].append(row)
                print(f"round {round_ + 1}, {name}: {wall:.2f} s, val loss {row['val_loss']:.4f}", file=sys.stderr)
    label = "nanoGPT's CPU recipe" if args.nanogpt is not None else args.against
    figures = summary(runs, args.threads, label, args.config, whole_split=args.against is not None)
    print_table(figures)
    if args.json:
        write_json(args.json, figures)


def our_val_loss(run_dir: Path, whole_split: bool) -> float:
    """A finished run's val loss: over the whole val split (bench/val.py), or the trainer's last estimate."""
    if whole_split:
        return score_run(run_dir, "val", STRIDE)["loss"]
    return final_val_loss(run_dir)


def check_nanogpt(folder: Path) -> None:
    missing = [name for name in NANOGPT_FILES if not (folder / name).is_file()]
    if missing:
        raise UserError(
            f"--nanogpt='{folder}' is not a checkout of nanoGPT (no {', '.join(missing)}): "
            "give the folder of a clone of https://github.com/karpathy/nanoGPT"
        )


def copy_nanogpt(source: Path, copy: Path, env: dict[str, str]) -> Path:
    """A copy of nanoGPT's files with the bundled Shakespeare prepared its own way in it."""
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".git", "out-*"))
    data = copy / "data" / "shakespeare_char"
    shutil.copyfile(CORPUS_DIR / "tinyshakespeare.txt", data / "input.txt")  # it downloads only a missing one
    whole_process([sys.executable, "prepare.py"], data, env)
    return copy


def nanogpt_val_loss(stdout: str) -> float:
    """The val loss of nanoGPT's last evaluation, from what its train.py printed."""
    evaluations = NANOGPT_EVALUATION.findall(stdout)
    if not evaluations:
        last = (stdout.strip().splitlines() or ["(nothing)"])[-1]
        raise UserError(f"nanoGPT's train.py printed no 'step N: train loss X, val loss Y' line; its last: {last}")
    return float(evaluations[-1][2])


def summary(runs: dict[str, list[dict]], threads: int, reference: str, config: str, whole_split: bool) -> dict:
    """Each program's runs and medians, and the reference's median wall time over ours (each round's too)."""
    val_loss = "whole val split (bench/val.py)" if whole_split else "each program's estimate at its last evaluation"
    figures = {"threads": threads, "config": config, "val_loss": val_loss}
    for name, rows in runs.items():
        medians = {key: statistics.median(row[key] for row in rows) for key in ("wall_s", "val_loss")}
        figures[name] = dict(runs=rows, median_wall_s=medians["wall_s"], median_val_loss=medians["val_loss"])
    figures["reference"]["program"] = reference
    pairs = zip(runs["reference"], runs["ours"], strict=True)
    figures["round_ratios"] = [theirs["wall_s"] / ours["wall_s"] for theirs, ours in pairs]
    figures["wall_ratio"] = figures["reference"]["median_wall_s"] / figures["ours"]["median_wall_s"]
    return figures


def print_table(figures: dict) -> None:
    reference = figures["reference"]["program"]
    loss = "val loss, whole split" if figures["val_loss"].startswith("whole") else "final val loss"
    print(f"| program | whole process (median) | each round | {loss} (median) | each round |")
    print("| --- | --- | --- | --- | --- |")
    for name, label in (("reference", reference), ("ours", figures["config"])):
        rows = figures[name]["runs"]
        walls = ", ".join(f"{row['wall_s']:.1f}" for row in rows)
        losses = ", ".join(
            f"{row['val_loss']:.4f}" + (f" (seed {row['seed']})" if "seed" in row else "") for row in rows
        )
        print(
            f"| {label} | {figures[name]['median_wall_s']:.1f} s | {walls} | "
            f"{figures[name]['median_val_loss']:.4f} | {losses} |"
        )
    print()
    rounds = ", ".join(f"{ratio:.2f}" for ratio in figures["round_ratios"])
    reached = figures["ours"]["median_val_loss"] <= figures["reference"]["median_val_loss"]
    name = "nanoGPT" if reference == "nanoGPT's CPU recipe" else reference
    print(
        f"{name} / ours, whole process: {figures['wall_ratio']:.2f}x (each round: {rounds}); "
        f"{figures['threads']} torch thread(s) each; ours reaches {name}'s val loss: {'yes' if reached else 'no'}"
    )


if __name__ == "__main__":
    run_cli(main)
