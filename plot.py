"""Pictures of runs and of attention: loss curves, attention masks, and what a model attends to.

    python plot.py loss out/run_a out/run_b --out loss.png            # against optimizer steps
    python plot.py loss out/run_a out/run_b --x tokens --out loss.png  # or tokens, or wall time (--x time)
    python plot.py loss out/run_a out/run_b --ylim 1.4 1.6 --out loss.png  # the loss panels' y range
    python plot.py mask --config configs/shakespeare_char.toml --model.attn_window=8 --out mask.png
    python plot.py mask --all --size 24 --out patterns.png     # every attention pattern side by side
    python plot.py attention --out-dir out/shakespeare_char --prompt "ROMEO: " --out attention.png

`loss` reads each run directory's metrics.jsonl (a run still training too: its last, half-written
line is left out) and config.toml, draws the train loss of the logged steps and the val loss of the
evaluations against steps, tokens trained on or wall time, and prints a table of each run's last
evaluation: val loss, bits per byte and wall time. Runs that scored [eval] tasks get a panel for
each task's acc and one for the centred mean (eval.py's figures); a centred mean is the mean over
one set of tasks, so where a run's set changes (an older run resumed with other [eval] tasks) its
line breaks, and a note names the step. An [rl] run's train loss, its policy-gradient objective and
no cross-entropy, gets a panel of its own beside its reward and held-out pass@k. The loss panels' y
range fits the losses logged after the first fifth of each run's own steps (the end of training,
where runs are compared; step 0's loss, several times the final one, would flatten every
difference), with a margin of 5%, and the picture's title says so; --from-step STEP fits it to the
steps from STEP on instead, --full to every step, and --ylim LOW HIGH sets it. Every run has a
colour and line style of its own, the same in every panel, for any number of runs; one legend below
the panels names them, outside every panel, so it never hides a curve.

`mask` draws which keys (columns) each query (rows) may attend to, from the same rule the model
uses (model/masks.py): dark cells are allowed, light ones blocked. A prefix-LM picture shows a
prefix of a third of the positions, a document picture documents that start at a third and at
two thirds (settable with --prefix and --documents-at). `attention` runs a trained model on the
prompt and draws the attention weights of every layer and head (or their average with --average)
as heatmaps labelled with the prompt's tokens.

--out replaces only an earlier picture (a PNG that Matplotlib wrote), never another file.
"""

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from data.files import atomic_open, check_output_file  # noqa: E402
from errors import ArgumentParser, UserError, run_cli  # noqa: E402
from inference.load import model_from_checkpoint  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from model.masks import dense_mask, pattern_rule  # noqa: E402
from trainer.checkpoint import CHECKPOINT_NAME, load_checkpoint  # noqa: E402
from trainer.config import load_config, override_keys  # noqa: E402
from trainer.metrics import METRICS_NAME, read_metrics  # noqa: E402
from trainer.schedules import tokens_before  # noqa: E402

