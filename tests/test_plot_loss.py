"""plot.py loss: curves of several runs from their metrics.jsonl, and a table of final values; each run
keeps one colour and line style of its own in every panel, and the legend covers no curve."""

import json
import math

import matplotlib.image
import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_rgba

import plot
from plot import Run, loss_figure, main, run_styles
from tests.conftest import run_script, tiny_config, tiny_toml
from trainer.loop import Trainer


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("run_a", 1e-3), ("run_b", 3e-3)):
        overrides = dict(train__max_iters=6, train__eval_interval=3, optim__learning_rate=lr)
        Trainer(tiny_config(root / name, data_dir, **overrides)).fit()
    return root / "run_a", root / "run_b"


def final_val_loss(run_dir) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in records if "val_loss" in r][-1]


@pytest.mark.parametrize("x", ["steps", "tokens", "time"])
def test_loss_curves_of_two_runs_make_a_png_and_a_table(two_runs, tmp_path, capsys, x):
    out = tmp_path / "loss.png"
    main(["loss", *map(str, two_runs), "--x", x, "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(out).shape
    assert height > 200 and width > 400
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["run", "step", "val", "loss", "val", "bpb", "wall", "time", "(s)"]
    for line, run_dir in zip(table[1:], two_runs, strict=True):
        name, step, val_loss, val_bpb, seconds = line.split()
        assert (name, step) == (run_dir.name, "6")
        assert float(val_loss) == pytest.approx(final_val_loss(run_dir), abs=1e-4)
        assert float(val_bpb) == pytest.approx(float(val_loss) / 0.6931, rel=1e-3)  # one byte per character
        times = [json.loads(line)["time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert float(seconds) == pytest.approx(times[-1] - times[0], abs=0.051)  # a tiny run may take < 0.05 s


def test_a_run_still_writing_its_metrics_can_be_plotted(two_runs, tmp_path, capsys):
    running = tmp_path / "running"
    running.mkdir()
    (running / "config.toml").write_text((two_runs[0] / "config.toml").read_text())
    lines = (two_runs[0] / "metrics.jsonl").read_text()
    (running / "metrics.jsonl").write_text(lines[: lines.index('{"step": 4')] + '{"step": 4, "lo')
    main(["loss", str(running), "--out", str(tmp_path / "loss.png")])
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["running", "3"]


def test_a_chat_step_logged_without_a_trained_token_draws_no_loss(two_runs, tmp_path):
    """A run's metrics.jsonl from before such steps went unlogged: its loss of 0 is a mean over nothing,
    so it is left off the curve and out of the y range."""
    run = tmp_path / "chat"
    run.mkdir()
    (run / "config.toml").write_text((two_runs[0] / "config.toml").read_text())
    records = [
        {"step": 1, "loss": 2.5, "trained_tokens": 40},
        {"step": 2, "loss": 0.0, "trained_tokens": 0},
        {"step": 3, "loss": 2.25, "trained_tokens": 38},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    assert Run.read(str(run)).curve("loss", "steps") == ([1, 3], [2.5, 2.25])
    low, _ = plot.loss_range([Run.read(str(run))], lambda run: 0)
    assert low > 2.0


def test_a_directory_without_metrics_is_refused_in_one_line(two_runs, tmp_path):
    result = run_script("plot.py", "loss", str(two_runs[0]), str(tmp_path), "--out", str(tmp_path / "loss.png"))
    assert result.returncode == 2
    assert (
        result.stderr
        == f"error: {tmp_path} holds no metrics.jsonl: it is not a run directory, or its run has logged nothing yet\n"
    )
    assert not (tmp_path / "loss.png").exists()


def made_up_runs(count: int, name_length: int = 20) -> list[Run]:
    """count runs with 50 logged steps, 5 evaluations and two [eval] figures, named like ablation runs."""
    runs = []
    for number in range(count):
        records = []
        for step in range(0, 500, 10):
            record = {"step": step, "loss": 4 / (1 + step / 100) + 0.01 * number, "time": step / 10}
            if step % 100 == 0:
                record |= {"val_loss": record["loss"] + 0.05, "eval/task/acc": 0.25 + step / 2000}
                record["eval/centred_mean"] = (record["eval/task/acc"] - 0.25) / 0.75
            records.append(record)
        runs.append(
            Run(f"variant-{number}-seed1337".rjust(name_length, "x"), records, tokens_before=lambda step: 768 * step)
        )
    return runs


@pytest.mark.parametrize("count", [1, 12, 25, 45])  # 45: more runs than ten colours in four styles
def test_every_run_has_its_own_colour_and_line_style_the_same_in_every_panel(count):
    fig = loss_figure(made_up_runs(count), "steps")
    panels = [ax for ax in fig.axes if ax.get_lines()]
    assert len(panels) == 4  # train loss, val loss, the task's acc, the centred mean
    styles = [{line.get_label(): (to_rgba(line.get_color()), line.get_linestyle()) for line in ax.get_lines()}
              for ax in panels]  # fmt: skip
    assert len(styles[0]) == count and len(set(styles[0].values())) == count
    assert all(panel == styles[0] for panel in styles[1:])
    plt.close(fig)


def test_no_two_runs_share_a_style_whatever_their_number():
    for count in range(1, 130):
        pairs = [(to_rgba(style["color"]), style["linestyle"]) for style in run_styles(count)]
        assert len(set(pairs)) == count, count


@pytest.mark.parametrize("count, name_length", [(1, 20), (12, 25), (25, 40)])
def test_the_legend_lies_outside_every_panel_and_inside_the_picture(count, name_length):
    """Each panel's legend used to sit in its upper right corner, over the curves of many runs."""
    fig = loss_figure(made_up_runs(count, name_length), "steps")
    fig.canvas.draw()  # Agg: lays the figure out, as saving does
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert not any(ax.get_legend() for ax in fig.axes)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent()), ax.get_title()
    assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    assert [text.get_text() for text in legend.get_texts()] == [run.name for run in made_up_runs(count, name_length)]
    plt.close(fig)


def test_a_centred_mean_over_other_tasks_is_not_joined_to_the_line_before(two_runs, tmp_path, capsys):
    """A run resumed with other [eval] tasks (which a resume refuses, but older runs' metrics
    hold) logs a centred mean of another set of tasks: its line breaks there, and a note says so."""
    run = tmp_path / "resumed"
    run.mkdir()
    (run / "config.toml").write_text((two_runs[0] / "config.toml").read_text())
    records = []
    for step, tasks in ((0, ["a"]), (5, ["a"]), (10, ["a", "b"]), (15, ["a", "b"])):
        figures = {f"eval/{task}/acc": 0.5 for task in tasks}
        records.append({"step": step, "loss": 3.0, "val_loss": 3.0, **figures, "eval/centred_mean": step / 20})
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    main(["loss", str(run), "--out", str(tmp_path / "loss.png")])
    assert "note: run resumed scored other [eval] tasks from step 10: its centred_mean line breaks there" in (
        capsys.readouterr().err
    )
    centred_ax = loss_figure([Run.read(str(run))], "steps").axes[-1]
    assert centred_ax.get_title() == "[eval] centred_mean"
    xs, ys = centred_ax.get_lines()[0].get_data()
    assert list(xs[:2]) == [0, 5] and list(xs[3:]) == [10, 15] and math.isnan(ys[2])


def write_recipe_runs(root, gap: float = 0.02) -> list[str]:
    """Two runs of 1,000 steps whose losses fall as the quickstart's do (4.2 at step 0, 1.5 at the
    end) and differ by gap throughout: two recipes to compare."""
    directories = []
    for number in range(2):
        run = root / f"recipe_{number}"
        run.mkdir(parents=True)
        (run / "config.toml").write_text(tiny_toml(out_dir=run, data_dir=root))
        records = []
        for step in range(0, 1001, 10):
            loss = 1.5 + 2.7 * math.exp(-step / 60) + gap * number
            record = {"step": step, "loss": loss + 0.01 * math.sin(step)}
            if step % 100 == 0:
                record["val_loss"] = loss + 0.03
            records.append(record)
        (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
        directories.append(str(run))
    return directories


def drawn_loss_range(monkeypatch, tmp_path, *options) -> tuple[tuple[float, float], str]:
    """The y range of the train and val panels of plot.py loss on the two recipe runs, and the title."""
    figures = []
    monkeypatch.setattr(plot, "save", lambda fig, out: figures.append(fig))
    main(["loss", *write_recipe_runs(tmp_path), "--out", str(tmp_path / "loss.png"), *options])
    train_ax, val_ax = figures[0].axes[:2]
    assert val_ax.get_ylim() == train_ax.get_ylim()
    title = figures[0]._suptitle.get_text() if figures[0]._suptitle else ""
    plt.close(figures[0])
    return train_ax.get_ylim(), title


def test_by_default_the_loss_range_shows_runs_002_apart_at_the_end_of_training(monkeypatch, tmp_path, capsys):
    """Step 0's loss (4.2) used to set the range, so recipes 0.02 apart drew as one line: the range
    fits the losses after the first fifth of the steps, with a margin, and the title says so."""
    (low, high), title = drawn_loss_range(monkeypatch, tmp_path)
    assert 0.02 / (high - low) > 0.05  # the gap is at least a twentieth of the panel's height
    final = [1.5 + 2.7 * math.exp(-1000 / 60) + gap for gap in (0, 0.02, 0.03, 0.05)]  # train, val of both
    assert low < min(final) - 0.005 and high > 1.5 + 2.7 * math.exp(-200 / 60) + 0.05  # every loss from step 200
    assert title == "loss range fitted to steps 200 and later (--full: every step)"


def test_the_loss_range_can_show_every_step_start_at_a_step_or_be_given(monkeypatch, tmp_path):
    (low, high), title = drawn_loss_range(monkeypatch, tmp_path / "full", "--full")
    assert low < 1.5 and high > 4.2 + 0.02 and title == ""  # step 0 included: Matplotlib's own range
    (low, high), _ = drawn_loss_range(monkeypatch, tmp_path / "from", "--from-step", "500")
    fitted = [1.5 + 2.7 * math.exp(-500 / 60) + 0.05, 1.5 + 2.7 * math.exp(-1000 / 60)]
    assert low < fitted[1] and high > fitted[0] and high - low < 1.5 * (fitted[0] - fitted[1]) + 0.02
    assert drawn_loss_range(monkeypatch, tmp_path / "given", "--ylim", "1.4", "1.6") == (
        (1.4, 1.6),
        "loss from 1.4 to 1.6 (--ylim)",
    )
