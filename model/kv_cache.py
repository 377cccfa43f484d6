"""A preallocated key/value cache for autoregressive decoding.

Without a cache every new token re-runs attention over the whole sequence; with it, each step
computes keys and values for the new token only and reads the earlier ones back, so a step costs
O(n) instead of O(n^2) in the length n so far.
"""

import torch


class KVCache:
    """Keys and values of every layer for the tokens seen so far.

    Allocated once for the longest sequence it will hold. Attention layers write their new keys and
    values at the current position with `update`; the model's forward calls `advance` once per call,
    after every layer has written.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        head_dim: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.pos = 0  # tokens already written (the same for every layer between forward calls)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, H, T, D) keys and values at the current position; return all keys and values
        so far, (B, H, pos + T, D)."""
        end = self.pos + k.size(2)
        if end > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions; writing {k.size(2)} tokens at "
                f"position {self.pos} needs {end}"
            )
        self.k[layer, :, :, self.pos : end] = k
        self.v[layer, :, :, self.pos : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n_tokens: int) -> None:
        self.pos += n_tokens

    def reset(self) -> None:
        """Forget the cached tokens; the memory is kept and overwritten."""
        self.pos = 0
