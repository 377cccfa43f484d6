import math

import pytest
import torch

from model import GPT, GPTConfig, sample_next_token
from tests.conftest import tiny_model


def gpt2_parameter_names(n_layer: int) -> set[str]:
    """The names of GPT-2's weights (as in the released checkpoints), minus its attention-mask buffers."""
    names = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    per_layer = [
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
        "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
        "mlp.c_proj.weight", "mlp.c_proj.bias",
    ]  # fmt: skip
    for i in range(n_layer):
        names.update(f"transformer.h.{i}.{name}" for name in per_layer)
    return names


def test_parameter_names_follow_gpt2_layout():
    model = tiny_model()
    state_names = set(model.state_dict()) - {"lm_head.weight"}
    assert state_names == gpt2_parameter_names(n_layer=2)


def test_output_layer_is_tied_to_token_embedding():
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params(non_embedding=False) == sum(p.numel() for p in set(model.parameters()))


@pytest.mark.parametrize("head_dim", [0, 2, 12])
@pytest.mark.parametrize("bias", [True, False])
def test_config_counts_the_parameters_of_the_model_it_describes(bias, head_dim):
    config = GPTConfig(n_layer=3, n_head=2, n_embd=8, block_size=5, vocab_size=11, bias=bias, head_dim=head_dim)
    assert config.num_params() == GPT(config).num_params(non_embedding=False)


def test_bias_false_removes_every_bias():
    model = tiny_model(bias=False)
    assert not [name for name in model.state_dict() if name.endswith("bias")]


def test_initialisation_follows_gpt2():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=256, block_size=64, vocab_size=500))
    for name, param in model.named_parameters():
        if name.endswith("c_proj.weight"):
            expected = 0.02 / math.sqrt(2 * n_layer)
            assert param.std().item() == pytest.approx(expected, rel=0.02), name
        elif param.dim() == 2:
            assert param.std().item() == pytest.approx(0.02, rel=0.02), name
        elif "ln" in name and name.endswith("weight"):
            assert torch.all(param == 1), name
        else:
            assert torch.all(param == 0), name  # biases


def test_loss_at_initialisation_is_close_to_ln_vocab_size():
    vocab_size = 65
    model = tiny_model(vocab_size)
    torch.manual_seed(1)
    idx = torch.randint(0, vocab_size, (8, 32))
    targets = torch.randint(0, vocab_size, (8, 32))
    _, loss = model(idx, targets)
    assert loss.item() == pytest.approx(math.log(vocab_size), abs=0.05)


def test_tiny_model_overfits_one_batch():
    model = tiny_model(vocab_size=30).train()
    torch.manual_seed(1)
    idx = torch.randint(0, 30, (4, 32))
    targets = torch.randint(0, 30, (4, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        _, loss = model(idx, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.1


@pytest.mark.parametrize(
    "change,message",
    [
        ({"n_embd": 100, "n_head": 3}, r"n_embd=100 is not divisible by n_head=3 \(.*or set head_dim\)"),
        ({"head_dim": -1}, r"head_dim=-1 must be a positive width, or 0 for n_embd / n_head"),
        ({"n_layer": 0}, "n_layer=0 must be a positive integer"),
        ({"block_size": -1}, "block_size=-1 must be a positive integer"),
        ({"dropout": 1.0}, r"dropout=1.0 must be in \[0, 1\)"),
    ],
)
def test_invalid_model_config_is_rejected(change, message):
    values = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=10) | change
    with pytest.raises(ValueError, match=message):
        GPTConfig(**values)


def test_heads_of_their_own_width_need_not_divide_n_embd():
    model = GPT(GPTConfig(n_layer=1, n_head=3, n_embd=100, head_dim=32, block_size=8, vocab_size=10))
    logits, _ = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, 10)


def test_model_needs_a_vocabulary_size():
    with pytest.raises(ValueError, match="vocab_size=0"):
        GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8))


def test_temperature_zero_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 1.0, 0.0]])
    assert sample_next_token(logits, temperature=0).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_pick_is_torch_argmax_first_largest_and_nan_the_largest(dtype):
    """Greedy decoding on a CPU takes numpy's argmax where it can: the same tokens as torch's, ties and
    NaN included, on a row sliced out of wider logits, as generate slices them."""
    torch.manual_seed(0)
    nan, inf = float("nan"), float("inf")
    special = torch.tensor([[1.0, nan, 3.0, nan, 0.0], [2.0, 5.0, 5.0, -1.0, 5.0], [-inf] * 5, [inf, 1.0, inf, 0, 9]])
    rows = torch.randint(-3, 4, (64, 7)).to(dtype)  # many ties
    sliced = torch.randn(3, 2, 50).to(dtype)[:, -1, :45]
    for logits in (special.to(dtype), rows, sliced, sliced[0], torch.randn(9, requires_grad=True).to(dtype)):
        picked = sample_next_token(logits, temperature=0)
        assert picked.dtype == torch.int64 and torch.equal(picked, logits.argmax(dim=-1))


def test_top_k_one_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    generator = torch.Generator().manual_seed(0)
    sampled = sample_next_token(logits, temperature=1.0, top_k=1, generator=generator)
    assert torch.equal(sampled, logits.argmax(-1))


def test_top_k_samples_only_the_k_most_likely():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).expand(2000, 4)
    generator = torch.Generator().manual_seed(0)
    sampled = sample_next_token(logits, top_k=2, generator=generator)
    assert set(sampled.tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    generator = torch.Generator().manual_seed(0)
    assert set(sample_next_token(logits, top_p=0.5, generator=generator).tolist()) == {0}
    assert set(sample_next_token(logits, top_p=0.79, generator=generator).tolist()) == {0, 1}
    assert set(sample_next_token(logits, top_p=0.81, generator=generator).tolist()) == {0, 1, 2}
