import pytest
import torch

from tests.conftest import tiny_model

VOCAB = 50
T = 16


@pytest.mark.parametrize("t", [0, 5, 14])
def test_future_tokens_do_not_change_past_logits(t):
    model = tiny_model(VOCAB, block_size=T)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (3, T))
    changed = idx.clone()
    changed[:, t + 1 :] = torch.randint(0, VOCAB, (3, T - t - 1))
    assert not torch.equal(changed, idx)
    logits, _ = model(idx)
    changed_logits, _ = model(changed)
    assert torch.equal(logits[:, : t + 1], changed_logits[:, : t + 1])
    assert not torch.allclose(logits[:, t + 1 :], changed_logits[:, t + 1 :])


@pytest.mark.parametrize("t", [0, 7, 14])
@pytest.mark.parametrize("training", [False, True])
def test_gradient_of_logits_at_t_with_respect_to_later_embeddings_is_zero(t, training):
    model = tiny_model(VOCAB, block_size=T, dropout=0.1 if training else 0.0)
    model.train(training)
    captured = {}

    def keep_embeddings(module, inputs, output):
        output.retain_grad()
        captured["embeddings"] = output  # (B, T, C) token embeddings

    model.transformer.wte.register_forward_hook(keep_embeddings)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, T))
    logits, _ = model(idx)
    logits[:, t].sum().backward()
    grad = captured["embeddings"].grad
    assert torch.all(grad[:, t + 1 :] == 0)
    assert torch.all(grad[:, : t + 1].abs().sum(-1) > 0)


def test_loss_ignores_targets_marked_minus_one():
    model = tiny_model(VOCAB, block_size=T)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, T))
    targets = torch.randint(0, VOCAB, (2, T))
    padded = targets.clone()
    padded[:, 10:] = -1
    logits, loss = model(idx, padded)
    expected = torch.nn.functional.cross_entropy(logits[:, :10].reshape(-1, VOCAB), targets[:, :10].reshape(-1))
    torch.testing.assert_close(loss, expected)
