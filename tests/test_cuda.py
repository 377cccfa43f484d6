"""Checks of the CUDA path; skipped on machines without a CUDA GPU."""

import json

import pytest
import torch

from tests.conftest import run_script, tiny_config, tiny_model
from trainer.loop import Trainer
from trainer.metrics import gpu_peak_flops

pytestmark = pytest.mark.gpu


def test_cached_decoding_reproduces_full_forward_logits_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # exact float32 products
    model = tiny_model(50, 32).cuda()
    idx = torch.randint(0, 50, (2, 32), device="cuda")
    full, _ = model(idx)
    cache = model.new_cache(2)
    pieces = [model(idx[:, :7], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, 32)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_training_lowers_the_loss_on_cuda(tmp_path, data_dir, dtype):
    trainer = Trainer(
        tiny_config(
            tmp_path / "run",
            data_dir,
            train__device="cuda",
            train__dtype=dtype,
            train__max_iters=30,
            optim__learning_rate=3e-3,
        )  # fmt: skip
    )
    assert trainer.model.lm_head.weight.is_cuda
    (adamw,) = trainer.optimizer.optimizers
    assert adamw.defaults["fused"] is True
    assert trainer.scaler.is_enabled() == (dtype == "float16")
    x, y = trainer.batches.next_batch()
    assert x.is_cuda and y.is_cuda
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before - 0.5


def test_compiled_run_logs_mfu_resumes_in_another_precision_and_samples(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    common = dict(train__device="cuda", train__compile=True, train__eval_interval=10)
    Trainer(tiny_config(run_dir, data_dir, train__dtype="bfloat16", train__max_iters=10, **common)).fit()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if gpu_peak_flops(torch.device("cuda")) is not None:
        assert all(0 < r["mfu"] < 1 for r in steps if "loss" in r)
    resumed = Trainer(
        tiny_config(run_dir, data_dir, train__dtype="float16", train__max_iters=20, train__init_from="resume", **common)
    )
    assert resumed.step == 10 and resumed.scaler.is_enabled()
    resumed.fit()
    sample = run_script(
        "sample.py", "--out-dir", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "50", "--device", "cuda"
    )
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) == len("ROMEO:") + 50 + 1


def test_compiled_cuda_graph_step_gives_the_eager_tokens_on_cuda(monkeypatch):
    from model import generate, left_pad

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch._dynamo.reset()
    model = tiny_model(50, 16).cuda()
    prompts, pad = left_pad([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]], "cuda")

    def tokens(compile: bool) -> list[list[int]]:
        steps = generate(model, prompts, 40, temperature=0, pad=pad, compile=compile)
        return torch.stack(list(steps), dim=1).tolist()

    assert tokens(compile=True) == tokens(compile=False)
