"""The CPU's one-token decoding step computes what the model computes: the same logits and, in float32,
the same greedy tokens as the model's own step (batch 1, left-padded batches, contexts that slide), for
every model it covers; a model it does not cover decodes with its own step and says why; products in
reduced precision stay within their stated bounds of float32's."""

import copy
import mmap

import pytest
import torch

from errors import UserError
from inference import decode_step, packed_linear
from inference.decode_step import (
    COMPILE_OPTIONS,
    STREAMED,
    DecodeStep,
    check_precision,
    one_query_attention,
    prepare_decoding,
    step_unsupported,
)
from inference.packed_linear import (
    INT8_ROW_GROUPS,
    INT8_WIDEN_ROWS,
    InferenceLinear,
    Int8Linear,
    StreamedLinear,
    bfloat16_instructions,
    pack_linears,
    packing_unavailable,
    precision_unavailable,
    stream_linears,
)
from model import attention, generate, left_pad
from tests.conftest import tiny_model
from tests.test_families import trained_like

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    packing_unavailable(CPU, torch.float32) is not None, reason=str(packing_unavailable(CPU, torch.float32))
)

VOCAB = 50
BLOCK = 32
MODELS = {  # the switches the step computes, in the combinations of the families and the quickstart
    "gpt2": {},
    "quickstart": dict(bias=False, pos_emb="rope", qk_norm=True, mlp="swiglu", n_kv_head=1),
    "llama": dict(bias=False, pos_emb="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1, tie_embeddings=False),
    "relu2-softcap": dict(mlp="relu2", logit_softcap=15.0),
    "wide-heads": dict(head_dim=24, pos_emb="rope"),
    "prefix-lm": dict(attn_prefix_lm=True),
}
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
# how far each precision's logits may lie from float32's, as a share of the largest float32 logit, on these
# tiny models (docs/sampling.md): float16 weights round to 11 significant bits, bfloat16 weights and the
# products' inputs and outputs to 8, int8 weights to 1/254 of their row's largest, inputs and outputs to 8 bits
PRECISION_BOUNDS = {"float16": 3e-3, "bfloat16": 3e-2, "int8": 6e-2}


def model_of(switches: dict, seed: int = 3) -> torch.nn.Module:
    """A tiny model with its weights moved off their start, so that greedy tokens depend on all of them."""
    return trained_like(tiny_model(VOCAB, BLOCK, **switches), seed)


def greedy(model, prompts: list[list[int]], new_tokens: int, step=None) -> torch.Tensor:
    batch, pad = left_pad(prompts)
    return torch.stack(list(generate(model, batch, new_tokens, temperature=0, pad=pad, step=step)), dim=1)


def prefilled(model, rows: int = 3):
    """A cache holding PROMPTS, and their padding, after the model's own prefill."""
    batch, pad = left_pad(PROMPTS[:rows])
    pad = torch.tensor(pad)
    cache = model.new_cache(rows, 24)
    with torch.no_grad():
        model(batch, cache=cache, pad=pad)
    return cache, pad


@pytest.mark.parametrize("switches", MODELS.values(), ids=MODELS.keys())
def test_decode_step_gives_the_models_logits_and_fills_the_cache_as_it_does(switches):
    model = pack_linears(model_of(switches))
    step = DecodeStep(model)
    theirs, pad = prefilled(model)
    ours = copy.deepcopy(theirs)
    with torch.no_grad():
        for token in ([[3], [4], [9]], [[8], [0], [1]]):
            expected, _ = model(torch.tensor(token), cache=theirs, pad=pad)
            got, _ = step(torch.tensor(token), cache=ours, pad=pad)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert ours.pos == theirs.pos
    for k_ours, k_theirs in zip(ours.k + ours.v, theirs.k + theirs.v, strict=True):
        torch.testing.assert_close(k_ours, k_theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("switches", MODELS.values(), ids=MODELS.keys())
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_step_greedy_tokens_equal_the_models_own_packed_or_not(switches, rows):
    """Past block_size tokens, so that the context slides and is re-encoded by the model in between."""
    model = model_of(switches)
    packed = pack_linears(copy.deepcopy(model))
    expected = greedy(model, PROMPTS[:rows], 2 * BLOCK)
    assert torch.equal(greedy(packed, PROMPTS[:rows], 2 * BLOCK), expected)
    assert torch.equal(greedy(packed, PROMPTS[:rows], 2 * BLOCK, step=DecodeStep(packed)), expected)


def test_the_step_is_prepared_for_the_models_it_computes_and_said_so():
    model = model_of(MODELS["quickstart"])
    decoding = prepare_decoding(model, CPU, batch_size=4)
    assert isinstance(decoding.step, DecodeStep)
    assert decoding.description == "linear layers packed for oneDNN, one-token steps by inference/decode_step.py"


@pytest.mark.parametrize(
    "switches, key",
    [(dict(attn_window=8), "model.attn_window"), (dict(unet_skips=True), "model.unet_skips"),
     (dict(bigram_embed=17), "model.bigram_embed"), (dict(attn_block=4), "model.attn_block")],
)  # fmt: skip
def test_a_model_the_step_does_not_compute_decodes_with_its_own_step_and_says_which(switches, key):
    model = model_of(switches)
    expected = greedy(pack_linears(copy.deepcopy(model)), [PROMPTS[1]], 20)
    decoding = prepare_decoding(model, CPU)
    assert decoding.step is None
    assert decoding.description == (
        f"linear layers packed for oneDNN, the model's own one-token steps (the decoding step does not compute {key})"
    )
    assert torch.equal(greedy(model, [PROMPTS[1]], 20, step=decoding.step), expected)


def test_the_step_refuses_a_model_whose_layers_are_not_packed():
    model = model_of({})
    assert step_unsupported(model) == "nn.Linear layers (it calls packed products)"
    with pytest.raises(ValueError, match="does not compute nn.Linear layers"):
        DecodeStep(model)


def test_without_the_cache_there_is_no_step_and_compile_leaves_a_model_the_step_does_not_compute_its_own():
    assert prepare_decoding(model_of({}), CPU, use_cache=False).step is None
    compiled = prepare_decoding(model_of(dict(attn_window=8)), CPU, compile=True)
    assert (compiled.step, compiled.description) == (
        None,
        "nn.Linear products (torch.compile cannot trace packed layers), the model's own one-token steps (the "
        "decoding step does not compute model.attn_window)",
    )
    with pytest.raises(ValueError, match="compile and step both replace the one-token step"):
        next(generate(model_of({}), torch.tensor([[1, 2]]), 2, compile=True, step=lambda *a, **k: None))


def test_compiled_step_greedy_tokens_equal_the_eager_steps():
    """Past block_size tokens (the context slides and is re-encoded eagerly in between); the llama recipe
    has grouped-query heads, and three rows are left-padded; wide heads rotate by more frequencies than
    Inductor writes into its code. One compilation serves every length."""
    options = dict(COMPILE_OPTIONS)
    for name, rows in [("gpt2", 1), ("quickstart", 1), ("wide-heads", 1), ("llama", 3)]:
        model = model_of(MODELS[name])
        expected = greedy(pack_linears(copy.deepcopy(model)), PROMPTS[:rows], 2 * BLOCK, step=None)
        decoding = prepare_decoding(model, CPU, compile=True)
        assert decoding.description == STREAMED["float32"]
        layers = [m for m in model.modules() if isinstance(m, InferenceLinear)]
        assert layers and all(isinstance(m, StreamedLinear) for m in layers)
        assert COMPILE_OPTIONS == options  # AOTInductor is given a copy of them
        assert torch.equal(greedy(model, PROMPTS[:rows], 2 * BLOCK, step=decoding.step), expected), (name, rows)
        # other lengths, another cache (of other slots): one compilation
        assert torch.equal(greedy(model, PROMPTS[:rows], 5, step=decoding.step), expected[:, :5]), (name, rows)
        assert len(decoding.step.compiled.programs) == 1
        assert not any("inv_freq" in buffer for buffer, _ in model.named_buffers())  # a plain attribute again


def test_each_compiled_step_computes_its_own_model_and_a_later_run_loads_what_an_earlier_one_compiled(
    monkeypatch, tmp_path
):
    """Two models that differ only in a constant (the logits' cap) compile to two libraries, each
    computing its own model; a third with the first one's shape but weights of its own (as a later run
    of sample.py, after more training) loads the first one's library from the folder instead of
    compiling it, and computes its own weights."""
    monkeypatch.setattr(decode_step, "package_folder", lambda: tmp_path)
    compile_and_package = torch._inductor.aoti_compile_and_package
    compiled = []
    monkeypatch.setattr(
        torch._inductor, "aoti_compile_and_package", lambda *a, **k: compiled.append(1) or compile_and_package(*a, **k)
    )
    for cap, seed in ((2.0, 3), (30.0, 3), (2.0, 4)):
        model = model_of(dict(MODELS["relu2-softcap"], logit_softcap=cap), seed)
        reference = pack_linears(copy.deepcopy(model))
        decoding = prepare_decoding(model, CPU, compile=True)
        theirs, pad = prefilled(reference, rows=1)
        ours = copy.deepcopy(theirs)
        with torch.no_grad():
            expected, _ = DecodeStep(reference)(torch.tensor([[3]]), cache=theirs, pad=pad)
            got, _ = decoding.step(torch.tensor([[3]]), cache=ours, pad=pad)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4, msg=f"logit_softcap={cap}, seed {seed}")
        torch.testing.assert_close(ours.k[0], theirs.k[0], rtol=0, atol=1e-5)  # the new key, written in place
    assert len(compiled) == 2
    assert len(list(tmp_path.glob("*.pt2"))) == 2


def test_a_step_over_an_empty_cache_is_computed_eagerly_and_compiles_nothing():
    model = model_of(MODELS["gpt2"])
    decoding = prepare_decoding(model, CPU, compile=True)
    reference = DecodeStep(model, one_query_attention)
    ours, theirs = model.new_cache(1, 8), model.new_cache(1, 8)
    with torch.no_grad():
        got, _ = decoding.step(torch.tensor([[3]]), cache=ours)
        expected, _ = reference(torch.tensor([[3]]), cache=theirs)
    assert torch.equal(got, expected)
    assert not decoding.step.compiled.programs


def test_a_compiled_step_reads_the_models_weights_where_they_lie():
    """The compiled library holds no copy of the weights (for GPT-2 124M in float32, 500 MB): it reads
    the model's own tensors, so a weight changed in place after compilation changes the logits."""
    model = model_of(MODELS["gpt2"])
    decoding = prepare_decoding(model, CPU, compile=True)
    cache, pad = prefilled(model, rows=1)
    with torch.no_grad():
        before, _ = decoding.step(torch.tensor([[3]]), cache=copy.deepcopy(cache), pad=pad)
        model.lm_head.weight[7] += 1.0  # the output layer's row of token 7, in its streamed copy
        expected, _ = DecodeStep(model, one_query_attention)(torch.tensor([[3]]), cache=copy.deepcopy(cache), pad=pad)
        after, _ = decoding.step(torch.tensor([[3]]), cache=copy.deepcopy(cache), pad=pad)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-4)


