"""A GPT-2 style language model in plain PyTorch; this folder imports nothing else from the project."""

from .attention import CausalSelfAttention, attention, attention_weights, causal_mask
from .generate import generate, left_pad, sample_next_token
from .gpt import GPT
from .gpt_config import GPTConfig
from .kv_cache import KVCache
from .masks import dense_mask, pattern_rule

__all__ = [
    "GPT",
    "GPTConfig",
    "KVCache",
    "dense_mask",
    "pattern_rule",
    "CausalSelfAttention",
    "attention",
    "causal_mask",
    "attention_weights",
    "generate",
    "left_pad",
    "sample_next_token",
]
