"""Masked self-attention.

Every query may attend to the keys its attention pattern allows (by default its own position and
earlier ones, never later ones; model/masks.py holds the patterns): scores for other keys are set to
-inf before the softmax, so their weights are exactly 0 and each row of weights sums to 1 over the
allowed keys. The work is done by `torch.nn.functional.scaled_dot_product_attention` (SDPA), which
picks a fused kernel; `attention_weights` spells the same computation out and returns the weights.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .masks import causal, dense_mask


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
    """Scaled dot-product attention on (B, H, T, D) tensors; returns (B, H, Tq, D).

    mask: boolean, broadcastable to (B, H, Tq, Tk), True where a query may attend to a key.
    None means causal, with the queries taken as the last Tq of the Tk key positions.
    """
    q_len, kv_len = q.size(-2), k.size(-2)
    if mask is None and q_len == kv_len:
        # Fast path: the fused kernel applies the causal mask itself and never builds a (T, T)
        # mask. SDPA's is_causal aligns the mask to the top-left corner, which is only right when
        # queries and keys cover the same positions, hence the q_len == kv_len condition.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if mask is None and q_len == 1:
        # One new token after a cached prefix is the latest position: it may see every key.
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    if mask is None:
        mask = causal_mask(q_len, kv_len, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The weights `attention` applies to the values, (B, H, Tq, Tk): the softmax over keys of the
    scaled scores q.k / sqrt(D), with blocked keys at -inf (so their weights are exactly 0).
    mask: as for `attention`."""
    q_len, kv_len = q.size(-2), k.size(-2)
    if mask is None:
        mask = causal_mask(q_len, kv_len, q.device)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with GPT-2's parameter layout (c_attn, c_proj)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, layer_idx: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # query, key, value for all heads
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.dropout = dropout
        self.layer_idx = layer_idx  # which slot of a KV cache this layer writes

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """x: (B, T, C). mask: see `attention`; None is plain causal over these T tokens. With a
        cache, the new keys and values go into its slots and the queries attend over all of them."""
        B, T, C = x.shape
        q, k, v = self.heads(x)  # (B, H, T, D) each
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, H, kv_len, D)
        y = attention(q, k, v, mask, dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x (B, T, C), each split into heads: (B, H, T, D)."""
        B, T, C = x.shape
        H = self.n_head
        D = C // H
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        return q, k, v

    def weights(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The attention weights this layer gives x (B, T, C) without a cache: (B, H, T, T)."""
        q, k, _ = self.heads(x)
        return attention_weights(q, k, mask)