def test_compile_in_a_reduced_precision_without_the_cache_is_refused():
    why = r"without the KV cache \(--no-cache\) there are no one-token steps"
    with pytest.raises(UserError, match=f"--precision=int8 with --compile: {why}"):
        prepare_decoding(model_of({}), CPU, "int8", compile=True, use_cache=False)


def test_with_compile_several_rows_decode_with_the_eager_step_and_say_so():
    model = model_of({})
    expected = greedy(pack_linears(copy.deepcopy(model)), PROMPTS, 2 * BLOCK)
    decoding = prepare_decoding(model, CPU, batch_size=3, compile=True)
    assert decoding.description == (
        "linear layers packed for oneDNN, one-token steps by inference/decode_step.py (--compile is for one row at a "
        "time: 3 rows decode with the eager step)"
    )
    assert not any(isinstance(m, StreamedLinear) for m in model.modules())
    assert torch.equal(greedy(model, PROMPTS, 2 * BLOCK, step=decoding.step), expected)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("hidden", [False, True], ids=["all-keys", "padding-hidden"])
@pytest.mark.parametrize("head_size", [16, 12], ids=["scale-exact", "scale-rounded"])
def test_one_query_attention_equals_attention(kv_heads, hidden, head_size):
    """Its softmax spelled out (the query scaled first, normalised after the values' sum), in float32's rounding."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, n, length, head_size) for n, length in ((4, 1), (kv_heads, 9), (kv_heads, 9)))
    mask = (torch.arange(9) >= torch.tensor([0, 2, 5])[:, None])[:, None, None, :] if hidden else None
    torch.testing.assert_close(one_query_attention(q, k, v, mask), attention(q, k, v, mask))


@pytest.mark.parametrize("kv_heads", [12, 3])
def test_compiled_one_query_attention_reads_the_cache_without_storing_products(kv_heads):
    """Compiled as the step compiles it, each head's scores and weighted values are summed in the loops
    that read the keys and values: two parallel loops in all (scores with their softmax, the values),
    where a multiplication then a sum stored every key's products first and took four."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    # GPT-2's heads over 80 keys, for two threads: loops this large are split between threads
    q, k, v = torch.randn(1, 12, 1, 64), torch.randn(1, kv_heads, 80, 64), torch.randn(1, kv_heads, 80, 64)
    torch._dynamo.reset()
    options = {**COMPILE_OPTIONS, "cpp.threads": 2}
    compiled = torch.compile(one_query_attention, dynamic=True, options=options)
    y, (code,) = run_and_get_code(compiled, q, k, v)
    torch.testing.assert_close(y, attention(q, k, v))
    assert code.count("#pragma omp for") == 2, code


