"""Nothing is lost when a run is killed, interrupted or diverges: it resumes exactly where its last
checkpoint left it."""

import dataclasses
import json
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import trainer.stop as stop_module
from errors import UserError
from tests.conftest import PROJECT_ROOT, run_entry_point, snapshot, tiny_config, tiny_toml
from trainer.checkpoint import load_checkpoint
from trainer.loop import Trainer
from trainer.stop import StopSignals

# checkpoints every 5 steps, dropout on: resuming must restore the RNG exactly to match
RUN_ARGS = [
    "--train.max_iters=30",
    "--train.eval_interval=5",
    "--train.eval_iters=1",
    "--model.dropout=0.1",
]


def train_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def start_training(config, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", "--config", str(config), *RUN_ARGS, *args],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(process: subprocess.Popen, run_dir, step: int) -> None:
    """Wait until the run has logged `step` (or later)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the run ended before step {step}: {process.communicate()}"
        if (run_dir / "metrics.jsonl").exists() and max(train_losses(run_dir), default=0) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 120 s")


@pytest.fixture
def uninterrupted(tmp_path_factory, data_dir):
    """The losses of the same run, trained from start to end in one go. Trained anew for each test,
    right before it: the last bits of a float32 loss have been seen to differ between processes
    started minutes apart on one virtual machine (the same weights, the same loss before and
    after), and a reference taken minutes earlier would make such a change look like a resume bug."""
    root = tmp_path_factory.mktemp("uninterrupted")
    config = root / "tiny.toml"
    config.write_text(tiny_toml(root / "run", data_dir))
    process = start_training(config)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return train_losses(root / "run")


@pytest.fixture
def config(tmp_path, data_dir):
    path = tmp_path / "tiny.toml"
    path.write_text(tiny_toml(tmp_path / "run", data_dir))
    return path


def resume(config) -> None:
    process = start_training(config, "--train.init_from=resume")
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err


@pytest.mark.slow
def test_run_killed_at_a_random_step_resumes_to_the_same_losses(config, tmp_path, uninterrupted):
    kill_after = random.randint(6, 28)  # a SIGKILL can land anywhere, even inside a checkpoint write
    process = start_training(config)
    wait_for_step(process, tmp_path / "run", kill_after)
    process.kill()
    process.communicate()
    before_kill = train_losses(tmp_path / "run")
    assert before_kill == {step: uninterrupted[step] for step in before_kill}, "the runs differ before the kill"
    resume(config)
    assert train_losses(tmp_path / "run") == uninterrupted, f"killed after step {kill_after}"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_ctrl_c_write_a_checkpoint_and_exit_cleanly(signum, config, tmp_path, uninterrupted):
    process = start_training(config)
    wait_for_step(process, tmp_path / "run", 7)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum
    assert "Traceback" not in err
    step = load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"]
    assert step >= 7  # the checkpoint written on the signal (evaluations only wrote step 5 by then)
    # on lines of their own, below the progress bar (on stderr): the message, then the command to paste
    lines = out.splitlines()
    assert (
        lines[-2]
        == f"stopped by {signum.name} at step {step}; checkpoint in {tmp_path / 'run' / 'ckpt.pt'}; continue with:"
    )
    command = shlex.split(lines[-1])
    assert command[:2] == ["python", "train.py"] and command[2:] == [
        "--config",
        str(tmp_path / "run" / "config.toml"),
        "--train.init_from=resume",
    ]
    resumed = subprocess.run([sys.executable, *command[1:]], cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert train_losses(tmp_path / "run") == uninterrupted


@pytest.mark.slow
def test_sigterm_is_honoured_whatever_the_log_interval(config, tmp_path):
    run_dir = tmp_path / "run"
    never = "--train.log_interval=100000", "--train.eval_interval=100000"  # no log step, no evaluation to wait for
    process = start_training(config, "--train.max_iters=100000", *never)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)  # until the evaluation at step 0 is written: training starts after it
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    step = load_checkpoint(run_dir / "ckpt.pt")["step"]
    assert step >= 1 and f"stopped by SIGTERM at step {step}; checkpoint in" in out


@pytest.mark.slow
def test_sigterm_during_a_long_evaluation_ends_the_run_within_seconds(config, tmp_path):
    run_dir = tmp_path / "run"
    process = start_training(config, "--train.eval_iters=1000000")  # a baseline evaluation of many minutes
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "config.toml").exists():  # written right before the evaluation at step 0
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        time.sleep(1.0)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
        seconds = time.monotonic() - signalled
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    assert seconds < 15 and "stopped by SIGTERM before the first step: nothing saved" in out
    assert not run_dir.exists()


@pytest.mark.parametrize("during", ["training", "evaluation"])
def test_processes_under_torchrun_agree_on_a_stop_about_every_two_seconds(monkeypatch, during):
    """The steps of training, or the batches of an evaluation: the processes must stop after the same one."""
    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(stop_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    polled = []

    class OneOfSeveralProcesses:
        launched = True

        def max(self, values, device):  # the all-reduce: here, only this process's values
            polled.append(count)
            return values

    stop = StopSignals(OneOfSeveralProcesses(), torch.device("cpu"), step=0)
    requested = stop.requested if during == "training" else stop.during_evaluation().requested
    stopped_at = None
    for count in range(1, 100):
        clock.now += 0.1  # 0.1 s per step or batch: an all-reduce every 20
        if count == 30:
            stop.signal = signal.SIGTERM  # what the handler does
        if requested(count) is not None:
            stopped_at = count
            break
    assert polled == [1, 21, 41] and stop_module.STOP_POLL_SECONDS == 2.0
    assert stopped_at == 41 and stop.agreed == signal.SIGTERM  # 1.1 s after the signal


def trainer_with_hook(run_dir, data_dir, after_step, **overrides) -> Trainer:
    """A 20-step run, evaluating every 5 steps, whose train_step calls after_step(trainer, loss)
    once each step is taken; what that returns is the step's loss."""
    trainer = Trainer(tiny_config(run_dir, data_dir, train__max_iters=20, train__eval_interval=5, **overrides))
    train_step = trainer.train_step
    trainer.train_step = lambda lr: after_step(trainer, train_step(lr))
    return trainer


def evaluated_steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "val_loss" in r]


