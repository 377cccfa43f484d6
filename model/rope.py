"""The inverse frequencies of rotary position embeddings: the plain table and the two stretched ones
published models use for a context longer than the one they were pretrained with.

A head's features pair up, i with i + D/2, and pair i turns by the angle position * inv_freq[i]:

    none     inv_freq[i] = 1 / base^(2i / D)
    llama3   (Llama 3.1, 3.2) each frequency by its wavelength 2 pi / inv_freq against the original
             context L: kept below L / high_freq_factor, divided by factor above L / low_freq_factor,
             and in between a blend, s * inv_freq + (1 - s) * inv_freq / factor with
             s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    yarn     (Qwen's long context; Peng et al., YaRN, 2023) a linear ramp over the pairs between the
             ones that turn beta_fast times and beta_slow times in L mixes inv_freq (the fast pairs,
             kept) with inv_freq / factor (the slow ones); cos and sin are then multiplied by an
             attention factor, 0.1 ln(factor) + 1 unless given, which scales every query-key score by
             its square

Each is computed in float32 with the operations of transformers' modeling_rope_utils, in their order,
so that the tables are the same numbers bit for bit.
"""

import math

import torch

from .gpt_config import GPTConfig


def default_frequencies(base: float, dim: int) -> torch.Tensor:
    """(dim / 2,) float32: 1 / base^(2i / dim)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def llama3_frequencies(
    base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> torch.Tensor:
    """Llama 3.1's table: long wavelengths divided by factor, short ones kept, a blend in between."""
    inv_freq = default_frequencies(base, dim)
    low_freq_wavelen, high_freq_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # (dim / 2,)
    divided = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * divided / factor + smooth * divided
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, divided)


def yarn_frequencies(
    base: float, dim: int, factor: float, original: int, beta_fast: float, beta_slow: float, truncate: bool
) -> torch.Tensor:
    """YaRN's table: the pairs that turn more than beta_fast times in the original context kept, those
    that turn fewer than beta_slow times divided by factor, a linear ramp in between."""

    def correction_dim(rotations: float) -> float:  # the pair that turns `rotations` times in `original` positions
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: a ramp of no width would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # (dim / 2,)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    kept, divided = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    kept_share = 1 - ramp.to(dtype=torch.float)
    return divided * (1 - kept_share) + kept * kept_share


def yarn_attention_factor(factor: float) -> float:
    """What YaRN multiplies cos and sin by when the model names no factor of its own."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_frequencies(config: GPTConfig) -> tuple[torch.Tensor, float]:
    """The (head_size / 2,) float32 inverse frequencies of config's rotary embedding, and the factor
    its cos and sin are multiplied by (1 but for yarn)."""
    base, dim = config.rope_base, config.head_size
    if config.rope_scaling == "llama3":
        table = llama3_frequencies(
            base,
            dim,
            config.rope_factor,
            config.rope_low_freq_factor,
            config.rope_high_freq_factor,
            config.rope_original_context,
        )
        return table, 1.0
    if config.rope_scaling == "yarn":
        table = yarn_frequencies(
            base,
            dim,
            config.rope_factor,
            config.rope_original_context,
            config.rope_beta_fast,
            config.rope_beta_slow,
            config.rope_truncate,
        )
        return table, config.rope_attention_factor or yarn_attention_factor(config.rope_factor)
    return default_frequencies(base, dim), 1.0
