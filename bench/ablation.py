"""What each switch buys at the quickstart's budget: GPT-2's recipe, then each modern change added
to it alone, then the full quickstart recipe, then each of modded-nanogpt's switches added alone to
the quickstart, for the steps that fit the quickstart's wall time; val loss and wall time over
several seeds.

    python bench/ablation.py --out-dir out/ablation --seeds 1337 1338 1339 --jobs 2
    python plot.py loss out/ablation/*-seed1337 --out docs/ablation.png

Every run is `train.py` from start to exit, one torch thread each (--jobs runs at a time: on a
2-core machine, 2 jobs keep both cores busy without the runs fighting over threads). The base is
configs/shakespeare_char_gpt2.toml, each variant that config with the overrides listed in VARIANTS,
and "quickstart" is configs/shakespeare_char.toml itself. Finished runs are recorded in
out-dir/results.jsonl and skipped when the command is run again, so an interrupted ablation goes on
where it stopped (a results.jsonl of anything else is refused, never appended to). The table
gives, per variant, the mean final val loss over the seeds, its spread (max - min), the difference
from the base's mean, and the mean wall time with its ratio to the base's.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import BenchArguments  # noqa: E402
from data.files import check_output_file, parse_json, read_text, read_user_text  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from trainer.metrics import METRICS_NAME, read_metrics  # noqa: E402

BASE = "configs/shakespeare_char_gpt2.toml"
QUICKSTART = "configs/shakespeare_char.toml"
# the quickstart as it was when modded-nanogpt's switches were measured on it, their common base
BEFORE_NORMUON = ["--optim.muon_normuon=false", "--train.max_iters=1825"]
RESULT_KEYS = ("variant", "seed", "val_loss", "wall_s")  # a line of results.jsonl: one finished run
VARIANTS = {  # name: (config, overrides)
    "gpt2": (BASE, []),
    "rope": (BASE, ["--model.pos_emb=rope"]),
    "rmsnorm": (BASE, ["--model.norm=rmsnorm"]),
    "qk_norm": (BASE, ["--model.qk_norm=true"]),
    "relu2": (BASE, ["--model.mlp=relu2"]),
    "swiglu": (BASE, ["--model.mlp=swiglu"]),
    "gqa (n_kv_head=1)": (BASE, ["--model.n_kv_head=1"]),
    "untied head": (BASE, ["--model.tie_embeddings=false"]),
    "logit_softcap=15": (BASE, ["--model.logit_softcap=15"]),
    "wsd schedule": (BASE, ["--optim.schedule=wsd"]),
    "muon": (BASE, ["--optim.optimizer=muon"]),
    "quickstart (all)": (QUICKSTART, []),
    "quickstart before NorMuon": (QUICKSTART, BEFORE_NORMUON),
    # modded-nanogpt's switches, each alone on top of the quickstart before NorMuon (1825 steps), for
    # the steps that fit its wall time: 1825 / the step-time ratio that `bench/budget.py --reference
    # configs/shakespeare_char.toml --candidate configs/shakespeare_char.toml --budget 1.0 --rounds 6
    # OVERRIDES` measured on cpu-2 then (its noise: about +-1.5%); the schedules make steps cheaper
    # early and keep the 1825 steps
    "block_size_schedule=32:0.3": (QUICKSTART, [*BEFORE_NORMUON, "--train.block_size_schedule=32:0.3"]),
    "batch_size_schedule=8:0.5": (QUICKSTART, [*BEFORE_NORMUON, "--train.batch_size_schedule=8:0.5"]),
    # modded-nanogpt's residual-stream switches, each on top of the quickstart
    "value_embeds=1": (QUICKSTART, [*BEFORE_NORMUON, "--model.value_embeds=1", "--train.max_iters=1788"]),
    "unet_skips": (QUICKSTART, [*BEFORE_NORMUON, "--model.unet_skips=true", "--train.max_iters=1735"]),
    "backout": (QUICKSTART, [*BEFORE_NORMUON, "--model.backout=true", "--train.max_iters=1840"]),
    "zero_init_proj": (QUICKSTART, [*BEFORE_NORMUON, "--model.zero_init_proj=true", "--train.max_iters=1808"]),
    # the neighbouring-token switches, each on top of the quickstart
    "smear_gate": (QUICKSTART, [*BEFORE_NORMUON, "--model.smear_gate=true", "--train.max_iters=1804"]),
    "bigram_embed=4226 (exact)": (QUICKSTART, [*BEFORE_NORMUON, "--model.bigram_embed=4226", "--train.max_iters=1785"]),
    "mtp_tokens=2": (QUICKSTART, [*BEFORE_NORMUON, "--model.mtp_tokens=2", "--train.max_iters=1790"]),
    "normuon": (QUICKSTART, [*BEFORE_NORMUON, "--optim.muon_normuon=true", "--train.max_iters=1833"]),
    # the quickstart decays AdamW's matrices (the embedding) only: this is cautious decay of those
    "cautious_weight_decay": (
        QUICKSTART,
        [*BEFORE_NORMUON, "--optim.cautious_weight_decay=true", "--train.max_iters=1810"],
    ),
    # Muon's matrices decayed, everywhere or cautiously
    "muon_weight_decay=0.1": (QUICKSTART, [*BEFORE_NORMUON, "--optim.muon_weight_decay=0.1", "--train.max_iters=1821"]),
    "muon_weight_decay=0.1, cautious": (
        QUICKSTART,
        [
            *BEFORE_NORMUON,
            "--optim.muon_weight_decay=0.1",
            "--optim.cautious_weight_decay=true",
            "--train.max_iters=1730",
        ],
    ),
}


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--out-dir", required=True, help="folder for the runs and results.jsonl")
    # a seed as train.seed takes it: a config integer (64 bits), which torch seeds with
    seeds = dict(minimum=-(2**63), maximum=2**63 - 1, nargs="+", default=[1337])
    parser.add_count("--seeds", **seeds, help="train.seed values (default: 1337)")
    parser.add_count("--jobs", default=2, help="runs at a time, one thread each (default: 2)")
    parser.add_argument("--only", nargs="+", choices=VARIANTS, metavar="VARIANT", help="run these variants only")
    return parser.parse_args()


def run_name(variant: str, seed: int) -> str:
    slug = "".join(c if c.isalnum() else "-" for c in variant.split(" (")[0]).strip("-")
    return f"{slug}-seed{seed}"


def final_val_loss(run_dir: Path) -> float:
    return [r for r in read_metrics(run_dir / METRICS_NAME) if "val_loss" in r][-1]["val_loss"]


def whole_process(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run command from start to exit: its wall seconds and what it printed to stdout. A command that
    fails ends the benchmark with the command and the last line of its stderr."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise UserError(f"{' '.join(command)} failed:\n{last}")
    return wall, result.stdout


def train(out_dir: Path, variant: str, seed: int) -> dict:
    config, overrides = VARIANTS[variant]
    run_dir = out_dir / run_name(variant, seed)
    command = [sys.executable, "train.py", "--config", config, *overrides]
    command += [f"--train.seed={seed}", f"--train.out_dir={run_dir}", "--train.threads=1"]
    wall, _ = whole_process(command, ROOT)
    return dict(zip(RESULT_KEYS, (variant, seed, final_val_loss(run_dir), round(wall, 1)), strict=True))


def is_results_file(path: Path) -> bool:
    """Whether path is the results.jsonl of an earlier ablation: one finished run per line."""
    try:
        records = [parse_json(line, str(path)) for line in read_user_text(path).splitlines()]
    except (OSError, UserError):
        return False
    return all(isinstance(record, dict) and set(RESULT_KEYS) <= set(record) for record in records)


def base_of(variant: str) -> str:
    """The variant a variant is compared with: GPT-2's recipe for the switches added to it, the
    quickstart before NorMuon for modded-nanogpt's switches, which were measured on it."""
    config, overrides = VARIANTS[variant]
    if config == BASE:
        return "gpt2"
    return "quickstart before NorMuon" if overrides[: len(BEFORE_NORMUON)] == BEFORE_NORMUON else "quickstart (all)"