def signal_at_evaluation_batch(trainer: Trainer, step: int, batch: int) -> list[int]:
    """Raise SIGTERM during the batch-th batch of the evaluation at step; returns the list that
    grows by one for each evaluation batch of that step."""
    forward, batches = trainer.forward, []

    def forward_with_signal(*args, **kwargs):
        if not trainer.model.training and trainer.step == step:
            batches.append(step)
            if len(batches) == batch:
                signal.raise_signal(signal.SIGTERM)
        return forward(*args, **kwargs)

    trainer.forward = forward_with_signal
    return batches


def test_a_stop_during_an_evaluation_ends_it_after_the_batch_and_keeps_the_step(tmp_path, data_dir):
    """A preemption's grace period (often 30 s) can be shorter than an evaluation of a large model:
    the evaluation ends after the batch the signal came in (here 3 of 2 x 50), the checkpoint holds
    the step, and the resumed run does the evaluation first."""
    run_dir, step = tmp_path / "run", 10
    trainer = Trainer(tiny_config(run_dir, data_dir, train__max_iters=20, train__eval_interval=5, train__eval_iters=50))
    batches = signal_at_evaluation_batch(trainer, step, batch=3)
    assert trainer.fit() == signal.SIGTERM
    assert len(batches) == 3
    assert load_checkpoint(run_dir / "ckpt.pt")["step"] == step
    assert evaluated_steps(run_dir) == [0, 5]
    resumed = Trainer(
        tiny_config(run_dir, data_dir, train__max_iters=20, train__eval_interval=5, train__init_from="resume")
    )
    assert resumed.fit() is None
    assert evaluated_steps(run_dir) == [0, 5, 10, 15, 20]


def signal_at_task_forward(trainer: Trainer, step: int, forward_number: int) -> list[int]:
    """Raise SIGTERM in the forward_number-th forward pass of the [eval] task scoring at step (the
    passes without targets: the losses' have them); returns the list that grows by one per pass."""
    forward, forwards = trainer.model.forward, []

    def forward_with_signal(idx, targets=None, **kwargs):
        if targets is None and trainer.step == step:
            forwards.append(step)
            if len(forwards) == forward_number:
                signal.raise_signal(signal.SIGTERM)
        return forward(idx, targets, **kwargs)

    trainer.model.forward = forward_with_signal
    return forwards


