"""Rotary positions, grouped-query attention and heads of their own width: the rotation itself,
positions across cache calls and padding, and what the KV cache holds."""

import dataclasses
import math

import pytest
import torch

from errors import ConfigError
from model import GPT, GPTConfig, generate, left_pad
from model.attention import Rotary
from model.rope import default_frequencies, rope_frequencies
from tests.conftest import tiny_model
from trainer.config import load_config

VOCAB = 50
BLOCK = 32
MODERN = {"pos_emb": "rope", "n_kv_head": 1, "qk_norm": True, "norm": "rmsnorm", "mlp": "relu2"}


def test_rope_turns_each_feature_pair_by_position_times_its_frequency():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(1, 2, 1, 4)  # (B, T, H, D): positions 0 and 1, one head
    rotated = Rotary(default_frequencies(base=100.0, dim=4))(torch.tensor([[0, 1]]))(x)
    assert torch.equal(rotated[0, 0, 0], x[0, 0, 0])  # position 0: no turn
    # D = 4: pairs (x0, x2) and (x1, x3) turn by 1 * 100^0 = 1 and 1 * 100^(-2/4) = 0.1 radians
    c1, s1, c2, s2 = math.cos(1.0), math.sin(1.0), math.cos(0.1), math.sin(0.1)
    expected = [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 1 * s1 + 3 * c1, 2 * s2 + 4 * c2]
    torch.testing.assert_close(rotated[0, 1, 0], torch.tensor(expected))


def test_rope_scores_depend_only_on_the_distance_between_query_and_key():
    rotary = Rotary(default_frequencies(base=10000.0, dim=8))
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=generator)
    near = (rotary(torch.tensor([[7]]))(q) * rotary(torch.tensor([[4]]))(k)).sum()
    far = (rotary(torch.tensor([[20]]))(q) * rotary(torch.tensor([[17]]))(k)).sum()
    torch.testing.assert_close(near, far)
    assert not torch.allclose(near, (rotary(torch.tensor([[7]]))(q) * rotary(torch.tensor([[5]]))(k)).sum())


def test_rope_positions_continue_across_cache_calls():
    """Three cached calls of 5, 1 and 4 tokens give the logits of one pass over all 10: the keys in
    the cache were rotated by their own positions, the new queries by theirs."""
    model = tiny_model(VOCAB, BLOCK, **MODERN)
    idx = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    full, _ = model(idx)
    cache = model.new_cache(2)
    pieces = [model(idx[:, a:b], cache=cache)[0] for a, b in ((0, 5), (5, 6), (6, 10))]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("static", [False, True], ids=["written-slots", "static"])
def test_rope_and_gqa_padded_rows_give_the_logits_of_each_row_alone(static):
    model = tiny_model(VOCAB, BLOCK, **MODERN)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    batch, pad = left_pad(prompts)
    pad = torch.tensor(pad)
    cache = model.new_cache(len(prompts), static=static)
    logits, _ = model(batch, cache=cache, pad=pad)
    next_logits, _ = model(torch.full((len(prompts), 1), 3), cache=cache, pad=pad)
    logits = torch.cat([logits, next_logits], dim=1)
    for row, ids in enumerate(prompts):
        alone, _ = model(torch.tensor([ids + [3]]))
        torch.testing.assert_close(logits[row, pad[row] :], alone[0], rtol=0, atol=1e-5)


def test_rope_and_gqa_batched_samples_equal_samples_drawn_alone():
    model = tiny_model(VOCAB, BLOCK, **MODERN)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [42]]
    batch, pad = left_pad(prompts)
    together = torch.stack(list(generate(model, batch, 12, temperature=0, pad=pad)), dim=1)
    for row, ids in enumerate(prompts):
        alone = torch.stack(list(generate(model, torch.tensor([ids]), 12, temperature=0)), dim=1)
        assert torch.equal(together[row], alone[0]), row


