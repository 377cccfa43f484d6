"""Checks of the CUDA path; skipped on machines without a CUDA GPU."""

import pytest
import torch

from tests.conftest import tiny_config, tiny_model
from trainer.loop import Trainer

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
        tiny_config(tmp_path / "run", data_dir, train__device="cuda", train__dtype=dtype, train__max_iters=30,
                    optim__learning_rate=3e-3)  # fmt: skip
    )
    assert trainer.model.lm_head.weight.is_cuda
    assert trainer.scaler.is_enabled() == (dtype == "float16")
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before - 0.5
