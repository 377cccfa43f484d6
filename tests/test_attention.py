import math

import pytest
import torch

from model import attention, causal_mask
from model.attention import SPELLED_OUT_MAX_LEN


def weights_of(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The attention weights, read through the real attention function: with the identity as the
    values, output row i is weight row i."""
    kv_len = k.size(-2)
    identity = torch.eye(kv_len, dtype=q.dtype).expand(*k.shape[:-2], kv_len, kv_len)
    return attention(q, k, identity, mask=mask)


def reference_attention(q, k, v, allowed):
    """Attention written out by hand: -inf on masked scores, then softmax."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v


def test_causal_mask_lets_row_i_see_keys_up_to_i():
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(causal_mask(4, 4), expected)


def test_causal_mask_for_queries_after_a_cached_prefix():
    # two new queries at positions 3 and 4 of five: the first sees keys 0..3, the second all five
    expected = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)


def test_equal_scores_give_uniform_weights_over_the_past():
    # all scores equal: row i spreads its weight evenly over keys 0..i, and gives 0 to the future
    q = torch.zeros(1, 1, 4, 8)
    k = torch.zeros(1, 1, 4, 8)
    weights = weights_of(q, k)[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1 / 2, 1 / 2, 0, 0],
            [1 / 3, 1 / 3, 1 / 3, 0],
            [1 / 4, 1 / 4, 1 / 4, 1 / 4],
        ]
    )
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)


def test_hand_computed_scores_give_softmax_weights():
    # D = 1, scale 1/sqrt(1) = 1: score(i, j) = q_i * k_j
    q = torch.tensor([1.0, 2.0, 0.5]).view(1, 1, 3, 1)
    k = torch.tensor([0.0, 1.0, 2.0]).view(1, 1, 3, 1)
    weights = weights_of(q, k)[0, 0]
    e = math.exp
    expected = torch.tensor(
        [
            [1.0, 0.0, 0.0],  # row 0 sees only key 0
            [e(0) / (e(0) + e(2)), e(2) / (e(0) + e(2)), 0.0],  # scores 0, 2
            [e(0) / (e(0) + e(0.5) + e(1)), e(0.5) / (e(0) + e(0.5) + e(1)), e(1) / (e(0) + e(0.5) + e(1))],
        ]
    )
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("q_len,kv_len", [(6, 6), (1, 6), (3, 6)])
def test_masked_weights_are_exactly_zero_and_rows_sum_to_one(q_len, kv_len):
    torch.manual_seed(0)
    q = torch.randn(2, 3, q_len, 8) * 2  # spread-out scores: masked weights must still be exactly 0
    k = torch.randn(2, 3, kv_len, 8) * 2
    weights = weights_of(q, k)
    allowed = causal_mask(q_len, kv_len)
    assert torch.all(weights[..., ~allowed] == 0)
    assert torch.all(weights[..., allowed] > 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, q_len), rtol=0, atol=1e-6)


def test_fused_causal_path_matches_hand_written_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
    expected = reference_attention(q, k, v, causal_mask(10, 10))
    torch.testing.assert_close(attention(q, k, v), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(attention(q, k, v, mask=causal_mask(10, 10)), expected, rtol=0, atol=1e-5)


def test_queries_after_a_prefix_match_the_last_rows_of_full_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    full = attention(q, k, v)
    for new in (1, 3):
        torch.testing.assert_close(attention(q[:, :, -new:], k, v), full[:, :, -new:], rtol=0, atol=1e-6)


def test_combined_causal_and_padding_mask_hides_padded_keys():
    torch.manual_seed(0)
    q = torch.randn(2, 1, 5, 8)
    k = torch.randn(2, 1, 5, 8)
    # left padding: the first two positions of sequence 0 are padding
    key_is_real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = causal_mask(5, 5) & key_is_real[:, None, None, :]  # (B, 1, T, T)
    mask = mask | torch.eye(5, dtype=torch.bool)  # a padded query may see itself, so no row is empty
    weights = weights_of(q, k, mask=mask)
    assert torch.all(weights[0, 0, 2:, :2] == 0)  # real tokens ignore the padding
    torch.testing.assert_close(weights[1], weights_of(q[1:], k[1:])[0], rtol=0, atol=1e-6)


def bfloat16_leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape).bfloat16().requires_grad_() for shape in shapes]


@pytest.mark.parametrize("window", [None, 3])
def test_bfloat16_training_attention_on_a_cpu_is_spelled_out_and_agrees_with_float32(monkeypatch, window):
    q, k, v = bfloat16_leaves((2, 4, 12, 16), (2, 2, 12, 16), (2, 2, 12, 16))  # grouped-query: 2 key heads
    mask = None if window is None else causal_mask(12, 12) & ~causal_mask(12, 12).tril(-window)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = attention(q32, k32, v32, mask)
    expected.square().sum().backward()

    def fused(*args, **kwargs):
        raise AssertionError("a short bfloat16 training sequence on a CPU went to SDPA")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fused)
    out = attention(q, k, v, mask)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.02)
    for ours, reference in ((q, q32), (k, k32), (v, v32)):
        torch.testing.assert_close(ours.grad.float(), reference.grad, rtol=0.05, atol=0.05)


def test_spelled_out_attention_takes_no_gradient_from_later_keys_or_values():
    q, k, v = bfloat16_leaves((1, 2, 10, 8), (1, 2, 10, 8), (1, 2, 10, 8))
    t = 4
    attention(q, k, v)[:, :, t].float().sum().backward()
    assert torch.all(k.grad[:, :, t + 1 :] == 0) and torch.all(v.grad[:, :, t + 1 :] == 0)
    assert torch.all(v.grad[:, :, : t + 1].abs().sum(-1) > 0)


def test_long_bfloat16_sequences_and_inference_stay_with_the_fused_kernel(monkeypatch):
    calls = []
    fused = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k)
    )
    (long_q,) = bfloat16_leaves((1, 1, SPELLED_OUT_MAX_LEN + 1, 8))
    attention(long_q, long_q, long_q)
    with torch.no_grad():
        (short_q,) = bfloat16_leaves((1, 1, 8, 8))
        attention(short_q, short_q, short_q)
    assert len(calls) == 2