def test_n_kv_head_equal_to_n_head_is_exactly_multi_head_attention():
    implicit = tiny_model(VOCAB, BLOCK)  # n_kv_head = 0: n_head
    explicit = tiny_model(VOCAB, BLOCK, n_kv_head=2)
    for (name, a), b in zip(implicit.state_dict().items(), explicit.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    assert torch.equal(implicit(idx)[0], explicit(idx)[0])


def test_head_dim_equal_to_n_embd_over_n_head_is_exactly_the_default():
    implicit = tiny_model(VOCAB, BLOCK, pos_emb="rope")  # head_dim = 0: 32 / 2
    explicit = tiny_model(VOCAB, BLOCK, pos_emb="rope", head_dim=16)
    for (name, a), b in zip(implicit.state_dict().items(), explicit.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    assert torch.equal(implicit(idx)[0], explicit(idx)[0])


@pytest.mark.parametrize("head_dim", [4, 12])
def test_heads_of_their_own_width_project_from_and_back_to_n_embd(head_dim):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, n_kv_head=2, qk_norm=True)
    model = GPT(dataclasses.replace(config, pos_emb="rope", head_dim=head_dim))
    attn = model.transformer.h[0].attn
    assert (attn.c_attn.in_features, attn.c_attn.out_features) == (32, 4 * head_dim + 2 * 2 * head_dim)
    assert (attn.c_proj.in_features, attn.c_proj.out_features) == (4 * head_dim, 32)
    assert tuple(attn.q_norm.normalized_shape) == tuple(attn.k_norm.normalized_shape) == (head_dim,)
    assert all(k.shape == (3, 2, BLOCK, head_dim) for k in model.new_cache(3).k)
    assert 2 * model.rotary.inv_freq.numel() == head_dim


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_the_cache_holds_n_kv_head_heads(n_kv_head):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, n_kv_head=n_kv_head))
    cache = model.new_cache(3)
    assert all(k.shape == (3, n_kv_head, BLOCK, 8) for k in cache.k + cache.v)
    assert model.transformer.h[0].attn.c_attn.out_features == 32 + 2 * n_kv_head * 8


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["--model.pos_emb=rope", "--model.n_embd=96", "--model.n_head=32"],
            r"^model.pos_emb='rope' rotates pairs of features, but head_dim = n_embd / n_head = 3 is odd",
        ),
        (
            ["--model.pos_emb=rope", "--model.head_dim=5"],
            r"^model.pos_emb='rope' rotates pairs of features, but head_dim=5 is odd \(choose an even one\)$",
        ),
        (["--model.head_dim=-8"], r"^model.head_dim=-8 must be a positive width, or 0 for n_embd / n_head$"),
        (["--model.n_kv_head=5"], r"^model.n_kv_head=5 does not divide n_head=12 "),
        (["--model.pos_emb=alibi"], r"^model.pos_emb='alibi' is not one of learned, rope$"),
        (["--model.rope_base=1"], r"^model.rope_base=1.0 must be greater than 1$"),
        (["--model.rope_scaling=linear"], r"^model.rope_scaling='linear' is not one of none, llama3, yarn$"),
        (
            ["--model.pos_emb=rope", "--model.rope_scaling=yarn", "--model.rope_factor=4"],
            r"^model.rope_original_context=0 must be the positive context length the model was pretrained with",
        ),
        (
            ["--model.pos_emb=rope", "--model.rope_scaling=llama3", "--model.rope_factor=0.5"],
            r"^model.rope_factor=0.5 must be at least 1 with rope_scaling='llama3'",
        ),
        (
            [
                "--model.rope_scaling=llama3",
                "--model.rope_factor=8",
                "--model.rope_original_context=64",
                "--model.rope_low_freq_factor=4",
                "--model.rope_high_freq_factor=1",
            ],
            r"^model.rope_low_freq_factor=4.0 and rope_high_freq_factor=1.0 must be positive, the low one the smaller",
        ),
        (
            [
                "--model.rope_scaling=yarn",
                "--model.rope_factor=8",
                "--model.rope_original_context=64",
                "--model.rope_beta_fast=0.5",
            ],
            r"^model.rope_beta_slow=1.0 and rope_beta_fast=0.5 must be positive numbers of turns, the slow",
        ),
    ],
)
def test_bad_position_and_head_values_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.slow
def test_rope_model_compiles_to_one_graph_with_the_eager_logits():
    """The rotation a RoPE model hands its layers (a function built once per forward pass) traces
    into a single compiled graph."""
    model = tiny_model(VOCAB, BLOCK, **MODERN)
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    eager, _ = model(idx)
    compiled, _ = torch.compile(model, fullgraph=True)(idx)
    assert (compiled - eager).abs().max().item() < 1e-5


