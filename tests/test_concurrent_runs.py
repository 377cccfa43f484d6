"""Runs cannot collide: one writer per run directory, and runs that start together share the
preparation of a bundled dataset. Real processes, as users start them."""

import socket
import subprocess
import sys

import pytest

from tests.conftest import PROJECT_ROOT, run_entry_point, tiny_toml
from tests.test_fault_tolerance import start_training, wait_for_step
from trainer.checkpoint import load_checkpoint


@pytest.mark.slow
def test_a_second_run_in_a_directory_in_use_is_refused_naming_the_first(tmp_path, data_dir, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(run_dir, data_dir))
    first = start_training(config, "--train.max_iters=100000")
    wait_for_step(first, run_dir, 6)  # past the checkpoint of step 5
    # the second run is this test's own process: faster to start than a third interpreter
    for args in ([], ["--train.init_from=resume"]):
        assert run_entry_point("train.py", ["--config", str(config), *args], monkeypatch) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: train.out_dir='{run_dir}' is in use by another training (pid {first.pid} on "
            f"{socket.gethostname()}): wait for it to end or stop it, or choose another --train.out_dir"
        ]
    first.kill()  # no release: the operating system drops the lock with the process
    first.communicate()
    assert (run_dir / "train.lock").exists()
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    resume = ["--config", str(run_dir / "config.toml"), "--train.init_from=resume", f"--train.max_iters={step + 1}"]
    assert run_entry_point("train.py", resume, monkeypatch) == 0
    assert load_checkpoint(run_dir / "ckpt.pt")["step"] == step + 1
    assert not (run_dir / "train.lock").exists()


@pytest.mark.slow
def test_two_first_runs_prepare_the_bundled_dataset_once_and_both_train(tmp_path):
    runs = []
    for name in ("a", "b"):
        config = tmp_path / f"{name}.toml"
        config.write_text(tiny_toml(tmp_path / name, tmp_path / "data"))
        command = [sys.executable, "train.py", "--config", str(config), "--train.max_iters=2", "--train.eval_iters=1"]
        runs.append(
            subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert sum("preparing the bundled dataset" in out for out, _ in outputs) == 1
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["shakespeare_char"]  # no lock file left
