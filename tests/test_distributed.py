"""Data-parallel training with torchrun on the CPU: 2 processes talking over gloo."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import (
    PROJECT_ROOT,
    FixedBatches,
    capture_gradients,
    fixed_tokens,
    run_script,
    tiny_config,
    tiny_toml,
)
from tests.distributed_worker import RECIPES
from trainer.loop import Trainer

pytestmark = pytest.mark.slow


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.mark.parametrize(
    "parallelism,optimizer",
    [("ddp", "adamw"), ("fsdp", "adamw"), ("ddp", "muon"), ("fsdp", "muon"), ("fsdp", "normuon+cautious")],
)
def test_one_step_on_two_processes_equals_one_process_with_twice_the_batch(parallelism, optimizer, data_dir, tmp_path):
    out_path = tmp_path / "after_step.pt"
    worker = str(PROJECT_ROOT / "tests" / "distributed_worker.py")
    torchrun(worker, parallelism, str(data_dir), str(out_path), optimizer)
    distributed = torch.load(out_path, weights_only=True)
    assert distributed["world_size"] == 2
    assert distributed["ranks_drew_different_batches"]
    if parallelism == "ddp":  # the gradients are views of DDP's few all-reduce buffers, not copies beside them
        assert distributed["gradient_buffers"][0] <= 2 < distributed["gradients_count"]

    trainer, gradients, before = one_process_step(data_dir, tmp_path, optimizer)
    weights = trainer.model.state_dict()
    assert distributed["gradients"].keys() == gradients.keys()
    for name, grad in gradients.items():
        torch.testing.assert_close(distributed["gradients"][name], grad, rtol=0, atol=1e-6, msg=name)
    assert distributed["model"].keys() == weights.keys()
    # AdamW's first step moves each weight by about lr * g / (|g| + eps): where |g| is within float32
    # rounding of zero, the sign of a 1e-9 difference decides the step. So every weight agrees within
    # 1e-6 except a few whose gradient is that small (and the gradients themselves agree, above).
    # Muon's Newton-Schulz iteration multiplies the smallest singular directions by about 3.4 per
    # iteration, so a 1e-9 change of the gradient grows: its steps agree to 1e-3 of their size,
    # not to float32 precision. (FSDP shards the matrices by rows: this also shows each is
    # orthogonalised whole, not shard by shard.)
    muon = trainer.optimizer.optimizers[0] if trainer.cfg.optim.optimizer == "muon" else None
    muon_params = set(muon.param_groups[0]["params"]) if muon else set()
    differing = 0
    for name, grad in gradients.items():
        if trainer.model.get_parameter(name) in muon_params:
            step = (weights[name] - before[name]).norm()
            assert (distributed["model"][name] - weights[name]).norm() < 1e-3 * step, name
            continue
        off = (distributed["model"][name] - weights[name]).abs() > 1e-6
        assert (grad[off].abs() < 1e-6).all(), name
        differing += off.sum().item()
    assert differing <= 1e-3 * sum(g.numel() for g in gradients.values())
    for name in weights.keys() - gradients.keys():  # the tied head
        torch.testing.assert_close(distributed["model"][name], weights[name], rtol=0, atol=1e-6, msg=name)
    # the optimizer state gathers whole (NorMuon's per-neuron statistic too, over the whole row or
    # column), and loads back onto the shards unchanged, as a resumed run restores it
    single = trainer.parallel.state_dicts(trainer.optimizer)[1]["state"]
    assert distributed["optimizer"].keys() == single.keys()
    for name, state in single.items():
        gathered = distributed["optimizer"][name]
        assert gathered.keys() == state.keys(), name
        for key, value in state.items():
            assert gathered[key].shape == value.shape, (name, key)
            torch.testing.assert_close(distributed["reloaded_optimizer"][name][key], gathered[key])
        if "neuron_second_moment" in state:
            moment = state["neuron_second_moment"]
            torch.testing.assert_close(gathered["neuron_second_moment"], moment, rtol=2e-3, atol=0)


def test_fsdp_in_bfloat16_computes_in_bfloat16_and_reduces_float32_gradients(data_dir, tmp_path):
    out_path = tmp_path / "after_step.pt"
    worker = str(PROJECT_ROOT / "tests" / "distributed_worker.py")
    torchrun(worker, "fsdp", str(data_dir), str(out_path), "adamw", "bfloat16")
    distributed = torch.load(out_path, weights_only=True)
    # autocast alone would keep the layer norm in float32: bfloat16 here means FSDP gathered bfloat16 weights
    assert set(distributed["norm_output_dtypes"]) == {"torch.bfloat16"}
    _, gradients, _ = one_process_step(data_dir, tmp_path, "adamw")  # float32 throughout
    assert all(grad.dtype == torch.float32 for grad in distributed["gradients"].values())
    flat = torch.cat([grad.flatten() for grad in gradients.values()])
    error = torch.cat([(distributed["gradients"][name] - grad).flatten() for name, grad in gradients.items()])
    assert error.norm() < 0.05 * flat.norm()  # bfloat16 keeps about 3 significant digits


def one_process_step(data_dir, tmp_path, optimizer: str) -> tuple[Trainer, dict, dict]:
    """One float32 step of one process with batch 4 x 2 micro-batches, the same 8 rows as the workers'
    2 processes x batch 2 x 2 micro-batches each: the trainer, the gradients and the weights before it."""
    cfg = tiny_config(
        tmp_path / "single",
        data_dir,
        data__batch_size=4,
        train__gradient_accumulation_steps=2,
        **RECIPES[optimizer],
    )
    trainer = Trainer(cfg)
    x, y = fixed_tokens(8, cfg.model.block_size, trainer.cfg.model.vocab_size)
    trainer.batches = FixedBatches(x, y, 4)
    gradients = capture_gradients(trainer)
    before = {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}
    trainer.train_step(lr=1e-3)
    return trainer, gradients, before


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ddp_run_trains_with_one_voice_and_its_checkpoint_samples(data_dir, tmp_path):
    run_dir = tmp_path / "ddp"
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(run_dir, data_dir))
    result = torchrun("train.py", "--config", str(config), "--train.gradient_accumulation_steps=2")
    assert result.stdout.count("starting:") == 1  # rank 0 alone prints
    assert "2 processes (ddp) running 1 each = 256 tokens per step" in result.stdout
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 20 and losses[-1] < losses[0]
    sample = run_script("sample.py", "--out-dir", str(run_dir), "--max-new-tokens", "20", "--prompt", "ROMEO:")
    assert sample.returncode == 0 and sample.stdout.startswith("ROMEO:"), sample.stderr


def test_fsdp_run_resumes_and_its_checkpoint_samples_on_one_device(data_dir, tmp_path):
    run_dir = tmp_path / "fsdp"
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(run_dir, data_dir))
    fsdp = ["--train.parallelism=fsdp", "--train.gradient_accumulation_steps=2"]
    torchrun("train.py", "--config", str(config), *fsdp, "--train.max_iters=10")
    resumed = torchrun("train.py", "--config", str(config), *fsdp, "--train.init_from=resume")
    assert "resuming at step 10" in resumed.stdout
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 21))
    assert [r["step"] for r in records if "val_loss" in r] == [0, 10, 20]
    sample = run_script("sample.py", "--out-dir", str(run_dir), "--max-new-tokens", "20", "--temperature", "0")
    assert sample.returncode == 0 and len(sample.stdout) > 20, sample.stderr


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_lora_run_under_torchrun_trains_only_its_adapters_and_samples(parallelism, data_dir, tmp_path):
    """LoRA under torchrun: the adapters train on every process, the checkpoint holds them alone
    (with where the base came from), and it samples on one device with the base merged in."""
    base = tmp_path / "base"
    Trainer(tiny_config(base, data_dir, train__max_iters=4, train__eval_interval=4)).fit()
    run_dir = tmp_path / "lora"
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(run_dir, data_dir))
    lora = [f"--train.init_from={base}", "--lora.rank=4", "--optim.optimizer=adamw", "--optim.learning_rate=1e-2"]
    torchrun("train.py", "--config", str(config), f"--train.parallelism={parallelism}",
             "--train.gradient_accumulation_steps=2", *lora)  # fmt: skip
    checkpoint = torch.load(run_dir / "ckpt.pt", weights_only=True)
    assert checkpoint["model"] and all(".lora_" in name for name in checkpoint["model"])
    assert any(tensor.abs().sum() > 0 for name, tensor in checkpoint["model"].items() if "lora_B" in name)
    assert checkpoint["lora"]["source"].endswith("base")
    sample = run_script("sample.py", "--out-dir", str(run_dir), "--max-new-tokens", "20", "--temperature", "0")
    assert sample.returncode == 0 and len(sample.stdout) > 20, sample.stderr


def test_a_scheduled_run_under_torchrun_counts_every_process_and_resumes_bit_for_bit(data_dir, tmp_path):
    """Each process draws its share of every step's scheduled shape; the run copied at its step-3
    checkpoint (as a stop there leaves it) and resumed repeats the unbroken run's steps after it."""
    run_dir = tmp_path / "whole"
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_toml(run_dir, data_dir))
    schedules = ["--train.block_size_schedule=16:0.25", "--train.batch_size_schedule=2:0.5", "--train.max_iters=8"]
    args = [*schedules, "--train.gradient_accumulation_steps=4", "--train.eval_interval=3", "--model.dropout=0.1"]
    result = torchrun("train.py", "--config", str(config), *args, "--train.keep_checkpoints=3")
    assert "steps 0-1: 2 x 16 tokens at 0.66x the LR; steps 2-3: 2 x 32 tokens" in result.stdout
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    assert [r["tokens"] for r in steps] == [
        4 * 2 * 16 * min(s, 2) + 4 * 2 * 32 * min(max(s - 2, 0), 2) + 4 * 4 * 32 * max(s - 4, 0) for s in range(1, 9)
    ]

    split = tmp_path / "split"
    split.mkdir()
    shutil.copyfile(run_dir / "ckpt_00000003.pt", split / "ckpt.pt")
    (split / "config.toml").write_text((run_dir / "config.toml").read_text().replace(str(run_dir), str(split)))
    (split / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= 3))
    torchrun("train.py", "--config", str(split / "config.toml"), "--train.init_from=resume")

    def losses(run):
        return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(run) if "loss" in r]

    assert losses(split) == losses(run_dir)