X_AXES = {  # --x: what each choice of horizontal axis measures
    "steps": "optimizer steps",
    "tokens": "tokens trained on",
    "time": "wall time since the run's first record (s)",
}
CENTRED_MEAN = "eval/centred_mean"
RL_LOSS, RL_REWARD, RL_PASS = "rl/loss", "rl/reward", "rl/pass@"  # an [rl] run's figures (docs/rl.md)
Y_LABELS = {CENTRED_MEAN: "centred mean (0 = chance)", RL_LOSS: "policy-gradient loss", RL_REWARD: "mean reward"}
PALETTE = matplotlib.colormaps["tab10"].colors  # ten colours told apart at a glance
LINE_STYLES = ["-", "--", ":", "-."]
PANEL_SIZE = (6.0, 4.5)  # inches, one panel of plot.py loss
# By default the loss panels' y range fits the steps after this share of each run's own: on the
# quickstart the loss falls from 4.2 to about 1.7 in its first fifth and then by 0.2 more, so the
# full range would draw runs 0.02 apart as one line
LOSS_FOCUS = 0.2
Y_MARGIN = 0.05  # of the fitted span, above and below, so no curve runs along the frame
LEGEND_ROW_HEIGHT = 0.22  # inches, one row of names at fontsize 8
ALLOWED, BLOCKED = "#1f4e79", "#eef2f7"
PLAIN_CAUSAL = {
    "attn_window": 0,
    "attn_sinks": 0,
    "attn_prefix_lm": False,
    "attn_block": 0,
    "attn_documents": False,
    "attn_document_positions": False,  # needs attn_documents: reset with it
}
# --all: the fewest positions at which every picture differs from the others: from 7 on the default
# prefix (a third) holds 2 positions (a prefix of 1 is plain causal attention), a document (a third)
# is longer than the window of 2 somewhere, and a window of 2 after 2 sinks shows a sink outside it
ALL_MIN_SIZE = 7


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    loss = commands.add_parser("loss", help="draw the train and val loss of runs, and print their final values")
    loss.add_argument("runs", nargs="+", help=f"run directories, each holding {METRICS_NAME} and config.toml")
    loss.add_argument("--out", required=True, help="PNG file to write")
    loss.add_argument("--x", choices=X_AXES, default="steps", help="horizontal axis (default: steps)")
    y_range = loss.add_mutually_exclusive_group()
    y_range.add_argument(
        "--from-step",
        type=int,
        metavar="STEP",
        help=f"fit the loss panels' y range to the losses logged from STEP on (default: after the first "
        f"{LOSS_FOCUS * 100:.0f}%% of each run's steps)",
    )
    y_range.add_argument("--full", action="store_true", help="fit the loss panels' y range to every step, 0 included")
    y_range.add_argument(
        "--ylim", nargs=2, type=float, metavar=("LOW", "HIGH"), help="the loss panels' y range, LOW below HIGH"
    )
    mask = commands.add_parser("mask", help="draw the attention mask of a config (overrides: --model.key=value)")
    mask.add_argument("--config", help="TOML config file (default: the config defaults)")
    mask.add_argument("--out", required=True, help="PNG file to write")
    mask.add_argument("--size", type=int, default=24, help="positions drawn (default: 24, at most block_size)")
    every = f"draw every pattern side by side, sized from --size (at least {ALL_MIN_SIZE})"
    mask.add_argument("--all", action="store_true", help=every)
    mask.add_argument("--prefix", type=int, help="prefix-LM: the prefix length drawn (default: a third)")
    mask.add_argument(
        "--documents-at", type=int, nargs="*", help="documents: the positions where documents start (default: thirds)"
    )
    attention = commands.add_parser("attention", help="draw a trained model's attention weights on a prompt")
    attention.add_argument("--out-dir", required=True, help=f"run directory holding {CHECKPOINT_NAME}")
    attention.add_argument("--prompt", required=True, help="text to attend over (at most block_size tokens)")
    attention.add_argument("--out", required=True, help="PNG file to write")
    attention.add_argument("--average", action="store_true", help="one heatmap: the mean over layers and heads")
    args, overrides = parser.parse_overrides(override_keys(), argv)
    if args.command != "mask" and overrides:
        parser.refuse(overrides, args)
    if args.command == "loss":
        check_y_range(args)
    return args, overrides


@dataclasses.dataclass
class Run:
    """What one run directory has logged so far."""

    name: str
    records: list[dict]
    tokens_before: Callable[[int], int]  # the tokens the run trained on before a step

    @classmethod
    def read(cls, directory: str) -> "Run":
        path = Path(directory)
        metrics = path / METRICS_NAME
        if not metrics.is_file():
            raise UserError(
                f"{directory} holds no {METRICS_NAME}: it is not a run directory, or its run has logged nothing yet"
            )
        # a chat step without a trained token has no loss: older runs logged 0 there, which is no mean of anything
        records = [
            {key: value for key, value in record.items() if key != "loss" or record.get("trained_tokens") != 0}
            for record in read_metrics(metrics)
        ]
        cfg = load_config(str(path / "config.toml"), [])
        if cfg.rl.task:  # an [rl] run's loss is its policy-gradient objective, no cross-entropy: a panel of its own
            records = [{(RL_LOSS if key == "loss" else key): value for key, value in r.items()} for r in records]
        return cls(path.resolve().name, records, lambda step: tokens_before(step, cfg))

    def curve(self, key: str, x: str) -> tuple[list[float], list[float]]:
        """The logged values of key (loss, val_loss) and where they lie on the x axis; the centred
        mean's with a gap (NaN, which matplotlib leaves undrawn) where the tasks it averages change."""
        records = [r for r in self.records if key in r]
        if x == "steps":
            xs = [r["step"] for r in records]
        elif x == "tokens":
            xs = [self.tokens_before(r["step"]) for r in records]
        else:
            xs = [r["time"] - self.start_time() for r in records]
        ys = [r[key] for r in records]
        if key == CENTRED_MEAN:
            for i in reversed(task_changes(records)):
                xs.insert(i, float("nan"))
                ys.insert(i, float("nan"))
        return xs, ys

    def task_change_steps(self) -> list[int]:
        """The steps from which the run's centred mean averages other tasks than before."""
        records = [r for r in self.records if CENTRED_MEAN in r]
        return [records[i]["step"] for i in task_changes(records)]

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


