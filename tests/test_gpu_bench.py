"""bench/gpu.py, the one command that checks and measures the CUDA path, must run the first time a
GPU is there: its smoke run (every part at toy sizes on the CPU) is run here, on a Python where
`datasets` and `wandb` cannot be imported, as on the GPU image."""

import json
import os
import subprocess
import sys
import time

import pytest

from bench.gpu import PARTS, run_part, wait_or_stop
from tests.conftest import PROJECT_ROOT

BLOCK_OPTIONAL = "import sys\nfor name in ('datasets', 'wandb'):\n    sys.modules[name] = None  # import fails\n"


@pytest.fixture
def without_datasets_and_wandb(tmp_path) -> dict:
    """An environment whose Pythons (and their subprocesses) cannot import datasets or wandb."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_OPTIONAL)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    for name in ("datasets", "wandb"):
        check = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert check.returncode != 0 and "ModuleNotFoundError" in check.stderr, f"{name} is still importable"
    return env


@pytest.mark.slow
def test_smoke_run_of_every_part_needs_neither_datasets_nor_wandb(tmp_path, without_datasets_and_wandb):
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, "bench/gpu.py", "--smoke", "--out", str(out)],
        cwd=PROJECT_ROOT,
        env=without_datasets_and_wandb,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(path.name for path in out.iterdir()) == ["log.txt", "report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    log = (out / "log.txt").read_text()
    assert [part["part"] for part in report["parts"]] == [part.name for part in PARTS]
    assert {part["part"]: part["status"] for part in report["parts"]} == {part.name: "ok" for part in PARTS}, log
    figures = {figure["figure"]: figure["value"] for part in report["parts"] for figure in part["figures"]}
    assert figures["pytest -m gpu"].startswith("0 passed, 0 failed, 0 errors")  # collected, all skipped on a CPU
    for config in ("shakespeare_char_gpu", "shakespeare_char_gpu_modern"):
        assert figures[f"{config}: wall time"].endswith("for 4 steps")
        assert figures[f"{config}: first val loss <= 1.4697"] == "not reached"  # 4 steps of a toy model
    assert figures["GPT-2 124M: tokens/s"][0].isdigit()
    assert figures["window vs causal, attention alone, forward and backward"].endswith(
        "dense bool mask (2, 1, 64, 64))"
    )
    assert figures["compiled static cache (CUDA graphs)"].startswith("skipped: no CUDA")
    assert figures["decoding batch 1: ours, cache, eager, nn.Linear"].endswith("x transformers)")
    assert figures["baby GPT step, FSDP2 (gloo)"].endswith("x the plain run's)")
    assert figures["kill and resume (FSDP2, torchrun)"].startswith("bit for bit at all 8 steps")
    table = (out / "report.md").read_text()
    assert "| GPT-2 124M: MFU | n/a (no known peak) | >= 55% on an H100" in table


def test_part_whose_command_outlives_its_budget_is_stopped_and_reported(tmp_path):
    """A part stops its commands at its own deadline: the parts after it keep their time."""
    with open(tmp_path / "log.txt", "w") as log:
        start = time.monotonic()
        result = run_part("tests", 2, tmp_path, smoke=True, log=log, grace=5)
    assert time.monotonic() - start < 2 + 5 + 5  # budget, grace, and slack for a busy machine's start-up
    assert result["status"] == "ok"  # the part itself ended in time, with what it could say
    output = (tmp_path / "log.txt").read_text().splitlines()
    assert output[-len(result["output_tail"]) :] == result["output_tail"] and len(result["output_tail"]) > 1
    (figure,) = result["figures"]
    assert figure["figure"] == "pytest -m gpu"
    assert "stopped at" in figure["value"] and "time limit" in figure["value"]


def test_process_that_ignores_sigterm_is_killed_after_the_grace():
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", ignores], stdout=subprocess.PIPE)
    process.stdout.readline()  # the handler is set
    start = time.monotonic()
    assert wait_or_stop(process, 0.2, grace=0.5) is None
    assert time.monotonic() - start < 5
    assert process.returncode == -9
