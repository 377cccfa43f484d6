"""Masked self-attention.

Every query may attend to the keys its attention pattern allows (by default its own position and
earlier ones, never later ones; model/masks.py holds the patterns): scores for other keys are set to
-inf before the softmax, so their weights are exactly 0 and each row of weights sums to 1 over the
allowed keys. The work is done by `torch.nn.functional.scaled_dot_product_attention` (SDPA), which
picks a fused kernel; `attention_weights` spells the same computation out and returns the weights.
One case takes the spelled-out path instead: training in bfloat16 on a CPU at short context, where
SDPA's kernels are slow to differentiate (`spelled_out_is_faster`).

Options, each chosen when the layer is built: grouped-query attention (fewer key/value heads than
query heads, each shared by a group of queries: the KV cache shrinks by that factor) and QK-norm
(queries and keys normalised per head before their dot product, by the model's kind of norm).
With rotary position embeddings (RoPE: queries and keys rotated by their position, so their dot
product depends on the distance) the model computes the rotation once per forward pass (`Rotary`)
and hands it to every layer; without, it hands them `no_rotation`. With value embeddings (a token
table whose rows join the values of chosen layers, modded-nanogpt's speedrun) a layer mixes its
values with its tokens' rows before they are cached, so that cached decoding reads the mixed ones.

On CUDA, a pattern's mask can instead be a FlexAttention `BlockMask` built from the same rule
(`flex_block_mask`): `flex_attention` then skips the blocks of 128 x 128 scores that the rule blocks
entirely, which is what makes a sliding window or document masking cheaper than full attention.
FlexAttention has no backward pass on a CPU, and no dropout, so those cases use the boolean mask
(by SDPA, or spelled out as above).
"""

