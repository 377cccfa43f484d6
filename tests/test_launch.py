"""torchrun's launch as the trainer meets it: the world each process reads from torchrun's variables,
the launches it refuses, and two machines (nodes) of one process each, played by two torchrun agents
on this host, which train exactly as one machine of two processes. The refusals that end train.py in
one line are in the catalogue (tests/test_bad_inputs.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from errors import UserError
from tests.conftest import PROJECT_ROOT, tiny_toml
from trainer.distributed import World
from trainer.run_dir import resume_command

ENV = os.environ | {"PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
# dropout on, so that a resumed run matches only if every process's random state is restored; a
# checkpoint every 5 steps, and far more steps than the seconds before a node is killed can run
RUN_ARGS = [
    "--train.gradient_accumulation_steps=2",
    "--model.dropout=0.1",
    "--train.max_iters=60",
    "--train.eval_interval=5",
    "--train.eval_iters=1",
]
WAIT_SECONDS = 300  # for anything a run does; far more than it takes, even on a busy machine


def test_the_world_is_read_from_torchruns_variables(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert World.from_env() == World()
    # the fourth process of two machines of two: rank 3, the second on its machine
    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    world = World.from_env()
    assert world == World(rank=3, local_rank=1, size=4, launched=True, local_size=2)
    assert world.nodes == 2 and not world.is_main


def test_a_local_rank_beyond_the_machines_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    world = World(rank=2, local_rank=2, size=3, launched=True, local_size=3)
    with pytest.raises(UserError, match=r"LOCAL_RANK=2 but this machine has 2 CUDA GPU\(s\), 0 \.\. 1"):
        world.device("auto")


def test_a_run_on_several_machines_is_continued_on_as_many():
    run_dir = Path("out/run")
    one_machine = World(rank=0, size=2, launched=True, local_size=2)
    assert resume_command(run_dir, one_machine).startswith("torchrun --standalone --nproc_per_node=2 train.py")
    two_machines = World(rank=0, size=16, launched=True, local_size=8)
    assert resume_command(run_dir, two_machines) == (
        "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT train.py "
        "--config out/run/config.toml --train.init_from=resume"
    )


def free_port() -> int:
    """A port no one listens on now: the system's choice for a socket bound to port 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_node(cwd: Path, port: int, *args: str, nnodes: int = 2, join_timeout: int = 120) -> subprocess.Popen:
    """A torchrun agent of one process, as one of `nnodes` machines meeting at 127.0.0.1:port, running
    train.py in cwd; its output goes to cwd/../NAME.out and .err, NAME being cwd's name. A rendezvous
    that does not complete ends after join_timeout seconds."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=test-{port}",
        f"--rdzv-conf=join_timeout={join_timeout}", str(PROJECT_ROOT / "train.py"), *args,
    ]  # fmt: skip
    out, err = (open(cwd.parent / f"{cwd.name}.{kind}", "w") for kind in ("out", "err"))
    with out, err:
        return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=out, stderr=err)


def start_one_node_of_two(cwd: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(PROJECT_ROOT / "train.py"), *args]
    out, err = (open(cwd.parent / f"{cwd.name}.{kind}", "w") for kind in ("out", "err"))
    with out, err:
        return subprocess.Popen(command, cwd=cwd, env=ENV, stdout=out, stderr=err)


def finish(*agents: subprocess.Popen) -> list[int]:
    return [agent.wait(timeout=WAIT_SECONDS) for agent in agents]


def kill_node(agent: subprocess.Popen) -> None:
    """Kill a machine as a power cut would: its torchrun agent and the processes it started (each in a
    session of its own, out of reach of a signal to the agent's process group), all with SIGKILL."""
    workers = [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and parent_of(int(pid)) == agent.pid]
    for pid in [*workers, agent.pid]:
        os.kill(pid, signal.SIGKILL)
    agent.wait()


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # a process that has ended since the listing
        return None
    return int(stat.rpartition(")")[2].split()[1])  # after the name, which may hold spaces: state, then ppid


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(run_dir: Path) -> dict[tuple[int, str], float]:
    """Every train and val loss the run logged, by step and kind."""
    return {(r["step"], kind): r[kind] for r in records(run_dir) for kind in ("loss", "val_loss") if kind in r}


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_processes_and_resume_after_a_node_dies(data_dir, tmp_path):
    """Two agents of one process each, on machines that share no disk (working directories of their
    own, the run directory relative to them), log the same losses as one agent of two processes, and
    only global rank 0 writes. One machine dies after a checkpoint: the other ends, and the run resumed
    on two machines (sharing a disk now, as resuming needs) ends with the uninterrupted run's losses."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(Path("run"), data_dir))
    machines = {name: tmp_path / name for name in ("single", "a", "b")}
    for path in machines.values():
        path.mkdir()
    reference = start_one_node_of_two(machines["single"], "--config", str(config), *RUN_ARGS)
    assert finish(reference) == [0], (tmp_path / "single.err").read_text()
    uninterrupted = losses(machines["single"] / "run")

    port = free_port()
    agents = {name: start_node(machines[name], port, "--config", str(config), *RUN_ARGS) for name in ("a", "b")}
    deadline = time.monotonic() + WAIT_SECONDS
    while not any(step >= 7 for path in ("a", "b") for step, _ in losses(machines[path] / "run")):
        assert all(agent.poll() is None for agent in agents.values()), "a node ended before step 7"
        assert time.monotonic() < deadline, f"no step 7 within {WAIT_SECONDS} s"
        time.sleep(0.05)
    writer = "a" if (machines["a"] / "run").exists() else "b"
    other = "b" if writer == "a" else "a"
    kill_node(agents[other])
    killed_at = time.monotonic()
    assert agents[writer].wait(timeout=WAIT_SECONDS) != 0  # the survivor's next collective fails: it ends
    assert time.monotonic() - killed_at < WAIT_SECONDS
    assert not any(machines[other].iterdir()), "a process other than global rank 0 wrote to its machine's disk"
    run_dir = machines[writer] / "run"
    assert {path.name for path in run_dir.iterdir()} - {"train.lock"} == {"ckpt.pt", "config.toml", "metrics.jsonl"}
    before_kill = losses(run_dir)
    assert before_kill == {key: uninterrupted[key] for key in before_kill}
    assert (tmp_path / f"{writer}.out").read_text().count("starting:") == 1
    assert "starting:" not in (tmp_path / f"{other}.out").read_text()

    port = free_port()
    resume = ["--config", str(run_dir / "config.toml"), "--train.init_from=resume"]
    agents = [start_node(machines[writer], port, *resume) for _ in range(2)]
    assert finish(*agents) == [0, 0], (tmp_path / f"{writer}.err").read_text()
    assert losses(run_dir) == uninterrupted


@pytest.mark.slow
def test_a_node_that_fails_before_joining_ends_the_other_in_one_line(data_dir, tmp_path):
    """Machine b's trainer refuses its config before it joins; machine a's waits for it no longer than
    train.join_timeout, then says what to check in one line (before, it waited gloo's 30 minutes)."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(Path("run"), data_dir))
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    port = free_port()
    args = ["--config", str(config), *RUN_ARGS, "--train.join_timeout=10"]
    started = time.monotonic()
    first = start_node(tmp_path / "a", port, *args)
    wait_for_listener(port, first)  # a's agent holds the rendezvous, which outlives b
    second = start_node(tmp_path / "b", port, *args, "--model.n_head=3")
    assert finish(first, second) == [1, 1]  # torchrun's status for a process that failed
    assert time.monotonic() - started < 10 + WAIT_SECONDS
    refusals = [line for line in (tmp_path / "b.err").read_text().splitlines() if line.startswith("error: ")]
    assert len(refusals) == 1 and "model.n_embd=32 is not divisible by n_head=3" in refusals[0]
    lines = [line for line in (tmp_path / "a.err").read_text().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "did not all join within train.join_timeout=10 s" in lines[0], lines
    assert "Traceback" not in (tmp_path / "a.err").read_text().partition(lines[0])[0]  # the trainer's own: one line


def wait_for_listener(port: int, agent: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert agent.poll() is None and time.monotonic() < deadline, f"nothing listens on port {port}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_node_that_never_arrives_ends_the_launch_at_torchruns_join_timeout(data_dir, tmp_path):
    """torchrun itself waits for --nnodes agents before it starts any trainer: the documented
    --rdzv-conf=join_timeout bounds that wait (its default is 600 s)."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(Path("run"), data_dir))
    (tmp_path / "a").mkdir()
    started = time.monotonic()
    alone = start_node(tmp_path / "a", free_port(), "--config", str(config), *RUN_ARGS, join_timeout=5)
    assert finish(alone) == [1]
    assert time.monotonic() - started < 5 + WAIT_SECONDS
    assert (tmp_path / "a.err").read_text().strip().endswith("RendezvousTimeoutError")
    assert not any((tmp_path / "a").iterdir())  # no trainer started