# the stretched RoPEs of published checkpoints (their config.json's rope_scaling), and YaRN's optional keys
STRETCHED = {
    # Llama-3.2-1B: 32 heads of 64, theta 500000, factor 32 over 8192 positions
    "llama3-llama-3.2-1b": (
        dict(n_embd=2048, n_head=32, rope_base=500000.0, block_size=131072),
        dict(rope_scaling="llama3", rope_factor=32.0, rope_original_context=8192),
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
    # Llama-3.1-8B: heads of 128, factor 8
    "llama3-llama-3.1-8b": (
        dict(n_embd=4096, n_head=32, rope_base=500000.0, block_size=131072),
        dict(rope_scaling="llama3", rope_factor=8.0, rope_original_context=8192),
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
    # Qwen2.5-0.5B-Instruct with its model card's 128K setting
    "yarn-qwen2.5-0.5b": (
        dict(n_embd=896, n_head=14, rope_base=1000000.0, block_size=131072),
        dict(rope_scaling="yarn", rope_factor=4.0, rope_original_context=32768),
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "yarn-betas-untruncated-attention-factor": (
        dict(n_embd=512, n_head=8, rope_base=10000.0, block_size=16384),
        dict(rope_scaling="yarn", rope_factor=8.0, rope_original_context=2048, rope_beta_fast=16.0,
             rope_beta_slow=2.0, rope_truncate=False, rope_attention_factor=1.25),
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0,
         "beta_slow": 2.0, "truncate": False, "attention_factor": 1.25},
    ),
}  # fmt: skip


@pytest.mark.parametrize("key", STRETCHED)
def test_stretched_rope_tables_are_transformers_own_bit_for_bit(key):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    sizes, ours, theirs = STRETCHED[key]
    config = GPTConfig(n_layer=1, vocab_size=VOCAB, pos_emb="rope", **sizes, **ours)
    reference = transformers.LlamaConfig(
        hidden_size=config.n_embd, num_attention_heads=config.n_head, max_position_embeddings=config.block_size,
        rope_parameters={"rope_theta": config.rope_base, **theirs},
    )  # fmt: skip
    inv_freq, scale = rope_frequencies(config)
    expected, expected_scale = ROPE_INIT_FUNCTIONS[theirs["rope_type"]](reference)
    assert torch.equal(inv_freq, expected) and scale == expected_scale


@pytest.mark.parametrize("base, head_dim", [(10000.0, 64), (500000.0, 128), (1000000.0, 64), (100000.0, 64)])
def test_the_plain_rope_table_is_transformers_own_bit_for_bit(base, head_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    reference = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": base}
    )
    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(reference)
    assert torch.equal(default_frequencies(base, head_dim), expected)


def test_yarn_scales_every_score_by_the_square_of_its_attention_factor():
    """YaRN's cos and sin are multiplied by its factor: a rotated query and key each grow by it, so
    their dot product grows by its square (transformers scales the logits so, llama.cpp too)."""
    plain = Rotary(default_frequencies(10000.0, 8))
    scaled = Rotary(default_frequencies(10000.0, 8), scale=1.25)
    q, k = torch.randn(2, 1, 1, 1, 8, generator=torch.Generator().manual_seed(0))
    at = (torch.tensor([[9]]), torch.tensor([[4]]))
    score = (plain(at[0])(q) * plain(at[1])(k)).sum()
    torch.testing.assert_close((scaled(at[0])(q) * scaled(at[1])(k)).sum(), 1.25**2 * score)


def test_a_stretched_rope_stays_in_float32_when_the_model_is_cast_to_bfloat16():
    model = tiny_model(VOCAB, BLOCK, pos_emb="rope", rope_scaling="llama3", rope_factor=8.0, rope_original_context=8)
    table = model.rotary.inv_freq.clone()
    model.to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32 and torch.equal(model.rotary.inv_freq, table)
    assert "inv_freq" not in "".join(model.state_dict())


def test_qkv_bias_gives_the_queries_keys_and_values_alone_a_bias():
    model = tiny_model(VOCAB, BLOCK, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True)
    biases = {name for name, _ in model.named_parameters() if name.endswith("bias")}
    assert biases == {f"transformer.h.{i}.attn.c_attn.bias" for i in range(model.config.n_layer)}
    assert model.config.num_params() == sum(p.numel() for p in model.parameters())
