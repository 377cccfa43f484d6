"""bench/gpu.py, the one command that checks and measures the CUDA path, must run the first time a
GPU is there: its smoke run (every part at toy sizes on the CPU) is run here, on a Python where the
packages a bare CUDA image lacks cannot be imported, as on such an image with no package index."""

import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

from bench.attention import tiles_computed
from bench.gpu import PARTS, parts_in_order, run_part, wait_or_stop
from model.attention import flex_block_mask
from model.masks import prefix_lm, sliding_window
from tests.conftest import PROJECT_ROOT, tf32_off

# dependencies, or test extras, that a bare CUDA image lacks (the first four) or may lack
MISSING_ON_GPU_IMAGE = ("datasets", "wandb", "gguf", "lm_eval", "peft", "accelerate")
BLOCK_MISSING = f"import sys\nfor name in {MISSING_ON_GPU_IMAGE}:\n    sys.modules[name] = None  # import fails\n"


@pytest.fixture
def as_on_the_gpu_image(tmp_path) -> dict:
    """An environment whose Pythons (and their subprocesses) cannot import what a bare CUDA image lacks."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_MISSING)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    for name in MISSING_ON_GPU_IMAGE:
        check = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert check.returncode != 0 and "ModuleNotFoundError" in check.stderr, f"{name} is still importable"
    return env


@pytest.mark.slow
def test_smoke_run_of_every_part_needs_only_what_the_gpu_image_holds(tmp_path, as_on_the_gpu_image):
    out = tmp_path / "report"
    result = subprocess.run(
        [sys.executable, "bench/gpu.py", "--smoke", "--out", str(out)],
        cwd=PROJECT_ROOT,
        env=as_on_the_gpu_image,
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
    decoding = figures["decoding batch 1: ours, model's step, nn.Linear"]
    assert re.search(r"x transformers\), [\d,]+ after the first token$", decoding), decoding
    assert re.search(r"x the plain run's, [+-]\d+\.\d ms\)$", figures["baby GPT step, FSDP2 (gloo)"])
    assert figures["kill and resume (FSDP2, torchrun)"].startswith("bit for bit at all 8 steps")
    table = (out / "report.md").read_text()
    assert "| GPT-2 124M: MFU | n/a (no known peak) | >= 55% on an H100" in table


def test_part_whose_command_outlives_its_budget_is_stopped_and_reported(tmp_path):
    """A part stops its commands at its own deadline: the parts after it keep their time."""
    with open(tmp_path / "log.txt", "w") as log:
        start = time.monotonic()
        # a grace generous for a busy machine: under a load of 8 on 2 cores, pytest took over 5 s to write
        # its report after SIGINT; on an idle one it takes about 2
        result = run_part("tests", 2, tmp_path, smoke=True, log=log, grace=30)
    assert time.monotonic() - start < 2 + 30 + 5  # budget, grace, and slack for a busy machine's start-up
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


# a command that goes on waiting for its worker on SIGINT (as pytest-xdist's controller waits for each worker
# to finish its test), and a worker that ends its work on SIGINT at once, leaving a trace (a report)
WORKER = """import sys, time
print(flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:
    open(sys.argv[1], "w").close()
"""
CONTROLLER = """import subprocess, sys
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while worker.poll() is None:
    try:
        worker.wait()
    except KeyboardInterrupt:
        pass
"""
# as bench/gpu.py's part does: SIGINT handled whatever this test's runner was started with (a shell's
# background job ignores it, and its children would inherit that)
PART = """import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, sys.argv[4])
from bench.gpu import wait_or_stop
command = subprocess.Popen([sys.executable, "-c", *sys.argv[1:4]], stdout=subprocess.PIPE)
command.stdout.readline()  # the worker has started
print(wait_or_stop(command, 0.5, grace=20, stop=signal.SIGINT, group=True))
"""


def test_command_stopped_at_its_limit_with_its_group_stops_what_it_started_at_once(tmp_path):
    """pytest-xdist's controller, sent SIGINT at the tests' limit, waits for each worker to finish its
    test (a compilation can outlast the grace, and a killed pytest writes no report): sent to the part's
    process group, as Ctrl-C in a terminal, the workers stop at once, and the part itself goes on."""
    reported = tmp_path / "worker-reported"
    argv = [sys.executable, "-c", PART, CONTROLLER, WORKER, str(reported), str(PROJECT_ROOT)]
    start = time.monotonic()
    part = subprocess.run(argv, start_new_session=True, capture_output=True, text=True, timeout=60)
    assert part.returncode == 0 and part.stdout.split() == ["None"], part.stderr  # stopped at its limit
    assert reported.exists()
    assert time.monotonic() - start < 15  # not the 20 s of grace, nor the worker's 60 s


def test_window_of_512_at_4096_computes_150_of_causal_attentions_528_tiles():
    """What FlexAttention can skip bounds the window's gain: 3.52x here, not T / window / 2 = 4x."""
    window = flex_block_mask(sliding_window(512), None, 4096, torch.device("cpu"))
    assert tiles_computed(None, 4096) == 32 * 33 / 2 == 528
    assert tiles_computed(window, 4096) == 4 * 5 / 2 + 28 * 5 == 150  # the first rows reach back less far
    rows = flex_block_mask(prefix_lm(torch.tensor([0, 4096])), 2, 4096, torch.device("cpu"))  # causal; all
    assert tiles_computed(rows, 4096) == (528 + 32 * 32) / 2  # per row and head
    assert tiles_computed(torch.ones(1, 1, 4096, 4096, dtype=torch.bool), 4096) is None  # SDPA computes them all