import functools
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from .masks import Rule, causal, dense_mask


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (q_len, kv_len) mask, True where a query may attend to a key.

    The queries are the last q_len of kv_len positions (as when new tokens follow a cached
    prefix): query i sits at position kv_len - q_len + i and sees keys 0 .. kv_len - q_len + i.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[None]  # (1, q_len)
    k_pos = torch.arange(kv_len, device=device)[None]  # (1, kv_len)
    return dense_mask(causal, q_pos, k_pos)[0, 0]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention of (B, H, Tq, D) queries over (B, Hkv, Tk, D) keys and values;
    returns (B, H, Tq, D). With Hkv < H (grouped-query attention) each key/value head serves H / Hkv
    consecutive query heads.

    mask: boolean, broadcastable to (B, H, Tq, Tk), True where a query may attend to a key, or a
    FlexAttention BlockMask (CUDA, no dropout). None means causal, with the queries taken as the
    last Tq of the Tk key positions. Every query must be allowed at least one key (the model's masks
    always let a query see itself): a query with none has no weights to normalise (NaN when spelled
    out).
    """
    if isinstance(mask, BlockMask):
        return _compiled_flex_attention()(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
    q_len, kv_len = q.size(-2), k.size(-2)
    gqa = q.size(1) != k.size(1)  # SDPA shares the key/value heads itself, without copying them
    if spelled_out_is_faster(q, k):
        return spelled_out(q, k, v, mask, dropout_p)
    if mask is None and q_len == kv_len:
        # Fast path: the fused kernel applies the causal mask itself and never builds a (T, T)
        # mask. SDPA's is_causal aligns the mask to the top-left corner, which is only right when
        # queries and keys cover the same positions, hence the q_len == kv_len condition.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    if mask is None and q_len == 1:
        # One new token after a cached prefix is the latest position: it may see every key.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
    if mask is None:
        mask = causal_mask(q_len, kv_len, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


# PyTorch's SDPA kernels differentiate bfloat16 slowly on a CPU at short context: forward and
# backward of 16 rows x 4 heads x 32 dims took 2.7x to 2.9x as long by the fused causal kernel as
# spelled out at 128 positions and 1.5x at 192; at 256 the fused kernel was the faster, at 1,024 3.1x
# (bench/attention.py, two threads; docs/benchmarks.md, "The speedrun to the quickstart's
# quality"). It also never holds the (T, T) weights.
SPELLED_OUT_MAX_LEN = 192


def spelled_out(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, dropout_p: float = 0.0
) -> torch.Tensor:
    """`attention` without SDPA: the weights (`attention_weights`) times the values."""
    weights = F.dropout(attention_weights(q, k, mask), dropout_p)
    return weights @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)


def spelled_out_is_faster(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attention of these queries over these keys is faster spelled out than by SDPA: a
    bfloat16 training step on a CPU over at most SPELLED_OUT_MAX_LEN keys."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and q.requires_grad
        and torch.is_grad_enabled()
        and k.size(-2) <= SPELLED_OUT_MAX_LEN
    )


def flex_block_mask(rule: Rule, batch_size: int | None, T: int, device: torch.device) -> BlockMask:
    """The rule as a FlexAttention BlockMask over T queries and T keys at positions 0 .. T - 1.
    batch_size None: the rule does not depend on the row, one mask serves every row."""

    def mask_mod(b, h, q_idx, kv_idx):
        return rule(b, q_idx, kv_idx)

    return create_block_mask(mask_mod, batch_size, None, T, T, device=device)


@functools.cache
def _compiled_flex_attention():
    """flex_attention compiled once: uncompiled, it computes every score and masks them afterwards."""
    return torch.compile(flex_attention)


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weights `attention` applies to the values, (B, H, Tq, Tk): the softmax over keys of the
    scaled scores q.k / sqrt(D), with blocked keys at -inf (so their weights are exactly 0).
    mask: as for `attention`."""
    q_len, kv_len = q.size(-2), k.size(-2)
    if mask is None:
        mask = causal_mask(q_len, kv_len, q.device)
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)  # (B, H, Tk, D): each key head for its group
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def no_rotation(x: torch.Tensor) -> torch.Tensor:
    """The rotation of a model without RoPE: queries and keys stay as they are."""
    return x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with GPT-2's parameter layout (c_attn, c_proj).

    head_dim: the width of one head; n_head * head_dim is n_embd in GPT-2, but may be more or less
    (Qwen3-0.6B: 16 heads of 128 over a residual stream of 1024): c_attn projects n_embd to the
    heads and c_proj projects them back. n_kv_head: key/value heads (0 = n_head; 1 = multi-query).
    qk_norm: builds the normalisation of one head's queries or keys from its size (head_dim); None
    leaves them as they are. value_mix: the layer mixes a value embedding into its values (ValueMix);
    False leaves them as they are. qkv_bias: c_attn has a bias even where bias is False (Qwen2's
    queries, keys and values have biases, its output projection none)."""

    def __init__(
        self,
        n_embd: int,
        n_head: int,
        head_dim: int,
        dropout: float,
        bias: bool,
        layer_idx: int,
        n_kv_head: int = 0,
        qk_norm: Callable[[int], nn.Module] | None = None,
        value_mix: bool = False,
        qkv_bias: bool = False,
    ):
        super().__init__()
        self.n_head = n_head
        self.n_kv_head = n_kv_head or n_head
        self.head_dim = head_dim
        self.q_dim = n_head * head_dim
        self.kv_dim = self.n_kv_head * head_dim
        # query, key, value for all heads, one after the other
        self.c_attn = nn.Linear(n_embd, self.q_dim + 2 * self.kv_dim, bias=bias or qkv_bias)
        self.c_proj = nn.Linear(self.q_dim, n_embd, bias=bias)
        self.q_norm = qk_norm(head_dim) if qk_norm else nn.Identity()
        self.k_norm = qk_norm(head_dim) if qk_norm else nn.Identity()
        self.value_mix = ValueMix() if value_mix else NoValueMix()
        self.resid_dropout = nn.Dropout(dropout)
        self.dropout = dropout
        self.layer_idx = layer_idx  # which slot of a KV cache this layer writes

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache=None,
        rotate: Callable[[torch.Tensor], torch.Tensor] = no_rotation,
        value_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (B, T, C). mask: see `attention`; None is plain causal over these T tokens. With a
        cache, the new keys and values go into its slots and the queries attend over all of them.
        rotate: turns (B, T, heads, D) queries or keys by their tokens' positions (`Rotary`'s
        output); by default they stay as they are. value_embedding: (B, T, Hkv * D), the tokens'
        rows of the value embedding a layer built with value_mix mixes into its values."""
        B, T, C = x.shape
        q, k, v = self.heads(x, rotate, value_embedding)  # (B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, kv_len, D)
        y = attention(q, k, v, mask, dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, self.q_dim)  # (B, T, H * D)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)

    def heads(
        self,
        x: torch.Tensor,
        rotate: Callable[[torch.Tensor], torch.Tensor] = no_rotation,
        value_embedding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of x (B, T, C), normalised as the
        layer was built to, queries and keys then rotated, values mixed. rotate, value_embedding:
        as for forward."""
        B, T, C = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.c_attn(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=2)
        # normalised and rotated in the (B, T, heads, D) layout the projection leaves them in, where
        # each (T, D) row is contiguous (measured faster on a CPU than after the transpose)
        q = rotate(self.q_norm(q.view(B, T, H, D))).transpose(1, 2)  # (B, H, T, D)
        k = rotate(self.k_norm(k.view(B, T, Hkv, D))).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.value_mix(v, value_embedding).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
        return q, k, v

    def weights(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rotate: Callable[[torch.Tensor], torch.Tensor] = no_rotation,
    ) -> torch.Tensor:
        """The attention weights this layer gives x (B, T, C) without a cache: (B, H, T, T).
        rotate: as for forward."""
        q, k = self.heads(x, rotate, torch.zeros(()))[:2]  # the weights read no values, nor a value embedding
        return attention_weights(q, k, mask)


class ValueMix(nn.Module):
    """A layer's values v become a * v + b * e, with e its tokens' rows of a value embedding and a, b
    learned, both starting at 0.5 (modded-nanogpt's speedrun, records of December 2024): the token's
    identity reaches the layer's output directly, however deep the layer."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((2,), 0.5))  # a, b

    def forward(self, v: torch.Tensor, value_embedding: torch.Tensor) -> torch.Tensor:
        return self.weight[0] * v + self.weight[1] * value_embedding  # (B, T, Hkv * D)


class NoValueMix(nn.Module):
    """Stands in for ValueMix in a layer no value embedding serves: its values stay as they are."""

    def forward(self, v: torch.Tensor, value_embedding: None) -> torch.Tensor:
        return v


class Rotary(nn.Module):
    """Rotary position embedding (Su et al., RoFormer, 2021): the features of a head pair up, i with
    i + D/2, and each pair turns by the angle position * inv_freq[i] (model/rope.py's tables: by default
    base^(-2i/D), or one stretched for a longer context). The dot product of a rotated query and key
    then depends on their positions only through their distance.

    Called with the tokens' positions, it returns the rotation for them, which every layer then
    applies to its queries and keys: the angles' cosines and sines are computed once per forward
    pass, in float32 (a table cast to bfloat16 with the model would be off by whole turns at far
    positions), and multiplied by scale (YaRN's attention factor; 1 for the others)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0):
        super().__init__()
        # a plain attribute, neither parameter nor buffer: no checkpoint holds it, and casting the model
        # to bfloat16 leaves it in float32; forward moves it to the positions' device once
        self.inv_freq = inv_freq.float()  # (D/2,)
        self.scale = scale

    def forward(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """positions: (1 or B, T), padding (negative) taken as 0. Returns the function that turns
        (1 or B, T, heads, head_dim) queries or keys at those positions."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.clamp(min=0)[:, :, None, None].float() * self.inv_freq  # (1 or B, T, 1, D/2)
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        # each pair (a, b) = (x_i, x_i+D/2) turns to (a cos - b sin, b cos + a sin): x * cos, plus x
        # with its halves swapped times sin with the first half's sign flipped
        return functools.partial(rotate_pairs, cos=torch.cat([cos, cos], dim=-1), sin=torch.cat([-sin, sin], dim=-1))

    def extra_repr(self) -> str:
        return f"head_dim={2 * self.inv_freq.numel()}" + (f", scale={self.scale}" if self.scale != 1.0 else "")


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) with feature i paired with i + D/2, each pair turned by its angle: cos holds the
    angles' cosines twice over, (1 or B, T, 1, D), and sin their sines, negated in the first half.
    Computed in float32, returned in x's dtype."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)  # (B, T, H, D/2) each
    return (x32 * cos + torch.cat([x2, x1], dim=-1) * sin).type_as(x)


class NoRotation(nn.Module):
    """Stands in for Rotary when positions enter through the learned embedding instead: the
    rotation it returns leaves queries and keys as they are."""

    def forward(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return no_rotation