def rounded_as_stored(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A copy of model whose linear weights are rounded as stream_linears stores them in precision, in float32."""
    model = copy.deepcopy(model)
    for linear in [module for module in model.modules() if isinstance(module, torch.nn.Linear)]:
        if precision == "int8":
            layer = Int8Linear(linear)
            weight = layer.weight_int8[:, : linear.in_features].float() * layer.scale.float()[:, None]
        else:
            weight = linear.weight.to(getattr(torch, precision)).float()
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return model


# the products outside a compiled graph (the prompt's) round bfloat16 and int8's inputs to bfloat16, and one row's
# inputs and outputs to float16 for float16 weights (more rows widen them), as a share of the largest output
PROMPT_BOUNDS = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 2e-2, "int8": 2e-2}


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16", "int8"])
def test_streamed_products_compiled_sum_in_float32_from_weights_rounded_as_stored_in_huge_page_aligned_memory(
    precision,
):
    torch.manual_seed(0)
    linears = torch.nn.Sequential(torch.nn.Linear(48, 80), torch.nn.Linear(80, 40, bias=False))
    model = stream_linears(copy.deepcopy(linears), precision)
    x = torch.randn(1, 48)
    with torch.no_grad():
        expected = rounded_as_stored(linears, precision)(x)
        torch.testing.assert_close(torch.compile(model)(x), expected)
        error = (model(x) - expected).abs().max()
        assert error <= PROMPT_BOUNDS[precision] * expected.abs().max()
        if precision != "float32":  # the product ran in the reduced precision, not on widened weights
            assert error > 1e-5 * expected.abs().max()
        if precision == "float16":  # past float16's range the weight is widened: float32's sums
            big, bound = x * 1e5, 1e-6
            expected_big = rounded_as_stored(linears, precision)(big)
            assert (model(big) - expected_big).abs().max() <= bound * expected_big.abs().max()
        rows = torch.randn(1, 3, 48)  # a prompt of three rows: float32 and float16 within float32's rounding
        rows_bound = 1e-6 if precision in ("float32", "float16") else PROMPT_BOUNDS[precision]
        expected = rounded_as_stored(linears, precision)(rows)
        assert (model(rows) - expected).abs().max() <= rows_bound * expected.abs().max()
    weights = [layer.weight_int8 if precision == "int8" else layer.weight for layer in model]
    assert weights[0].dtype == getattr(torch, precision)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # one map, from a huge page's boundary
        assert weights[0].data_ptr() % (1 << 21) == 0
        assert weights[1].untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()


@pytest.mark.parametrize("precision", ["bfloat16", "float16", "int8"])
def test_compiled_step_in_a_reduced_precision_computes_the_model_whose_weights_and_cache_are_rounded(precision):
    """The streamed products widen the stored weights inside their loops and sum in float32, and the KV
    cache keeps keys and values in bfloat16, widened as attention reads them: the compiled step's logits
    are the float32 model's with its linear weights rounded as stored and its cache in bfloat16 (the
    quickstart recipe: its SwiGLU's width is no multiple of 16, which int8 pads)."""
    model = model_of(MODELS["quickstart"])
    reference = rounded_as_stored(model, precision)
    reference.cache_dtype = torch.bfloat16
    decoding = prepare_decoding(model, CPU, precision, compile=True)
    assert decoding.description == STREAMED[precision]
    assert model.new_cache(1).k[0].dtype == torch.bfloat16
    theirs, pad = prefilled(reference, rows=1)  # (the prompt's own products round otherwise: not compared here)
    ours = copy.deepcopy(theirs)
    with torch.no_grad():
        for token in ([[3]], [[8]]):
            expected, _ = reference(torch.tensor(token), cache=theirs, pad=pad)
            got, _ = decoding.step(torch.tensor(token), cache=ours, pad=pad)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_a_cache_in_fewer_bytes_keeps_keys_rounded_and_gives_them_back_in_the_models_dtype():
    """A float32 model's cache in bfloat16 holds its keys and values rounded, and attention reads them
    widened to float32: the logits move by the rounding alone, and only where a cached key is read."""
    model = model_of(MODELS["gpt2"])
    exact = model.new_cache(1, 24)
    model.cache_dtype = torch.bfloat16
    rounded, static = model.new_cache(1, 24), model.new_cache(1, 24, static=True)
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected, _ = model(prompt, cache=exact)
        got, _ = model(prompt, cache=rounded)
        torch.testing.assert_close(model(prompt, cache=static)[0], got)  # a static cache (every slot, masked) too
    assert rounded.k[0].dtype == rounded.v[-1].dtype == torch.bfloat16 and got.dtype == torch.float32
    assert torch.equal(rounded.k[0], exact.k[0].to(torch.bfloat16))  # the first layer's keys, as written
    assert 0 < (got - expected).abs().max() <= 0.05 * expected.abs().max()
    rounded.claim(1)
    keys, values = rounded.update(0, exact.k[0][:, :, :1], exact.v[0][:, :, :1])
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys[:, :, -1:], exact.k[0][:, :, :1].to(torch.bfloat16).float())  # the new key: rounded
    assert torch.equal(values[:, :, -1:], exact.v[0][:, :, :1].to(torch.bfloat16).float())


