"""The CUDA path checked and measured in one command: the tests that need a GPU, the baby GPTs'
runs, GPT-2 124M's MFU, FlexAttention's windows, compiled decoding and torchrun, each part in a
process of its own with a time limit, the report rewritten after each.

    python bench/gpu.py --out gpu-report                          # a CUDA GPU: 20 minutes at most
    python bench/gpu.py --out gpu-report --parts gpt2_124m flex   # some parts only, in this order
    python bench/gpu.py --out gpu-report --budget-scale 2         # a slower GPU: twice the time limits
    python bench/gpu.py --out smoke-report --smoke                # every part at toy sizes on a CPU

--out receives three files, and only these: report.md (a table: figure, value, goal, command),
report.json (the same, with each part's status, time and last 40 lines of output) and log.txt (all
the parts' output). A folder that already holds any of those names is refused, unless it holds an
earlier report (its report.json), whose files are replaced. Runs, checkpoints and prepared data go
to a temporary folder (SCRATCH in the commands shown), removed at the end. A part that fails or
runs out of time leaves the figures it had recorded, and the next part starts. Nothing here needs
the network or the packages a bare CUDA image may lack (`datasets`, `wandb`, `gguf`, `lm-eval`,
`peft`): the datasets used ship with the project. The tests run in parallel processes where
pytest-xdist is installed; the baby GPTs' runs stop once their val loss has reached nanoGPT's.

--smoke runs every part at toy sizes on the CPU, so the script cannot rot without a GPU to run it
on: what a CPU cannot run (NCCL, CUDA graphs, FlexAttention's backward pass) is reported as skipped,
with the reason, and what stands in for it (gloo, the uncompiled sampler, SDPA's dense mask) is run.
"""

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.arguments import BenchArguments, write_json  # noqa: E402
from data.files import atomic_open, check_output_file, is_json_object_with  # noqa: E402
from errors import UserError, run_cli  # noqa: E402

TARGET_VAL_LOSS = 1.4697  # nanoGPT's baby GPT on character-level Shakespeare, about 3 minutes on an A100
REPORT_FILES = ("report.md", "report.json", "log.txt")  # all that --out receives
REPORT_KEYS = ("started", "command", "smoke", "parts")  # what report.json holds
OUTPUT_TAIL_LINES = 40  # of each part's output, kept in report.json (a traceback, the last progress lines)
GRACE_SECONDS = 10  # after its time limit, a part (or a command) gets SIGTERM, then this long before SIGKILL
TEST_WORKERS = 6  # pytest-xdist's processes for the GPU tests, at most (and at most half the CPUs)

# Toy sizes for --smoke: a model and a run that take seconds on a CPU
TOY_MODEL = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32"]
TOY_RUN = [
    *TOY_MODEL,
    "--data.batch_size=4",
    "--train.device=cpu",
    "--train.dtype=float32",
    "--train.compile=false",
    "--train.eval_iters=1",
]


@dataclass
class Part:
    """What one part of the report measures, in a process of its own, within budget seconds."""

    name: str
    budget: int  # seconds on an H100, the compilations included
    summary: str
    measure: Callable[["PartRun"], None] = field(repr=False)