def table(results: list[dict]) -> list[str]:
    """One row per variant: its mean val loss and wall time, each against its base's (base_of)."""
    by_variant = {v: [r for r in results if r["variant"] == v] for v in VARIANTS}
    by_variant = {v: rs for v, rs in by_variant.items() if rs}
    means = {
        v: (statistics.mean(r["val_loss"] for r in rs), statistics.mean(r["wall_s"] for r in rs))
        for v, rs in by_variant.items()
    }
    lines = [
        "| variant | seeds | val loss (mean) | spread (max - min) | base | vs base | wall time (mean) | vs base |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant, runs in by_variant.items():
        losses = [r["val_loss"] for r in runs]
        (loss, wall), base = means[variant], base_of(variant)
        vs_loss, vs_wall = "-", "-"
        if base in means and base != variant:
            vs_loss, vs_wall = f"{loss - means[base][0]:+.4f}", f"{wall / means[base][1]:.2f}x"
        lines.append(
            f"| {variant} | {len(runs)} | {loss:.4f} | {max(losses) - min(losses):.4f} | {base} | {vs_loss} "
            f"| {wall:.0f} s | {vs_wall} |"
        )
    return lines


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out_dir)
    results_path = out_dir / "results.jsonl"
    check_output_file(results_path, "--out-dir", is_results_file, "the results.jsonl of an earlier ablation")
    out_dir.mkdir(parents=True, exist_ok=True)
    done = [json.loads(line) for line in read_text(results_path).splitlines()] if results_path.exists() else []
    finished = {(r["variant"], r["seed"]) for r in done}
    todo = [(v, s) for s in args.seeds for v in (args.only or VARIANTS) if (v, s) not in finished]
    for variant, seed in todo:
        if (out_dir / run_name(variant, seed)).exists():
            raise UserError(
                f"{out_dir / run_name(variant, seed)} exists but holds no finished run of this ablation: "
                "delete it to run it again"
            )
    print(f"{len(todo)} runs to go, {args.jobs} at a time", file=sys.stderr)

    def one(job: tuple[str, int]) -> None:
        result = train(out_dir, *job)
        with results_path.open("a") as f:  # each line written whole: a crash loses only runs in progress
            f.write(json.dumps(result) + "\n")
        summary = f"val {result['val_loss']:.4f}, {result['wall_s']} s"
        print(f"{result['variant']} seed {result['seed']}: {summary}", file=sys.stderr)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, todo))
    results = [json.loads(line) for line in read_text(results_path).splitlines()]
    print("\n".join(table([r for r in results if r["seed"] in args.seeds])))


if __name__ == "__main__":
    run_cli(main)