def test_parts_run_in_the_order_given_each_once():
    """A short rental of a GPU runs the parts that matter most first: the order given, not the script's."""
    names = ["tests", "decode", "environment", "tests"]
    assert [part.name for part in parts_in_order(names)] == ["tests", "decode", "environment"]


def test_decoding_benchmark_stopped_early_leaves_the_rounds_it_timed(tmp_path, monkeypatch):
    """bench/gpu.py stops a part at its time limit: the rounds of decoding timed before it still count."""
    import bench.decode

    calls = {}

    def timed(run, device):  # 2 s the first call of a row, then 0.5 s (0.1 s to the first token); stopped in round 2
        calls[run] = calls.get(run, 0) + 1
        if calls[run] == 3:
            raise KeyboardInterrupt  # as the part's deadline would stop the script
        return (2.0 if calls[run] == 1 else 0.5), None, 0.25, 0.1

    result = tmp_path / "decode.json"
    argv = ["bench/decode.py", "--small", "--no-compile", "--new-tokens=4", "--batch-sizes=1", "--gguf-types"]
    monkeypatch.setattr(sys, "argv", argv + ["--repeats=3", f"--json={result}"])
    monkeypatch.setattr(bench.decode, "timed", timed)
    with pytest.raises(KeyboardInterrupt):
        bench.decode.main()
    written = json.loads(result.read_text())
    assert written["complete"] is False
    rows = written["rows"]
    assert rows[0]["implementation"] == "transformers generate" and len(rows) == len(calls) > 2
    assert all(row["seconds"] == [0.5] and row["tokens_per_sec"] == 4 / 0.5 for row in rows)  # one round each
    assert all(row["first_call_seconds"] == 2.0 for row in rows)
    assert all(row["first_token_seconds"] == [0.1] and row["tokens_per_sec_after_first"] == 3 / 0.4 for row in rows)


def test_decoding_benchmark_times_the_first_token_apart(tmp_path, monkeypatch):
    """Each round of a row that decodes says when its first new token came (the prompt's encoding and
    the first sample), and the tokens after it are timed apart from it, for transformers and for ours."""
    import bench.decode

    result = tmp_path / "decode.json"
    argv = ["bench/decode.py", "--small", "--no-compile", "--new-tokens=4", "--batch-sizes=1", "--gguf-types"]
    argv += ["--step-rows-only", "--precisions", "float32", "--repeats=2", f"--json={result}"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.decode.main()
    rows = json.loads(result.read_text())["rows"]
    assert [row["implementation"] for row in rows] == ["transformers generate", "ours, decoding step"]
    for row in rows:
        assert len(row["first_token_seconds"]) == 2
        rounds = list(zip(row["first_token_seconds"], row["seconds"], strict=True))
        assert all(0 < first < whole for first, whole in rounds)
        after = statistics.median(3 / (whole - first) for first, whole in rounds)  # 3 tokens after the first
        assert row["tokens_per_sec_after_first"] == pytest.approx(after)


def test_gpu_tests_turn_tf32_off_and_restore_it_after():
    """The GPU tests that compare float32 results exactly turn TF32 off (a trainer on CUDA turns it
    on) and must leave it as they found it, without the teardown error that pytest's monkeypatch
    raises on these flags. The flags can be set on a CPU-only build too."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn)
    before = [flag.allow_tf32 for flag in flags]
    try:
        for flag in flags:
            flag.allow_tf32 = True
        with tf32_off():
            assert [flag.allow_tf32 for flag in flags] == [False, False]
        assert [flag.allow_tf32 for flag in flags] == [True, True]
    finally:
        for flag, value in zip(flags, before, strict=True):
            flag.allow_tf32 = value
