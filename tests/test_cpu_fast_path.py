"""The parts of the GPU fast path that PyTorch also runs on a CPU, run here so that a mistake in
them shows up without a GPU: bfloat16 autocast, the fused AdamW and torch.compile; and the CPU's
own: the allocator keeping freed memory. (MFU is in test_trainer.py, FSDP's mixed precision in
test_distributed.py.)"""

import subprocess
import sys

import pytest
import torch

from optim.optimizer import build_optimizer
from tests.conftest import PROJECT_ROOT, FixedBatches, capture_gradients, fixed_tokens, tiny_config, tiny_model
from trainer.config import OptimConfig
from trainer.loop import Trainer


def test_bfloat16_training_step_computes_in_bfloat16_and_lowers_the_loss(tmp_path, data_dir):
    trainer = Trainer(
        tiny_config(tmp_path / "run", data_dir, train__dtype="bfloat16", train__max_iters=30, optim__learning_rate=3e-3)
    )
    assert trainer.dtype == torch.bfloat16 and not trainer.scaler.is_enabled()  # no loss scaling in bfloat16
    output_dtypes = []
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *args: output_dtypes.append(args[2].dtype))
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert output_dtypes and set(output_dtypes) == {torch.bfloat16}  # autocast was on, in training and evaluation
    assert trainer.model.lm_head.weight.dtype == torch.float32  # the weights themselves stay float32
    assert trainer.evaluate()["val"] < before - 0.5


def test_cpu_optimizer_is_fused_and_steps_like_the_per_tensor_one():
    fused_model, per_tensor_model = tiny_model(), tiny_model()
    cfg = OptimConfig(learning_rate=1e-2, weight_decay=0.1, beta2=0.99)
    fused = build_optimizer(fused_model, cfg, torch.device("cpu"))
    per_tensor = build_optimizer(per_tensor_model, cfg, torch.device("cpu"))
    assert all(group["fused"] for group in fused.param_groups)
    for group in per_tensor.param_groups:
        group["fused"] = False  # torch's reference implementation, one tensor at a time
    x, y = fixed_tokens(4, 32, 50)
    for model, optimizer in ((fused_model, fused), (per_tensor_model, per_tensor)):
        for _ in range(3):
            model.zero_grad()
            model(x, y)[1].backward()
            optimizer.step()
    initial = tiny_model().state_dict()
    reference = dict(per_tensor_model.named_parameters())
    for name, param in fused_model.named_parameters():
        assert not torch.equal(param, initial[name]), f"{name} did not move"
        # atol: the key bias gets gradients near 0 (softmax ignores a constant shift of the scores),
        # where Adam's update g / sqrt(v) magnifies rounding differences
        torch.testing.assert_close(param, reference[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_compiled_training_step_gives_the_eager_loss_and_gradients(tmp_path, data_dir):
    torch._dynamo.reset()
    results = {}
    for compile in (False, True):
        trainer = Trainer(tiny_config(tmp_path / f"compile-{compile}", data_dir, train__compile=compile))
        x, y = fixed_tokens(8, trainer.cfg.model.block_size, trainer.cfg.model.vocab_size)
        trainer.batches = FixedBatches(x, y, 4)
        gradients = capture_gradients(trainer)
        losses = [trainer.train_step(lr=1e-3).item() for _ in range(2)]
        results[compile] = losses, gradients, trainer.evaluate()
    (eager_losses, eager_gradients, eager_eval), (losses, gradients, evaluation) = results[False], results[True]
    assert losses == pytest.approx(eager_losses, abs=1e-5)
    assert evaluation == pytest.approx(eager_eval, abs=1e-5)
    for name, grad in eager_gradients.items():
        torch.testing.assert_close(gradients[name], grad, atol=1e-5, rtol=1e-4, msg=name)


STEP_OF_ALLOCATIONS = """
import resource, sys, torch
from trainer.runtime import keep_freed_memory
if sys.argv[1] == "keep" and not keep_freed_memory():
    print("not kept")
    sys.exit()
def step():  # a training step's activations, in miniature: held together, then all freed
    held = [torch.ones(2**16 * (1 + i % 5)) for i in range(40)]
    return sum(t[0] for t in held)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts page faults as Linux does")
def test_cpu_training_reuses_freed_memory_instead_of_faulting_it_in_each_step():
    def page_faults(mode: str) -> str:
        command = [sys.executable, "-c", STEP_OF_ALLOCATIONS, mode]
        return subprocess.run(command, cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    kept = page_faults("keep")
    if kept == "not kept":
        pytest.skip("the C library is not a 64-bit glibc: keep_freed_memory changes nothing here")
    default = int(page_faults("default"))  # 40 tensors of 256 kB to 1.3 MB, each step
    if default < 1_000:
        pytest.skip(f"this machine's allocator already keeps freed memory ({default} page faults in 10 steps)")
    assert int(kept) < default / 10


def test_a_cpu_trainer_keeps_freed_memory(tmp_path, data_dir, monkeypatch):
    calls = []
    monkeypatch.setattr("trainer.loop.keep_freed_memory", lambda: calls.append(1) or True)
    Trainer(tiny_config(tmp_path / "run", data_dir, train__max_iters=1))
    assert calls == [1]