@pytest.mark.parametrize(
    "task,passes_per_batch",
    [("passage.txt", 1), ("next_line.jsonl", 3)],  # text: one pass a batch; questions: contexts, then two of endings
    ids=["text", "multiple-choice"],
)
def test_a_stop_during_eval_task_scoring_ends_it_after_the_batch_and_keeps_the_step(
    tmp_path, data_dir, task, passes_per_batch
):
    """[eval] tasks are scored in batches, and the stop flag is read after every one (it was read
    after each whole task: minutes for a real model, past a preemption's grace period). Measured in
    the run's own forward passes: the pass the signal came in ends its batch, and no other starts.
    The checkpoint keeps the step, and the resumed run does the evaluation first."""
    run_dir = tmp_path / "run"
    tasks = dict(eval__tasks=str(PROJECT_ROOT / "tests" / "tasks" / task), eval__items=0, eval__batch_size=1)
    overrides = dict(train__max_iters=20, train__eval_interval=5, model__block_size=64, **tasks)
    trainer = Trainer(tiny_config(run_dir, data_dir, **overrides))
    forwards = signal_at_task_forward(trainer, 10, forward_number=3)
    assert trainer.fit() == signal.SIGTERM
    assert 3 <= len(forwards) < 3 + passes_per_batch
    assert load_checkpoint(run_dir / "ckpt.pt")["step"] == 10
    assert evaluated_steps(run_dir) == [0, 5]
    resumed = Trainer(tiny_config(run_dir, data_dir, train__init_from="resume", **overrides))
    assert resumed.fit() is None
    assert evaluated_steps(run_dir) == [0, 5, 10, 15, 20]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(any(key.startswith("eval/") for key in r) for r in records if "val_loss" in r)


def signal_at_micro_batch(trainer: Trainer, step: int, micro_batch: int) -> None:
    """Raise SIGTERM during the forward pass of micro_batch (0, 1, ...) of the step after `step`."""
    forward, seen = trainer.forward, []

    def forward_with_signal(*args, **kwargs):
        if trainer.model.training and trainer.step == step:
            seen.append(step)
            if len(seen) == micro_batch + 1:
                signal.raise_signal(signal.SIGTERM)
        return forward(*args, **kwargs)

    trainer.forward = forward_with_signal


@pytest.mark.parametrize("micro_batch", [0, 2])
def test_a_stop_between_micro_batches_drops_the_step_and_resumes_bit_for_bit(tmp_path, data_dir, micro_batch):
    """A step of many micro-batches (a large model's) does not delay a stop: the run stops after the
    micro-batch in progress, drops the unfinished step (its gradients, batches and random numbers)
    and saves the last finished one, from which the resumed run repeats the uninterrupted one."""
    run = dict(train__max_iters=12, train__eval_interval=5, train__gradient_accumulation_steps=4, model__dropout=0.1)
    Trainer(tiny_config(tmp_path / "whole", data_dir, **run)).fit()
    trainer = Trainer(tiny_config(tmp_path / "split", data_dir, **run))
    forward = trainer.forward
    micro_batches = []
    trainer.forward = lambda *args, **kwargs: micro_batches.append(trainer.step) or forward(*args, **kwargs)
    signal_at_micro_batch(trainer, 7, micro_batch)
    assert trainer.fit() == signal.SIGTERM
    assert micro_batches.count(7) == micro_batch + 1  # nothing after the micro-batch the signal came in
    assert load_checkpoint(tmp_path / "split" / "ckpt.pt")["step"] == 7
    assert max(train_losses(tmp_path / "split")) == 7
    assert Trainer(tiny_config(tmp_path / "split", data_dir, **run, train__init_from="resume")).fit() is None
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")