@dataclass
class PartRun:
    """One part as it runs: the figures it has recorded, each written at once to result_path."""

    smoke: bool
    scratch: Path
    result_path: Path
    deadline: float  # time.monotonic() by which the part must be done
    figures: list[dict] = field(default_factory=list)

    def record(self, figure: str, value: str, goal: str = "", command: str = "") -> None:
        self.figures.append(dict(figure=figure, value=value, goal=goal, command=command))
        write_json(self.result_path, self.figures)  # whole or not at all: the parent, reading after a kill, sees a list

    def skip(self, figure: str, reason: str, goal: str = "") -> None:
        self.record(figure, f"skipped: {reason}", goal)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def run_for_json(self, argv: list[str], result: Path, figure: str) -> dict | None:
        """Run a benchmark that writes its figures to result as JSON, and return them; or record
        figure as having no result (the command failed or ran out of time) and return None."""
        status, seconds = self.run(argv)
        if status == 0 and result.exists():
            return json.loads(result.read_text())
        self.record(figure, f"no result ({failed(status, seconds)})", "", self.shown(argv))
        return None

    def shown(self, argv: list[str]) -> str:
        """A command as the report shows it: python for this interpreter, SCRATCH for the scratch folder."""
        words = ["python" if word == sys.executable else word for word in argv]
        return shlex.join(words).replace(str(self.scratch), "SCRATCH")

    def start(self, argv: list[str]) -> subprocess.Popen:
        """Start a command from the project's root, its output going to the log."""
        print(f"\n$ {self.shown(argv)}", flush=True)
        # toy sizes run on one thread: a busy CPU's threads would spend the time waiting for each other
        env = os.environ | {"OMP_NUM_THREADS": "1"} if self.smoke else None
        return subprocess.Popen(argv, cwd=ROOT, env=env)

    def run(
        self, argv: list[str], stop: signal.Signals = signal.SIGTERM, group: bool = False
    ) -> tuple[int | None, float]:
        """Run a command until it ends or the part's deadline comes, less a margin for what follows,
        then stop it with the signal stop (with group, it and every process it started: see
        wait_or_stop). Returns its exit status (None when it was stopped at the deadline) and its
        seconds."""
        start = time.monotonic()
        status = wait_or_stop(self.start(argv), max(self.remaining() - GRACE_SECONDS, 1), stop=stop, group=group)
        return status, time.monotonic() - start

    def run_until(self, argv: list[str], done: Callable[[], bool]) -> tuple[int | None, float, bool]:
        """As run, but also stopped (SIGTERM) as soon as done() holds, checked twice a second.
        Returns its exit status, its seconds, and whether done() stopped it."""
        start = time.monotonic()
        process = self.start(argv)
        try:
            while process.poll() is None and time.monotonic() < self.deadline - GRACE_SECONDS:
                if done():
                    return wait_or_stop(process, 0), time.monotonic() - start, True
                time.sleep(0.5)
            return wait_or_stop(process, max(self.remaining() - GRACE_SECONDS, 1)), time.monotonic() - start, False
        finally:  # done() may raise: the command must not outlive the part, holding the GPU
            if process.poll() is None:
                wait_or_stop(process, 0)


def wait_or_stop(
    process: subprocess.Popen,
    limit: float,
    grace: float = GRACE_SECONDS,
    stop: signal.Signals = signal.SIGTERM,
    group: bool = False,
) -> int | None:
    """Wait for a process for limit seconds; past that, send it stop (SIGTERM: train.py checkpoints
    and stops, torchrun stops its workers; SIGINT: pytest reports the tests it ran), then SIGKILL
    after grace seconds. Returns its exit status, or None if it was stopped.

    group: stop goes to every process of this one's group but this one (the process and all it
    started), as Ctrl-C in a terminal does, where this process leads its group (a part does). Sent
    to pytest-xdist's controller alone, SIGINT waits for each worker to finish its test, which can
    outlast the grace (a compilation): the report is then lost."""
    try:
        return process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        if group and os.getpgid(0) == os.getpid():
            ignored = signal.signal(stop, signal.SIG_IGN)  # discarded here when sent, so restored at once
            try:
                os.killpg(0, stop)
            finally:
                signal.signal(stop, ignored)
        else:
            process.send_signal(stop)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return None


def failed(status: int | None, seconds: float) -> str:
    return f"stopped at its time limit after {seconds:.0f} s" if status is None else f"exit status {status}"


# ---------------------------------------------------------------------------------------------- parts


