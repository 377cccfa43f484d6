"""Linear layers packed for oneDNN compute what nn.Linear computes, and a packed model decodes as the
model does."""

import pytest
import torch
import torch.nn as nn

import inference.packed_linear as packed_linear_module
from inference.packed_linear import (
    PackedLinear,
    pack_linears,
    packing_unavailable,
    precision_unavailable,
    prepare_products,
)
from model import generate, left_pad
from tests.conftest import tiny_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    packing_unavailable(CPU, torch.float32) is not None, reason=str(packing_unavailable(CPU, torch.float32))
)

VOCAB = 50
BLOCK = 32


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 1, 24), (2, 5, 24)])
def test_packed_linear_computes_what_the_linear_computes(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        expected = linear(x)
        packed = PackedLinear(linear)(x)
    assert packed.shape == expected.shape
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(packing_unavailable(CPU, torch.bfloat16) is not None, reason="no oneDNN bfloat16 on this CPU")
def test_packed_linear_computes_in_bfloat16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        packed = PackedLinear(linear)(x)
    assert packed.dtype == torch.bfloat16
    expected = x.float() @ linear.weight.float().T + linear.bias.float()
    torch.testing.assert_close(packed.float(), expected, rtol=2e-2, atol=2e-2)


def test_packing_replaces_every_linear_and_keeps_the_token_embedding():
    model = tiny_model(VOCAB, BLOCK)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        embedded = model.transformer.wte(idx)
    pack_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == linears == 4 * 2 + 1
    # the output layer shared the embedding's weight; the embedding keeps it as a parameter
    assert isinstance(model.transformer.wte.weight, nn.Parameter)
    with torch.no_grad():
        assert torch.equal(model.transformer.wte(idx), embedded)


# GPT-2's heads, and heads of their own width, whose linear layers have other shapes (c_attn 32 -> 4 * 24,
# c_proj 2 * 24 -> 32)
HEADS = {"gpt2": {}, "wide-heads": {"head_dim": 24, "pos_emb": "rope", "n_kv_head": 1}}


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_packed_model_gives_the_models_logits(heads):
    model = tiny_model(VOCAB, BLOCK, **heads)
    idx = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, _ = model(idx)
        packed, _ = pack_linears(model)(idx)
    torch.testing.assert_close(packed, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_packed_model_decodes_with_the_cache_as_its_full_forward_pass(heads):
    model = pack_linears(tiny_model(VOCAB, BLOCK, **heads))
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(2)
        pieces = [model(idx[:, :5], cache=cache)[0]]
        pieces += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(5, BLOCK)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_packed_model_generates_each_padded_row_as_if_alone():
    model = pack_linears(tiny_model(VOCAB, BLOCK))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    batch, pad = left_pad(prompts)
    together = torch.stack(list(generate(model, batch, 2 * BLOCK, temperature=0, pad=pad)), dim=1)
    for row, ids in enumerate(prompts):
        alone = torch.stack(list(generate(model, torch.tensor([ids]), 2 * BLOCK, temperature=0)), dim=1)
        assert torch.equal(together[row], alone[0])


def test_packed_model_is_frozen_and_refuses_to_train():
    model = pack_linears(tiny_model(VOCAB, BLOCK).train())
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    with pytest.raises(RuntimeError, match="inference only"):
        model.lm_head(torch.randn(1, 32, requires_grad=True))


def test_packed_model_refuses_to_be_saved_or_moved():
    model = pack_linears(tiny_model(VOCAB, BLOCK))
    with pytest.raises(RuntimeError, match="save the model before packing it"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="pack the model after moving and casting it"):
        model.to(torch.float64)


def test_packing_a_model_off_the_cpu_is_refused_with_the_reason():
    model = tiny_model(VOCAB, BLOCK).to("meta")
    with pytest.raises(ValueError, match="cannot pack the linear layers: packing is for CPUs, the model is on meta"):
        pack_linears(model)


def test_sampler_packs_on_a_cpu_but_not_for_a_compiled_step():
    model = tiny_model(VOCAB, BLOCK)
    assert prepare_products(model, CPU, torch.float32, compile=True) == (
        "nn.Linear products (torch.compile cannot trace packed layers)"
    )
    assert isinstance(model.lm_head, nn.Linear)
    assert prepare_products(model, CPU, torch.float32, compile=False) == "linear layers packed for oneDNN"
    assert isinstance(model.lm_head, PackedLinear)


def test_sampler_says_why_it_keeps_nn_linear_where_packing_is_unavailable(monkeypatch):
    monkeypatch.setattr(packed_linear_module.platform, "machine", lambda: "arm64")
    model = tiny_model(VOCAB, BLOCK)
    note = prepare_products(model, CPU, torch.float32, compile=False)
    assert note == "nn.Linear products (packing is for x86-64 CPUs, this one is arm64)"
    assert isinstance(model.lm_head, nn.Linear)


# each precision's products against nn.Linear's, as a share of the largest output: float16 weights round to 11
# significant bits; bfloat16 weights, inputs and outputs to 8; int8 weights to 1/254 of their row's largest
PRODUCT_BOUNDS = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2, "int8": 2e-2}


@pytest.mark.parametrize("precision", PRODUCT_BOUNDS)
@pytest.mark.parametrize("in_features", [32, 341])  # 341: the quickstart's SwiGLU output layer, not a multiple of 16
def test_each_precisions_products_compute_what_the_linear_computes(precision, in_features):
    if precision_unavailable(CPU, torch.float32, precision) is not None:
        pytest.skip(precision_unavailable(CPU, torch.float32, precision))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, 40))
    x, residual = torch.randn(2, 3, in_features), torch.randn(6, 40)
    with torch.no_grad():
        expected = model(x)
        layer = pack_linears(model, precision, batch_size=6)[0]
        got = layer(x)
        rows = x.view(6, in_features)
        gelu, added = layer.product_gelu(rows), layer.product_add(rows, residual)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got - expected).abs().max() <= PRODUCT_BOUNDS[precision] * expected.abs().max()
    # the fused forms (oneDNN post-ops where the kind has them) compute the same as the product and then the op
    product = got.view(6, 40)
    torch.testing.assert_close(gelu, nn.functional.gelu(product, approximate="tanh"), rtol=0, atol=1e-5)
    torch.testing.assert_close(added, residual + product, rtol=0, atol=1e-5)


def test_a_precision_is_refused_for_a_model_that_is_not_float32():
    with pytest.raises(ValueError, match="float16 products are for a float32 model, and this one is bfloat16"):
        pack_linears(nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16), "float16")
