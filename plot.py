"""Pictures of runs: loss curves of several runs side by side.

    python plot.py loss out/run_a out/run_b --out loss.png            # against optimizer steps
    python plot.py loss out/run_a out/run_b --x tokens --out loss.png  # or tokens, or wall time (--x time)

`loss` reads each run directory's metrics.jsonl (a run still training too: its last, half-written
line is left out) and config.toml, draws the train loss of the logged steps and the val loss of the
evaluations against steps, tokens trained on or wall time, with a legend of the run names, and
prints a table of each run's last evaluation: val loss, bits per byte and wall time.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed

import matplotlib.pyplot as plt  # noqa: E402

from errors import UserError, run_cli  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.metrics import METRICS_NAME, read_records  # noqa: E402

X_AXES = {  # --x: what each choice of horizontal axis measures
    "steps": "optimizer steps",
    "tokens": "tokens trained on",
    "time": "wall time since the run's first record (s)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    loss = commands.add_parser("loss", help="draw the train and val loss of runs, and print their final values")
    loss.add_argument("runs", nargs="+", help=f"run directories, each holding {METRICS_NAME} and config.toml")
    loss.add_argument("--out", required=True, help="PNG file to write")
    loss.add_argument("--x", choices=X_AXES, default="steps", help="horizontal axis (default: steps)")
    return parser.parse_args(argv)


@dataclasses.dataclass
class Run:
    """What one run directory has logged so far."""

    name: str
    records: list[dict]
    tokens_per_step: int

    @classmethod
    def read(cls, directory: str) -> "Run":
        path = Path(directory)
        metrics = path / METRICS_NAME
        if not metrics.is_file():
            raise UserError(
                f"{directory} holds no {METRICS_NAME}: it is not a run directory, or its run has logged nothing yet"
            )
        records = [json.loads(line) for line, _ in read_records(metrics)]
        cfg = load_config(str(path / "config.toml"), [])
        tokens_per_step = cfg.data.batch_size * cfg.model.block_size * cfg.train.gradient_accumulation_steps
        return cls(path.resolve().name, records, tokens_per_step)

    def curve(self, key: str, x: str) -> tuple[list[float], list[float]]:
        """The logged values of key (loss, val_loss) and where they lie on the x axis."""
        records = [r for r in self.records if key in r]
        if x == "steps":
            xs = [r["step"] for r in records]
        elif x == "tokens":
            xs = [r["step"] * self.tokens_per_step for r in records]
        else:
            xs = [r["time"] - self.start_time() for r in records]
        return xs, [r[key] for r in records]

    def start_time(self) -> float:
        if not all("time" in r for r in self.records):
            raise UserError(
                f"run {self.name}: its {METRICS_NAME} records no wall times (an older run): use --x steps or --x tokens"
            )
        return self.records[0]["time"]

    def summary(self) -> list[str]:
        """The table row: name, last step, and the last evaluation's val loss, bits per byte and wall time."""
        evaluation = next((r for r in reversed(self.records) if "val_loss" in r), {})
        times = [r["time"] for r in self.records if "time" in r]
        return [
            self.name,
            str(self.records[-1]["step"] if self.records else 0),
            f"{evaluation['val_loss']:.4f}" if evaluation else "-",
            f"{evaluation['val_bpb']:.4f}" if "val_bpb" in evaluation else "-",
            f"{times[-1] - times[0]:.1f}" if len(times) > 1 else "-",
        ]


def plot_loss(args: argparse.Namespace) -> None:
    runs = [Run.read(directory) for directory in args.runs]
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for run in runs:
        (line,) = train_ax.plot(*run.curve("loss", args.x), linewidth=1, label=run.name)
        val_ax.plot(*run.curve("val_loss", args.x), marker="o", markersize=3, color=line.get_color(), label=run.name)
    for ax, title in ((train_ax, "train loss (each logged step)"), (val_ax, "val loss (each evaluation)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(X_AXES[args.x])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    train_ax.set_ylabel("cross-entropy (nats per token)")
    save(fig, args.out)
    print_table(["run", "step", "val loss", "val bpb", "wall time (s)"], [run.summary() for run in runs])


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        )


def check_out(out: str) -> None:
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise UserError(f"--out={out!r} must name a .png file")
    if not path.parent.is_dir():
        raise UserError(f"--out={out!r}: the folder {str(path.parent)!r} does not exist")


def save(fig, out: str) -> None:
    path = Path(out)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_out(args.out)
    plot_loss(args)


if __name__ == "__main__":
    run_cli(main)
