"""A GPT-2 style language model in plain PyTorch; this folder imports nothing else from the project."""

from .attention import CausalSelfAttention, attention, causal_mask, padded_causal_mask
from .generate import generate, left_pad, sample_next_token
from .gpt import GPT, GPTConfig
from .kv_cache import KVCache
from .packed_linear import PackedLinear, pack_linears, packing_unavailable

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "PackedLinear",
    "pack_linears",
    "packing_unavailable",
    "CausalSelfAttention",
    "attention",
    "causal_mask",
    "padded_causal_mask",
    "generate",
    "left_pad",
    "sample_next_token",
]