def scored_tasks(record: dict) -> set[str]:
    """The tasks a record's centred mean averages: those with an acc (eval/<task>/acc)."""
    return {key.split("/")[1] for key in record if key.startswith("eval/") and key.endswith("/acc")}


def task_changes(records: list[dict]) -> list[int]:
    """The positions in records (each holding a centred mean) where it averages other tasks than the
    record before: from there it is another figure."""
    return [i for i in range(1, len(records)) if scored_tasks(records[i]) != scored_tasks(records[i - 1])]


def check_y_range(args: argparse.Namespace) -> None:
    if args.from_step is not None and args.from_step < 0:
        raise UserError(f"--from-step={args.from_step} is not allowed (use a step, 0 or more)")
    if args.ylim is not None:
        low, high = args.ylim
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise UserError(f"--ylim {low:g} {high:g} is not a range (give two finite numbers, the lower first)")


def focus_step(run: "Run") -> int:
    """Where the default range of one run starts: past the first LOSS_FOCUS of its own steps, so
    that a short run beside a long one keeps its end in view."""
    last = max((record["step"] for record in run.records), default=0)
    return math.ceil(LOSS_FOCUS * last)


def loss_range(runs: list[Run], from_step: Callable[[Run], int]) -> tuple[float, float] | None:
    """From the lowest to the highest train or val loss the runs logged from from_step(run) on,
    widened by Y_MARGIN of that span each way; None (Matplotlib's own range) when they hold no two
    values."""
    losses = [
        record[key]
        for run in runs
        for record in run.records
        if record["step"] >= from_step(run)
        for key in ("loss", "val_loss")
        if key in record and math.isfinite(record[key])
    ]
    if not losses or min(losses) == max(losses):
        return None
    margin = Y_MARGIN * (max(losses) - min(losses))
    return min(losses) - margin, max(losses) + margin


def y_range(args: argparse.Namespace, runs: list[Run]) -> tuple[tuple[float, float] | None, str]:
    """The loss panels' y range (None: Matplotlib's, over every value) and the heading that says how
    it was chosen."""
    if args.ylim is not None:
        return tuple(args.ylim), f"loss from {args.ylim[0]:g} to {args.ylim[1]:g} (--ylim)"
    if args.full:
        return None, ""
    if args.from_step is not None:
        starts = {args.from_step}
        limits = loss_range(runs, lambda run: args.from_step)
    else:
        starts = {focus_step(run) for run in runs}
        limits = loss_range(runs, focus_step)
    if limits is None:
        return None, ""
    if len(starts) == 1:
        return limits, f"loss range fitted to steps {starts.pop():,} and later (--full: every step)"
    shown = f"{LOSS_FOCUS * 100:.0f}%"
    return limits, f"loss range fitted to each run's steps after its first {shown} (--full: every step)"


def plot_loss(args: argparse.Namespace) -> None:
    runs = [Run.read(directory) for directory in args.runs]
    for run in runs:
        for step in run.task_change_steps():
            print(
                f"note: run {run.name} scored other [eval] tasks from step {step}: its centred_mean line breaks there",
                file=sys.stderr,
            )
    save(loss_figure(runs, args.x, *y_range(args, runs)), args.out)
    print_table(["run", "step", "val loss", "val bpb", "wall time (s)"], [run.summary() for run in runs])