@pytest.mark.parametrize("during", ["baseline evaluation", "first step"])
def test_a_run_stopped_before_its_first_step_saves_nothing(tmp_path, data_dir, capsys, during):
    """Nothing is worth keeping: no checkpoint (which sample.py would pick as the latest run), and
    none of the run's files, so that the same command starts it again."""
    run_dir = tmp_path / "out" / "run"
    trainer = Trainer(tiny_config(run_dir, data_dir, train__gradient_accumulation_steps=4, train__eval_iters=50))
    if during == "baseline evaluation":
        signal_at_evaluation_batch(trainer, 0, batch=3)
    else:
        signal_at_micro_batch(trainer, 0, 1)
    assert trainer.fit() == signal.SIGTERM
    assert "stopped by SIGTERM before the first step: nothing saved" in capsys.readouterr().out
    assert not run_dir.exists() and (tmp_path / "out").exists()
    assert Trainer(tiny_config(run_dir, data_dir, train__max_iters=2)).fit() is None


def test_a_resumed_run_stopped_before_its_next_step_keeps_its_checkpoint_as_it_was(tmp_path, data_dir, capsys):
    run_dir, run = tmp_path / "run", dict(train__eval_interval=5, train__gradient_accumulation_steps=2)
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10, **run)).fit()
    before = snapshot(run_dir)
    trainer = Trainer(tiny_config(run_dir, data_dir, train__max_iters=20, train__init_from="resume", **run))
    signal_at_micro_batch(trainer, 10, 0)
    assert trainer.fit() == signal.SIGTERM
    assert snapshot(run_dir)["ckpt.pt"] == before["ckpt.pt"]
    assert "stopped by SIGTERM at step 10; checkpoint in" in capsys.readouterr().out


def test_a_stop_at_an_evaluation_step_ends_its_evaluation_at_once(tmp_path, data_dir):
    """A signal in the step before an evaluation: the evaluation stops after its first batch."""

    def signal_at_step_10(trainer, loss):
        if trainer.step == 9:  # the step just taken becomes step 10
            signal.raise_signal(signal.SIGTERM)
        return loss

    trainer = trainer_with_hook(tmp_path / "run", data_dir, signal_at_step_10)
    batches = signal_at_evaluation_batch(trainer, 10, batch=0)  # counts only
    assert trainer.fit() == signal.SIGTERM
    assert len(batches) == 1
    assert evaluated_steps(tmp_path / "run") == [0, 5]
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 10


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, data_dir):
    def diverge_at_step_8(trainer, loss):
        return loss * float("nan") if trainer.step >= 7 else loss

    trainer = trainer_with_hook(tmp_path / "run", data_dir, diverge_at_step_8)
    with pytest.raises(UserError, match=r"the train loss is nan at step 8: training stopped, .*ckpt.pt from step 5 is"):
        trainer.fit()
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 5


def test_weights_that_are_not_numbers_are_never_saved_over_the_last_good_checkpoint(tmp_path, data_dir):
    """A step can leave NaN weights behind a finite loss (an infinite gradient clipped to NaN); a stop
    right after it saves without an evaluation to notice, so the save itself refuses them."""

    def break_weights_and_stop_at_step_8(trainer, loss):
        if trainer.step == 7:  # the step just taken becomes step 8, between the checkpoints of 5 and 10
            with torch.no_grad():
                trainer.model.transformer.h[0].attn.c_attn.weight[0, 0] = float("nan")
            signal.raise_signal(signal.SIGTERM)
        return loss

    trainer = trainer_with_hook(tmp_path / "run", data_dir, break_weights_and_stop_at_step_8)
    message = (
        r"the weights are not finite \(transformer.h.0.attn.c_attn.weight holds 1 NaN and 0 infinite values "
        r"\(of 3,072\)\) at step 8: training stopped, .*ckpt.pt from step 5 is kept"
    )
    with pytest.raises(UserError, match=message):
        trainer.fit()
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 5


