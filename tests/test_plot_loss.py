"""plot.py loss: curves of several runs from their metrics.jsonl, and a table of final values."""

import json

import matplotlib.image
import pytest

from plot import main
from tests.conftest import run_script, tiny_config
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


def test_a_directory_without_metrics_is_refused_in_one_line(two_runs, tmp_path):
    result = run_script("plot.py", "loss", str(two_runs[0]), str(tmp_path), "--out", str(tmp_path / "loss.png"))
    assert result.returncode == 2
    assert (
        result.stderr
        == f"error: {tmp_path} holds no metrics.jsonl: it is not a run directory, or its run has logged nothing yet\n"
    )
    assert not (tmp_path / "loss.png").exists()