@pytest.mark.parametrize("precision", PRECISION_BOUNDS)
@pytest.mark.parametrize("switches", [MODELS["gpt2"], MODELS["quickstart"]], ids=["gpt2", "quickstart"])
def test_each_precision_decodes_within_its_bound_of_float32(precision, switches):
    if precision_unavailable(CPU, torch.float32, precision) is not None:
        pytest.skip(precision_unavailable(CPU, torch.float32, precision))
    model = model_of(switches)
    reference = copy.deepcopy(model)
    decoding = prepare_decoding(model, CPU, precision)
    assert decoding.step is not None
    cache, pad = prefilled(model)
    expected_cache, _ = prefilled(reference)
    token = torch.tensor([[3], [4], [9]])
    with torch.no_grad():
        expected, _ = reference(token, cache=expected_cache, pad=pad)
        got, _ = decoding.step(token, cache=cache, pad=pad)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max() <= PRECISION_BOUNDS[precision] * expected.abs().max()
    assert (got - expected).abs().max() > 0  # the products did run in another precision


def test_int8_layer_pads_an_input_width_that_is_not_a_multiple_of_16():
    """PyTorch's int8 product reads garbage past a width that is not a multiple of 16 (or crashes)."""
    if precision_unavailable(CPU, torch.float32, "int8") is not None:
        pytest.skip(precision_unavailable(CPU, torch.float32, "int8"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(341, 24)  # the quickstart's SwiGLU c_proj reads 341 features
    x = torch.randn(5, 341)
    with torch.no_grad():
        expected = linear(x)
        got = Int8Linear(linear)(x)
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("widens", [True, False], ids=["bfloat16-instructions", "none"])
@pytest.mark.parametrize("rows", [1, INT8_WIDEN_ROWS - 1, INT8_WIDEN_ROWS, 37])
def test_int8_product_of_many_rows_widens_the_weight_to_bfloat16_where_the_cpu_has_its_instructions(
    rows, widens, monkeypatch
):
    """From INT8_WIDEN_ROWS rows up, on a CPU with bfloat16 instructions, an int8 layer outside a compiled graph
    multiplies the same bfloat16-rounded inputs by its int8 weight widened to bfloat16 (exact), a block of
    weight rows at a time (here 16 of 40, the last block short), and scales each output; fewer rows, and every
    row elsewhere, take PyTorch's int8 product: each route's own result, bit for bit, and both within the int8
    bound of the float32 product, a width padded to a multiple of 16 included."""
    if precision_unavailable(CPU, torch.float32, "int8") is not None:
        pytest.skip(precision_unavailable(CPU, torch.float32, "int8"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(341, 40)
    layer = Int8Linear(linear)
    assert layer.widens == bfloat16_instructions()
    layer.widens = widens  # the bfloat16 product runs on any CPU, emulated where it has no such instructions
    monkeypatch.setattr(packed_linear, "INT8_WIDEN_BLOCK", 16 * 352)  # 16 rows of the padded weight
    x = torch.randn(rows, 341)
    x16 = torch.nn.functional.pad(x.to(torch.bfloat16), (0, layer.padding))
    with torch.no_grad():
        expected, got = linear(x), layer(x)
    if widens and rows >= INT8_WIDEN_ROWS:
        route = torch.nn.functional.linear(x16, layer.weight_int8.to(torch.bfloat16)).float() * layer.scale.float()
    else:
        route = torch.ops.aten._weight_int8pack_mm(x16, layer.weight_int8, layer.scale).float()
    torch.testing.assert_close(got, route + linear.bias.detach(), rtol=0, atol=0)
    assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize(
    "out_features, in_features",
    [(83, 48), (96, 48), (257, 1024), (3, 48)],
    ids=["rows-left-over", "whole-blocks", "one-row-left-wide", "fewer-than-a-block"],
)
def test_compiled_int8_product_sums_four_weight_rows_side_by_side_with_the_same_results(out_features, in_features):
    """Compiled as the step compiles it (for two threads), one row's int8 product sums INT8_ROW_GROUPS weight
    rows in each pass of one loop, an accumulator each (where one row's sum is one chain of additions),
    and every output is the one summed a row at a time, bit for bit, the rows that do not divide evenly
    into blocks included (in a block moved back to end at the last row, not in a loop of their own)."""
    from torch._inductor.utils import run_and_get_code

    if precision_unavailable(CPU, torch.float32, "int8") is not None:
        pytest.skip(precision_unavailable(CPU, torch.float32, "int8"))
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features)
    grouped, alone = Int8Linear(linear), Int8Linear(linear)
    alone.row_groups = 1
    assert grouped.row_groups == INT8_ROW_GROUPS == 4
    x = torch.randn(1, in_features)
    options = {**COMPILE_OPTIONS, "cpp.threads": 2}
    torch._dynamo.reset()
    with torch.no_grad():
        expected, (code_alone,) = run_and_get_code(torch.compile(alone.product, options=options), x)
        got, (code,) = run_and_get_code(torch.compile(grouped.product, options=options), x)
    assert torch.equal(got, expected)
    assert "tmp_acc1_vec" not in code_alone
    side_by_side = out_features >= INT8_ROW_GROUPS
    assert ("tmp_acc3_vec" in code) == side_by_side and "tmp_acc4_vec" not in code, code
    assert code.count("tmp_acc0_vec = at::vec") == 1, code  # one loop sums every row


@pytest.mark.parametrize(
    "device, dtype, reason",
    [
        ("meta", torch.float32, "packing is for CPUs, the model is on meta"),
        ("cpu", torch.bfloat16, "int8 products are for a float32 model, and this one is bfloat16"),
    ],
)
def test_a_precision_that_cannot_apply_is_refused_with_the_reason(device, dtype, reason):
    with pytest.raises(UserError, match=f"--precision=int8 does not apply here: {reason}"):
        check_precision("int8", torch.device(device), dtype)
    check_precision("auto", torch.device(device), dtype)