def test_a_run_whose_decay_follows_max_iters_resumes_bit_for_bit(tmp_path, data_dir, monkeypatch):
    """Stopped at step 7 and resumed from its config.toml, a run with lr_decay_iters unset takes the
    same rates and losses as the same run uninterrupted: the saved config holds the resolved decay."""

    def stop_at_step_7(trainer, loss):
        if trainer.step == 6:  # the step just taken becomes step 7
            signal.raise_signal(signal.SIGTERM)
        return loss

    follows = dict(optim__lr_decay_iters=0, model__dropout=0.1)
    Trainer(tiny_config(tmp_path / "whole", data_dir, train__max_iters=20, train__eval_interval=5, **follows)).fit()
    assert trainer_with_hook(tmp_path / "split", data_dir, stop_at_step_7, **follows).fit() == signal.SIGTERM
    resume = ["--config", str(tmp_path / "split" / "config.toml"), "--train.init_from=resume"]
    assert run_entry_point("train.py", resume, monkeypatch) == 0

    def rates_and_losses(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["lr"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]

    assert rates_and_losses(tmp_path / "split") == rates_and_losses(tmp_path / "whole")
    assert load_checkpoint(tmp_path / "split" / "ckpt.pt")["config"]["optim"]["lr_decay_iters"] == 20


def test_keep_checkpoints_keeps_the_last_k_beside_the_latest(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    cfg = tiny_config(run_dir, data_dir, train__max_iters=20, train__eval_interval=5, train__keep_checkpoints=2)
    Trainer(cfg).fit()
    assert sorted(p.name for p in run_dir.glob("ckpt*")) == ["ckpt.pt", "ckpt_00000015.pt", "ckpt_00000020.pt"]
    assert (run_dir / "ckpt.pt").read_bytes() == (run_dir / "ckpt_00000020.pt").read_bytes()
    assert load_checkpoint(run_dir / "ckpt_00000015.pt")["step"] == 15

    # go back to step 15 with a plain copy (ckpt.pt is a file of its own: the copy leaves step 20 as it was)
    step_20 = (run_dir / "ckpt_00000020.pt").read_bytes()
    shutil.copyfile(run_dir / "ckpt_00000015.pt", run_dir / "ckpt.pt")
    assert (run_dir / "ckpt_00000020.pt").read_bytes() == step_20
    # and train on: the abandoned step 20 is dropped, not kept as the newest
    Trainer(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from="resume", max_iters=25))).fit()
    assert sorted(p.name for p in run_dir.glob("ckpt*")) == ["ckpt.pt", "ckpt_00000020.pt", "ckpt_00000025.pt"]
    assert load_checkpoint(run_dir / "ckpt_00000020.pt")["step"] == 20


def test_resume_restores_every_random_number_generator(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    saved = load_checkpoint(run_dir / "ckpt.pt")["rng"]
    assert len(saved) == 1  # one process
    np.random.seed(99)
    random.seed(99)
    torch.manual_seed(99)
    trainer = Trainer(tiny_config(run_dir, data_dir, train__max_iters=20, train__init_from="resume"))
    assert np.array_equal(np.random.get_state()[1], saved[0]["numpy"][1].numpy())
    assert random.getstate() == saved[0]["python"]
    assert torch.equal(torch.get_rng_state(), saved[0]["torch"])
    assert torch.equal(trainer.batches.generator.get_state(), saved[0]["train_batches"]["generator"])


def test_a_copied_run_directory_resumes_in_the_copy(tmp_path, data_dir, monkeypatch):
    Trainer(tiny_config(tmp_path / "run", data_dir, train__max_iters=10)).fit()
    shutil.copytree(tmp_path / "run", tmp_path / "copy")  # its config.toml still names run/ as out_dir
    original = snapshot(tmp_path / "run")
    resume = ["--config", str(tmp_path / "copy" / "config.toml"), "--train.init_from=resume", "--train.max_iters=12"]
    assert run_entry_point("train.py", resume, monkeypatch) == 0
    assert load_checkpoint(tmp_path / "copy" / "ckpt.pt")["step"] == 12
    assert snapshot(tmp_path / "run") == original


def test_a_run_written_before_config_headers_still_resumes(tmp_path, data_dir, monkeypatch):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    config = run_dir / "config.toml"
    config.write_text(config.read_text().split("\n", 1)[1])  # no first-line mark, as older runs wrote it
    resume = ["--config", str(config), "--train.init_from=resume", "--train.max_iters=12"]
    assert run_entry_point("train.py", resume, monkeypatch) == 0
    assert load_checkpoint(run_dir / "ckpt.pt")["step"] == 12