def run_styles(count: int) -> list[dict]:
    """A (colour, line style) pair for each of count runs, no two alike: the ten colours of tab10 drawn
    solid, then dashed, dotted and dash-dotted; past 40 runs, count / 4 colours sampled evenly from a
    continuous colormap, each in the four styles."""
    if count <= len(PALETTE) * len(LINE_STYLES):
        colours = list(PALETTE)
    else:  # more than a qualitative palette holds: evenly spaced shades of one bright colormap
        shades = -(-count // len(LINE_STYLES))  # ceil
        colours = [matplotlib.colormaps["turbo"](i / (shades - 1)) for i in range(shades)]
    return [{"color": colours[i % len(colours)], "linestyle": LINE_STYLES[i // len(colours)]} for i in range(count)]


def loss_figure(runs: list[Run], x: str, ylim: tuple[float, float] | None = None, heading: str = "") -> plt.Figure:
    """The train loss, the val loss and each [eval] figure in a panel of its own, at most three a row;
    each run keeps its colour and line style in every panel, and one legend below the panels names them.
    ylim: the loss panels' y range (None: Matplotlib's); heading: above the panels."""
    # [rl] runs log a policy-gradient loss, no cross-entropy: when every run is one, it takes the train
    # loss's panel, on a scale of its own (beside other runs it has a panel of its own)
    rl_only = all(any(RL_LOSS in record for record in run.records) for run in runs)
    figures = [key for key in downstream_keys(runs) if not (rl_only and key == RL_LOSS)]
    panels = 2 + len(figures)
    rows = -(-panels // 3)
    columns = -(-panels // rows)  # rows as even as they can be: four panels are two by two
    names = [run.name for run in runs]
    legend_columns = max(1, min(len(runs), int(PANEL_SIZE[0] * columns // legend_entry_width(names))))
    legend_rows = -(-len(runs) // legend_columns)
    size = (PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows + LEGEND_ROW_HEIGHT * (legend_rows + 1))
    # constrained layout keeps the legend placed "outside" clear of every panel, whatever its size
    fig, axes = plt.subplots(rows, columns, figsize=size, squeeze=False, layout="constrained")
    for ax in axes.flat[panels:]:
        ax.remove()
    drawn = list(axes.flat[:panels])
    train_ax, val_ax, *eval_axes = drawn
    if not rl_only:
        val_ax.sharey(train_ax)
    for run, style in zip(runs, run_styles(len(runs)), strict=True):
        train_ax.plot(*run.curve(RL_LOSS if rl_only else "loss", x), linewidth=1, label=run.name, **style)
        val_ax.plot(*run.curve("val_loss", x), marker="o", markersize=3, label=run.name, **style)
        for ax, key in zip(eval_axes, figures, strict=True):
            ax.plot(*run.curve(key, x), marker="o", markersize=3, label=run.name, **style)
    titles = [figure_title(RL_LOSS) if rl_only else "train loss (each logged step)", "val loss (each evaluation)"]
    titles += [figure_title(key) for key in figures]
    for ax, title in zip(drawn, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(X_AXES[x])
        ax.grid(alpha=0.3)
    (val_ax if rl_only else train_ax).set_ylabel("cross-entropy (nats per token)")
    if rl_only:
        train_ax.set_ylabel(Y_LABELS[RL_LOSS])
    if ylim is not None:
        (val_ax if rl_only else train_ax).set_ylim(ylim)  # else the val panel shares it
    if heading:
        fig.suptitle(heading, fontsize=9)
    for ax, key in zip(eval_axes, figures, strict=True):
        ax.set_ylabel(Y_LABELS.get(key, "share of questions" if key.startswith(RL_PASS) else "accuracy"))
    handles = train_ax.get_lines()  # one per run, in the runs' order
    fig.legend(handles, names, loc="outside lower center", ncols=legend_columns, fontsize=8)
    return fig


def legend_entry_width(names: list[str]) -> float:
    """Inches a legend entry of the longest name takes at fontsize 8: about 0.07 in a character, plus
    the line sample and the gaps beside it."""
    return 0.7 + 0.07 * max(len(name) for name in names)


def downstream_keys(runs: list[Run]) -> list[str]:
    """The figures beside the losses that the runs logged and that are drawn: each [eval] task's acc,
    then the centred mean; an [rl] run's loss, its mean reward, then its held-out pass@k by k."""
    keys = {key for run in runs for record in run.records for key in record if key.startswith(("eval/", "rl/"))}
    passes = sorted((key for key in keys if key.startswith(RL_PASS)), key=lambda key: int(key.removeprefix(RL_PASS)))
    return (
        sorted(key for key in keys if key.endswith("/acc"))
        + sorted(keys & {CENTRED_MEAN})
        + sorted(keys & {RL_LOSS})
        + sorted(keys & {RL_REWARD})
        + passes
    )


def figure_title(key: str) -> str:
    """A panel's title for a figure of downstream_keys."""
    if key == RL_LOSS:
        return "[rl] policy-gradient loss (each logged step)"
    if key == RL_REWARD:
        return "[rl] mean reward (each logged step)"
    if key.startswith(RL_PASS):
        return f"[rl] held-out {key.removeprefix('rl/')}"
    return f"[eval] {key.removeprefix('eval/')}"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row, widths, strict=True))
            )
        )


def pattern_mask(config: GPTConfig, size: int, prefix: int, documents_at: list[int]) -> torch.Tensor:
    """(size, size) boolean: the config's rule over positions 0 .. size - 1 of one row."""
    positions = torch.arange(size)[None]  # (1, size)
    starts = torch.zeros(size, dtype=torch.long)
    starts[[p for p in documents_at if 0 <= p < size]] = 1
    doc_ids = starts.cumsum(0)[None]  # (1, size): the document of each position
    rule = pattern_rule(config, torch.tensor([prefix]), doc_ids)
    return dense_mask(rule, positions, positions)[0, 0]


def every_pattern(size: int) -> dict[str, dict]:
    """One config per pattern, with sizes that show at `size` positions."""
    window = max(2, size // 4)
    return {
        "causal": {},
        f"sliding window (attn_window={window})": {"attn_window": window},
        f"window + sinks (attn_window={window}, attn_sinks=2)": {"attn_window": window, "attn_sinks": 2},
        "prefix-LM (attn_prefix_lm)": {"attn_prefix_lm": True},
        f"block-causal (attn_block={max(2, size // 6)})": {"attn_block": max(2, size // 6)},
        "documents (attn_documents)": {"attn_documents": True},
        f"documents + window (attn_window={window})": {"attn_documents": True, "attn_window": window},
    }


def draw_mask(ax, mask: torch.Tensor, title: str) -> None:
    size = mask.size(0)
    colours = matplotlib.colors.ListedColormap([BLOCKED, ALLOWED])
    ax.imshow(mask.int().numpy(), cmap=colours, vmin=0, vmax=1)
    ax.set_xticks(torch.arange(-0.5, size, 1).tolist(), minor=True)
    ax.set_yticks(torch.arange(-0.5, size, 1).tolist(), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    step = max(1, size // 8)
    ax.set_xticks(range(0, size, step))
    ax.set_yticks(range(0, size, step))
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=10)


def plot_mask(args: argparse.Namespace, overrides: list[str]) -> None:
    model_config = load_config(args.config, overrides).model
    size = args.size
    if not 1 <= size <= model_config.block_size:
        raise UserError(f"--size={size} must be between 1 and model.block_size={model_config.block_size}")
    if args.all and size < ALL_MIN_SIZE:
        block = model_config.block_size
        fewer = (
            f"; model.block_size={block} holds fewer: draw its one pattern without --all"
            if block < ALL_MIN_SIZE
            else ""
        )
        raise UserError(
            f"--all --size={size} is too few positions to tell the patterns apart: they differ from {ALL_MIN_SIZE} on "
            f"(where the prefix and the documents drawn, a third each, outgrow the window of 2), so use --size "
            f"{ALL_MIN_SIZE} or more{fewer}"
        )
    prefix = args.prefix if args.prefix is not None else max(1, size // 3)
    documents_at = args.documents_at if args.documents_at is not None else [size // 3, 2 * size // 3]
    if args.all:
        plain = dataclasses.replace(model_config, **PLAIN_CAUSAL)
        configs = {title: dataclasses.replace(plain, **keys) for title, keys in every_pattern(size).items()}
    else:
        configs = {describe(model_config): model_config}
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 4.6), squeeze=False)
    for ax, (title, config) in zip(axes[0], configs.items(), strict=True):
        draw_mask(ax, pattern_mask(config, size, prefix, documents_at), title)
    fig.suptitle(f"attention masks over {size} positions: dark = may attend, light = blocked", fontsize=11)
    save(fig, args.out)


def describe(config: GPTConfig) -> str:
    changed = [f"{key}={str(getattr(config, key)).lower()}" for key in PLAIN_CAUSAL if getattr(config, key)]
    return ", ".join(changed) or "causal"


def attention_maps(model: GPT, ids: list[int]) -> torch.Tensor:
    """(n_layer, n_head, T, T) the attention weights of every layer and head for one prompt (a
    prefix-LM model reads it as its prefix, as when sampling)."""
    inputs = {}

    def keep_input(layer: int):
        def hook(module, args):
            inputs[layer] = args  # (x after ln_1, mask, cache, rotate, value embedding)

        return hook

    handles = [block.attn.register_forward_pre_hook(keep_input(i)) for i, block in enumerate(model.transformer.h)]
    idx = torch.tensor([ids])
    prefix = torch.tensor([len(ids)]) if model.config.attn_prefix_lm else None
    with torch.no_grad():
        model(idx, prefix=prefix)
        weights = []
        for i, block in enumerate(model.transformer.h):
            x, mask, _, rotate = inputs[i][:4]  # the weights read no value embedding
            weights.append(block.attn.weights(x, mask, rotate)[0])
    for handle in handles:
        handle.remove()
    return torch.stack(weights)


def plot_attention(args: argparse.Namespace) -> None:
    checkpoint_path = Path(args.out_dir) / CHECKPOINT_NAME
    model, tokenizer = model_from_checkpoint(load_checkpoint(checkpoint_path), checkpoint_path)
    ids = tokenizer.encode(args.prompt)
    if not 1 <= len(ids) <= model.config.block_size:
        raise UserError(f"--prompt is {len(ids)} tokens; it must hold 1 to block_size={model.config.block_size} tokens")
    weights = attention_maps(model, ids)  # (L, H, T, T)
    labels = [repr(tokenizer.decode([i]))[1:-1].replace(" ", "\u2423") for i in ids]  # a space shows as ␣
    if args.average:
        maps = {"mean over layers and heads": weights.mean(dim=(0, 1))}
        rows, cols = 1, 1
    else:
        rows, cols = weights.shape[:2]
        maps = {f"layer {layer}, head {head}": weights[layer, head] for layer in range(rows) for head in range(cols)}
    cell = max(3.0, 0.22 * len(ids))
    fig, axes = plt.subplots(rows, cols, figsize=(cell * cols + 1, cell * rows + 1), squeeze=False)
    for ax, (title, grid) in zip(axes.flat, maps.items(), strict=True):
        blocked_white = matplotlib.colormaps["viridis"].with_extremes(bad="white")
        image = ax.imshow(np.ma.masked_equal(grid.numpy(), 0), cmap=blocked_white, vmin=0, vmax=1)
        ax.set_xticks(range(len(ids)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(ids)), labels, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(f"{describe(model.config)} attention on {args.prompt!r} (white: blocked)", fontsize=10)
    save(fig, args.out)


def check_out(out: str) -> None:
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise UserError(f"--out={out!r} must name a .png file")
    if not path.parent.is_dir():
        raise UserError(f"--out={out!r}: the folder {str(path.parent)!r} does not exist")
    check_output_file(path, "--out", drawn_by_matplotlib, "a picture drawn by plot.py (a PNG Matplotlib wrote)")


def drawn_by_matplotlib(path: Path) -> bool:
    """A PNG that Matplotlib wrote, as plot.py's pictures are (its `Software` text names Matplotlib):
    an earlier picture, which --out may replace."""
    from PIL import Image  # Matplotlib's own dependency

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software", "").startswith("Matplotlib")
    except (OSError, ValueError):  # not an image, or a damaged one
        return False


def save(fig, out: str) -> None:
    path = Path(out)
    with atomic_open(path) as f:  # a picture appears whole or not at all
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args, overrides = parse_args(argv)
    check_out(args.out)
    if args.command == "loss":
        plot_loss(args)
    elif args.command == "mask":
        plot_mask(args, overrides)
    else:
        plot_attention(args)


if __name__ == "__main__":
    run_cli(main)