def environment(run: PartRun) -> None:
    import torch

    from trainer.metrics import gpu_peak_flops

    run.record("Python", platform.python_version())
    run.record("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    if not torch.cuda.is_available():
        run.skip("GPU", "no CUDA GPU on this machine", goal="H100 or H200")
        return
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    run.record("GPU", torch.cuda.get_device_name(device), goal="H100 or H200")
    run.record("GPU memory", f"{properties.total_memory / 2**30:.1f} GiB")
    run.record("compute capability", ".".join(map(str, torch.cuda.get_device_capability(device))))
    run.record("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
    peak = gpu_peak_flops(device)
    value = f"{peak:.3g}" if peak else "unknown: no MFU is reported (add the GPU to PEAK_FLOPS in trainer/metrics.py)"
    run.record("peak bf16 FLOP/s (what MFU divides by)", value, goal="dense tensor-core peak of the datasheet")


def gpu_tests(run: PartRun) -> None:
    junit = run.scratch / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if importlib.util.find_spec("xdist") is not None:  # most of the time is compilation: spread it over the CPUs
        argv += ["-n", str(max(1, min(TEST_WORKERS, (os.cpu_count() or 1) // 2)))]
    argv += [f"--basetemp={run.scratch / 'pytest'}"]  # not /tmp/pytest-of-USER, which pytest prunes to 3 runs
    status, seconds = run.run(argv, stop=signal.SIGINT, group=True)  # pytest's Ctrl-C still writes the report
    if not junit.exists():
        run.record("pytest -m gpu", f"no result ({failed(status, seconds)})", "all pass", run.shown(argv))
        return
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    value = f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    if status is None:
        value += ", then stopped at the time limit (the other tests did not run)"
    run.record("pytest -m gpu", f"{value} in {seconds:.0f} s", "all pass, none skipped (on a GPU)", run.shown(argv))
    broken = [
        f"{case.get('classname')}.{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    if broken:
        run.record("pytest -m gpu: failed", ", ".join(broken), "none", run.shown(argv))


def baby_gpt(run: PartRun, config: str) -> None:
    """A train.py run of config: wall time, speed, and when its val loss reaches nanoGPT's, where
    the run stops (the evaluations after it show the small dataset overfitting, nothing more)."""
    from trainer.metrics import read_metrics

    def records() -> list[dict]:
        return read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []

    def reached_target() -> bool:
        return any(r.get("val_loss", math.inf) <= TARGET_VAL_LOSS for r in records())

    name = Path(config).stem
    run_dir = run.scratch / name
    argv = [sys.executable, "train.py", "--config", config, f"--train.out_dir={run_dir}"]
    argv += [f"--data.data_dir={run.scratch / 'data'}"]
    if run.smoke:
        argv += [*TOY_RUN, "--train.max_iters=4", "--train.eval_interval=2", "--train.log_interval=1"]
        argv += ["--optim.warmup_iters=1"]  # the config's warmup is longer than 4 steps
    started = time.time()
    status, seconds, stopped = run.run_until(argv, reached_target)
    command = run.shown(argv)
    recorded = records()
    steps = [r for r in recorded if "loss" in r]
    evaluations = [r for r in recorded if "val_loss" in r]
    last_step = steps[-1]["step"] if steps else 0
    ended = "" if status == 0 else f" ({failed(status, seconds)})"
    if stopped:
        ended = f" (stopped once its val loss reached {TARGET_VAL_LOSS})"
    run.record(f"{name}: wall time", f"{seconds:.0f} s for {last_step} steps{ended}", "", command)
    if steps:
        tokens_per_sec = statistics.median(r["tokens_per_sec"] for r in steps)
        run.record(f"{name}: tokens/s", f"{tokens_per_sec:,.0f} (median of {len(steps)} logged steps)", "", command)
        mfus = [r["mfu"] for r in steps if "mfu" in r]
        if mfus:
            run.record(f"{name}: MFU", f"{100 * statistics.median(mfus):.1f}% (median)", "", command)
    if evaluations:
        best = min(evaluations, key=lambda r: r["val_loss"])
        run.record(f"{name}: val loss", f"{evaluations[-1]['val_loss']:.4f} at step {evaluations[-1]['step']}, "
                   f"best {best['val_loss']:.4f} at step {best['step']}", "", command)  # fmt: skip
        reached = [r for r in evaluations if r["val_loss"] <= TARGET_VAL_LOSS]
        value = "not reached"
        if reached:
            value = f"step {reached[0]['step']}, {reached[0]['time'] - started:.0f} s after train.py started"
        goal = "nanoGPT: about 3 min on an A100"
        run.record(f"{name}: first val loss <= {TARGET_VAL_LOSS}", value, goal, command)


def gpt2_124m(run: PartRun) -> None:
    result = run.scratch / "gpt2_124m.json"
    argv = [sys.executable, "bench/train.py", "--config", "configs/gpt2_124m_owt.toml", "--data.dataset=shakespeare"]
    argv += [f"--data.data_dir={run.scratch / 'data'}", "--train.gradient_accumulation_steps=1", f"--json={result}"]
    if run.smoke:
        argv += [*TOY_RUN, "--steps=2", "--warmup=1", "--batch-sizes", "4", "2"]
    else:
        argv += ["--train.dtype=bfloat16", "--train.compile=true", "--train.eval_iters=10", "--steps=30"]
        argv += ["--warmup=5", "--batch-sizes", "128", "96", "64", "48", "32", "24", "16", "8"]
        argv += ["--profile=25"]  # what a step is made of, in log.txt: the kernels that hold MFU back
    command = run.shown(argv)
    speed = run.run_for_json(argv, result, "GPT-2 124M: tokens/s")
    if speed is None:
        return
    shape = f"T={speed['block_size']}, {speed['dtype']}, {'compiled' if speed['compile'] else 'eager'}"
    run.record(f"GPT-2 124M ({shape}): largest micro-batch", str(speed["batch_size"]), "", command)
    run.record("GPT-2 124M: tokens/s", f"{speed['tokens_per_sec']:,.0f}", "", command)
    mfu = "n/a (no known peak)" if speed["mfu"] is None else f"{100 * speed['mfu']:.1f}%"
    run.record("GPT-2 124M: MFU", mfu, ">= 55% on an H100 (nanoGPT: about 37% on an A100)", command)
    if speed["peak_memory_gib"] is not None:
        run.record("GPT-2 124M: peak memory", f"{speed['peak_memory_gib']:.1f} GiB", "", command)


def flex(run: PartRun) -> None:
    result = run.scratch / "attention.json"
    argv = [sys.executable, "bench/attention.py", f"--json={result}"]
    if run.smoke:
        argv += ["--block-size=64", "--n-layer=1", "--n-head=2", "--n-embd=32", "--vocab-size=64", "--batch-size=2"]
        argv += ["--document-length=16", "--steps=1", "--warmup=1"]
        run.skip("FlexAttention", "no CUDA (no FlexAttention backward on a CPU): SDPA's dense mask is timed instead")
    else:
        argv += ["--device=cuda", "--dtype=bfloat16", "--block-size=4096", "--n-layer=12", "--n-head=12"]
        argv += ["--n-embd=768", "--batch-size=4", "--steps=10", "--warmup=3"]
    command = run.shown(argv)
    tables = run.run_for_json(argv, result, "attention patterns")
    if tables is None:
        return
    for table, what in (("attention", "attention alone, forward and backward"), ("step", "training step")):
        for row in tables[table][1:]:
            goal = ""
            if table == "attention" and row["tiles_vs_causal"] is not None:  # what skipping tiles allows
                goal = f"near {row['tiles_vs_causal']:.2f}x, causal's tiles of scores over the block mask's"
            value = f"{row['vs_causal']:.2f}x causal ({1000 * row['seconds']:.2f} ms; {row['path']})"
            run.record(f"{row['pattern']} vs causal, {what}", value, goal, command)


def decode(run: PartRun) -> None:
    result = run.scratch / "decode.json"
    # no llama.cpp rows: the part measures the GPU against transformers (and the image has no gguf)
    argv = [sys.executable, "bench/decode.py", "--batch-sizes=1", "--gguf-types", f"--json={result}"]
    if run.smoke:
        argv += ["--small", "--new-tokens=4", "--no-compile"]
        run.skip("compiled static cache (CUDA graphs)", "no CUDA: CUDA graphs need a GPU", ">= 5,000 tokens/s")
    else:
        argv += ["--device=cuda", "--dtype=bfloat16", "--new-tokens=512", "--repeats=2"]
    command = run.shown(argv)
    status, seconds = run.run(argv)
    rows = json.loads(result.read_text())["rows"] if result.exists() else []  # rewritten after each row
    if status != 0:
        run.record("decoding", f"{len(rows)} rows timed, then {failed(status, seconds)}", "", command)
    if not rows:
        return
    reference = next(r for r in rows if r["implementation"].startswith("transformers"))
    for row in rows:
        if row["implementation"] == "matrix products only (floor)":
            continue
        name = f"{row['implementation']}, {row['products']}"
        compiled = row["implementation"] == "ours, compiled step"
        speed = row["tokens_per_sec"] / reference["tokens_per_sec"]  # medians of the rounds
        value = f"{row['tokens_per_sec']:,.0f} tokens/s ({speed:.2f}x transformers)"
        if row.get("tokens_per_sec_after_first"):  # the one-token steps alone, the prompt's encoding left out
            value += f", {row['tokens_per_sec_after_first']:,.0f} after the first token"
        if compiled:  # its first call compiles: sample.py --compile's wait before the first token
            value += f"; first call {row['first_call_seconds']:.0f} s"
        goal = ">= 5,000 tokens/s on an H100" if compiled else ""
        run.record(f"decoding batch 1: {name}", value, goal, command)


def torchrun(run: PartRun) -> None:
    """A kill and resume under torchrun (first: what matters most if time runs out), then DDP and
    FSDP2 under torchrun against a plain run."""
    import torch

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        run.skip("NCCL", "no CUDA: the process group uses gloo instead")
    config = "configs/shakespeare_char_gpu.toml"
    common = [f"--data.data_dir={run.scratch / 'data'}"]
    common += TOY_RUN if run.smoke else ["--train.eval_iters=20"]
    # torchrun's agent checks on its workers every 5 s by default: each launch would end up to 5 s late
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "--monitor-interval=0.1",
    ]
    kill_and_resume(run, launch, config, common)
    step_seconds = {}
    for parallelism in ("single", "ddp", "fsdp"):
        result = run.scratch / f"step-{parallelism}.json"
        argv = ["bench/train.py", "--config", config, *common, f"--json={result}"]
        argv += ["--steps=2", "--warmup=1"] if run.smoke else ["--steps=30", "--warmup=5"]
        if parallelism == "single":
            argv = [sys.executable, *argv]
        else:
            argv = [*launch, *argv, f"--train.parallelism={parallelism}"]
        name = {"single": "plain run", "ddp": f"DDP ({backend})", "fsdp": f"FSDP2 ({backend})"}[parallelism]
        speed = run.run_for_json(argv, result, f"baby GPT step, {name}")
        if speed is None:
            continue
        step_seconds[parallelism] = speed["step_seconds"]
        value = f"{1000 * step_seconds[parallelism]:.1f} ms"
        if parallelism != "single" and "single" in step_seconds:
            single = step_seconds["single"]
            extra = step_seconds[parallelism] - single  # the wrapper's own work in each step
            value += f" ({step_seconds[parallelism] / single:.2f}x the plain run's, {1000 * extra:+.1f} ms)"
        goal = "" if parallelism == "single" else "about 1.00x (one process: nothing to exchange)"
        run.record(f"baby GPT step, {name}", value, goal, run.shown(argv))


def kill_and_resume(run: PartRun, launch: list[str], config: str, common: list[str]) -> None:
    """An FSDP2 run under torchrun, killed (SIGKILL to the training process) after a checkpoint and
    resumed, against the same run uninterrupted: every logged loss must be equal, bit for bit."""
    from trainer.metrics import read_metrics

    steps, every, kill_after = (8, 2, 5) if run.smoke else (200, 50, 60)
    schedule = [f"--train.max_iters={steps}", f"--train.eval_interval={every}", "--train.log_interval=1"]
    if run.smoke:
        schedule += ["--optim.warmup_iters=1"]  # the config's warmup is longer than the smoke run
    else:  # uncompiled: three starts of a compilation would not fit the budget
        schedule += ["--train.eval_iters=5", "--train.compile=false"]

    def argv(run_dir: Path, *more: str) -> list[str]:
        train = ["train.py", "--config", config, *common, *schedule, "--train.parallelism=fsdp"]
        return [*launch, *train, f"--train.out_dir={run_dir}", *more]

    def losses(run_dir: Path) -> dict[int, float]:
        path = run_dir / "metrics.jsonl"
        return {r["step"]: r["loss"] for r in read_metrics(path) if "loss" in r} if path.exists() else {}

    figure, goal = "kill and resume (FSDP2, torchrun)", "every loss equal, bit for bit"
    reference = run.scratch / "resume-reference"
    status, seconds = run.run(argv(reference))
    if status != 0:
        value = f"the uninterrupted run failed ({failed(status, seconds)})"
        run.record(figure, value, goal, run.shown(argv(reference)))
        return
    killed = run.scratch / "resume-killed"
    process = run.start(argv(killed))  # killed after step kill_after
    killed_at = kill_after_step(process, killed, kill_after, losses, run.remaining() - 60)
    command = f"{run.shown(argv(killed))}; then again with --train.init_from=resume"
    if killed_at is None:
        run.record(figure, f"the run ended or hung before step {kill_after}, not killed", goal, command)
        return
    status, seconds = run.run(argv(killed, "--train.init_from=resume"))
    expected, got = losses(reference), losses(killed)
    before = [step for step in got if step <= killed_at]
    if any(got[step] != expected.get(step) for step in before):
        value = "inconclusive: the losses differ before the kill (the run itself is not deterministic here)"
    elif got == expected:
        value = f"bit for bit at all {len(expected)} steps (killed after step {killed_at})"
    else:
        differing = [step for step in expected if got.get(step) != expected[step]]
        value = f"differ from step {differing[0]} on ({len(differing)} steps; killed after step {killed_at}, " + (
            f"resumed run {failed(status, seconds)})" if status != 0 else "resumed run ended normally)"
        )
    run.record(figure, value, goal, command)


def kill_after_step(process: subprocess.Popen, run_dir: Path, step: int, losses, limit: float) -> int | None:
    """Wait until the run has logged step (or later), then SIGKILL its training process, as a
    machine failure would; returns the last step it logged, or None if it ended or hung first."""
    deadline = time.monotonic() + limit
    lock = run_dir / "train.lock"  # "pid N on HOST": the training process (torchrun's worker), not torchrun
    while time.monotonic() < deadline and process.poll() is None:
        if max(losses(run_dir), default=0) >= step and lock.exists():
            os.kill(int(lock.read_text().split()[1]), signal.SIGKILL)
            process.wait()  # torchrun sees its worker die and exits
            return max(losses(run_dir))
        time.sleep(0.02)
    wait_or_stop(process, 0)
    return None


PARTS = [
    Part("environment", 20, "GPU, memory, torch and CUDA versions, the peak FLOP/s of MFU", environment),
    Part("tests", 240, "pytest -m gpu: every test that needs CUDA", gpu_tests),
    Part(
        "baby_gpt",
        150,
        "configs/shakespeare_char_gpu.toml, until its val loss reaches nanoGPT's",
        functools.partial(baby_gpt, config="configs/shakespeare_char_gpu.toml"),
    ),  # fmt: skip
    Part(
        "baby_gpt_modern",
        150,
        "configs/shakespeare_char_gpu_modern.toml, until its val loss reaches nanoGPT's",
        functools.partial(baby_gpt, config="configs/shakespeare_char_gpu_modern.toml"),
    ),  # fmt: skip
    Part("gpt2_124m", 150, "GPT-2 124M, T=1024, bf16, compiled, the largest micro-batch that fits", gpt2_124m),
    Part("flex", 100, "a window of 512 and documents against causal at T=4096", flex),
    Part("decode", 150, "batch-1 decoding of the 124M shape against transformers", decode),
    Part("torchrun", 240, "kill and resume under torchrun; DDP and FSDP2 against a plain run", torchrun),
]


# ---------------------------------------------------------------------------------------------- report


def run_part(name: str, budget: float, scratch: Path, smoke: bool, log, grace: float = GRACE_SECONDS) -> dict:
    """Run one part in a process of its own, stopped with all it started past budget + grace
    seconds (the part stops its own commands within budget); its figures and status."""
    result_path = scratch / f"{name}.figures.json"
    argv = [sys.executable, __file__, "--part", name, "--budget", str(budget), "--scratch", str(scratch)]
    argv += ["--result", str(result_path), *(["--smoke"] if smoke else [])]
    log.write(f"\n===== {name} (budget {budget:.0f} s) =====\n")
    log.flush()
    offset = log.tell()  # where this part's output starts in the log
    start = time.monotonic()
    process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        status = process.wait(timeout=budget + grace)
    except subprocess.TimeoutExpired:  # the part's own limits failed: stop it and everything it started
        stop_group(process, grace)
        status = None
    try:  # what the part left running (a command it failed to stop) would hold the GPU in the next parts
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    seconds = time.monotonic() - start
    figures = json.loads(result_path.read_text()) if result_path.exists() else []
    state = "ok" if status == 0 else failed(status, seconds)
    with open(log.name, "rb") as output:
        output.seek(offset)
        tail = output.read().decode("utf-8", errors="replace").splitlines()[-OUTPUT_TAIL_LINES:]
    return dict(part=name, budget=budget, seconds=seconds, status=state, figures=figures, output_tail=tail)


def stop_group(process: subprocess.Popen, grace: float) -> None:
    """SIGTERM to the process's group, SIGKILL after grace seconds. (torchrun's workers have a
    session of their own: torchrun stops them on its SIGTERM.)"""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def check_report_folder(out: Path) -> None:
    """--out receives REPORT_FILES: each may replace only a file of an earlier report (the folder holds
    the report.json of one), never another file (data/files.py's rule for every output)."""
    earlier_report = lambda _: is_json_object_with(out / "report.json", REPORT_KEYS)  # noqa: E731
    for name in REPORT_FILES:
        check_output_file(out / name, "--out", earlier_report, "a file of an earlier report of bench/gpu.py")


def write_report(out: Path, report: dict) -> None:
    write_json(out / "report.json", report)
    lines = [
        f"# CUDA path report{' (smoke: toy sizes on a CPU)' if report['smoke'] else ''}",
        "",
        f"Started {report['started']}; `{report['command']}`. SCRATCH is a temporary folder.",
        "",
        "| part | status | seconds (budget) |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| {p['part']} | {p['status']} | {p['seconds']:.0f} ({p['budget']:.0f}) |" for p in report["parts"]]
    lines += ["", "| figure | value | goal | command |", "| --- | --- | --- | --- |"]
    for part in report["parts"]:
        for f in part["figures"]:
            command = f"`{f['command']}`" if f["command"] else ""
            lines.append(f"| {f['figure']} | {f['value']} | {f['goal']} | {command} |".replace("\n", " "))
    with atomic_open(out / "report.md") as f:
        f.write(("\n".join(lines) + "\n").encode("utf-8"))


def parts_in_order(names: list[str]) -> list[Part]:
    """The parts named, in the order given (the first are those that matter most if time runs out),
    each once."""
    by_name = {part.name: part for part in PARTS}
    return [by_name[name] for name in dict.fromkeys(names)]


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--out", type=Path, help="folder for report.md, report.json and log.txt")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: checks the script in minutes")
    names = [part.name for part in PARTS]
    parts_help = "parts to run, in this order (default: all): " + "; ".join(
        f"{p.name} ({p.budget} s): {p.summary}" for p in PARTS
    )
    parser.add_argument("--parts", nargs="+", choices=names, default=names, metavar="PART", help=parts_help)
    parser.add_amount("--budget-scale", default=1.0, metavar="F", help="multiply every part's time limit (default: 1)")
    parser.add_argument("--part", choices=names, help=argparse.SUPPRESS)  # the process that runs one part
    parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        # a shell that starts a job in the background ignores SIGINT in it, and so would its children:
        # pytest, stopped at its time limit by SIGINT, would not write its report
        signal.signal(signal.SIGINT, signal.default_int_handler)
        part = next(p for p in PARTS if p.name == args.part)
        part.measure(PartRun(args.smoke, args.scratch, args.result, time.monotonic() + args.budget))
        return
    if args.out is None:
        raise UserError("--out is required: the folder that receives report.md, report.json and log.txt")
    check_report_folder(args.out)
    if not args.smoke:
        import torch  # not before: each part has its own process, and a smoke run its own minute

        if not torch.cuda.is_available():
            raise UserError("this machine has no usable CUDA GPU (use --smoke to check the script on a CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    selected = parts_in_order(args.parts)
    command = shlex.join(["python", "bench/gpu.py", *sys.argv[1:]])
    report = dict(started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command=command, smoke=args.smoke, parts=[])
    scratch = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    total = sum(part.budget for part in selected) * args.budget_scale
    print(f"{len(selected)} parts, at most {total / 60:.0f} min; report in {args.out}/report.md")
    try:
        with open(args.out / "log.txt", "w") as log:
            for part in selected:
                budget = part.budget * args.budget_scale
                print(f"{part.name} (at most {budget:.0f} s) ...", end=" ", flush=True)
                result = run_part(part.name, budget, scratch, args.smoke, log)
                report["parts"].append(result | {"summary": part.summary})
                write_report(args.out, report)
                print(f"{report['parts'][-1]['status']}, {report['parts'][-1]['seconds']:.0f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for part in report["parts"]:
        for figure in part["figures"]:
            print(f"{part['part']}: {figure['figure']}: {figure['value']}")


if __name__ == "__main__":
    run_cli(main)
