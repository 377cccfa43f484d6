"""Causal (masked) self-attention.

Every query may attend to its own position and to earlier ones, never to later ones: scores for
future keys are set to -inf before the softmax, so their weights are exactly 0 and each row of
weights sums to 1 over the allowed keys. The work is done by
`torch.nn.functional.scaled_dot_product_attention` (SDPA), which picks a fused kernel.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def causal_mask(q_len: int, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean (q_len, kv_len) mask, True where a query may attend to a key.

    The queries are the last q_len of kv_len positions (as when new tokens follow a cached
    prefix): query i sits at position kv_len - q_len + i and sees keys 0 .. kv_len - q_len + i.
    """
    ones = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    return ones.tril(diagonal=kv_len - q_len)


def padded_causal_mask(q_slots: torch.Tensor, kv_len: int, pad: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask, True where a query may attend to a key, for queries at any slots of a sequence
    of kv_len slots (as in a preallocated KV cache) whose rows may start with padding.

    q_slots: (T,) the slot of each query. pad: (B,) how many slots each row starts with that are
    padding (left padding), or None. Query i of row b sees keys pad[b] .. q_slots[i]; a padding query
    sees only itself, so no row of the softmax is empty (its output is never used). Returns (T, kv_len)
    without pad, else (B, 1, T, kv_len).
    """
    keys = torch.arange(kv_len, device=q_slots.device)  # (S,)
    causal = keys <= q_slots[:, None]  # (T, S)
    if pad is None:
        return causal
    real_key = keys >= pad[:, None]  # (B, S)
    own_key = keys == q_slots[:, None]  # (T, S)
    return (causal & (real_key[:, None, :] | own_key))[:, None]  # (B, 1, T, S)


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
        H = self.n_head
        D = C // H
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, H, max_len, D)
        y = attention(q, k, v, mask, dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))
