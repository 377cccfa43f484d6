"""A preallocated key/value cache for autoregressive decoding.

Without a cache every new token re-runs attention over the whole sequence; with it, each step
computes keys and values for the new token only and reads the earlier ones back, so a step costs
O(n) instead of O(n^2) in the length n so far.

The buffers are allocated once, for max_len positions, and written in place. Attention reads
either the slots written so far (the default: no mask needed, and the least memory traffic, which
is what eager decoding on a CPU is bound by) or, with `static=True`, all max_len slots with a mask
hiding the ones not written yet. A static cache makes every decoding step run the same tensor
shapes on the same buffers, which is what lets `torch.compile` (and CUDA graphs) capture one step
and replay it.
"""

import torch

from .masks import UNWRITTEN


class KVCache:
    """Keys and values of every layer for the tokens seen so far.

    Allocated once for the longest sequence it will hold. Each forward call first claims room for
    its tokens (`claim`, on the host), its attention layers write their keys and values into the
    claimed slots (`update`), and it ends with `advance`, which moves the device-side write position.
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
        static: bool = False,
    ):
        # n_head: the key/value heads (fewer than the query heads with grouped-query attention).
        # One (B, H, max_len, D) tensor per layer: torch.compile writes a whole tensor in place, but a
        # write into a view of a larger one (a layer of a stacked buffer) would copy that buffer
        shape = (batch_size, n_head, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len = max_len
        self.static = static
        self.pos = 0  # slots claimed so far, counted on the host: checking room never waits for the device
        self.next_slot = torch.zeros(1, dtype=torch.long, device=device)  # the same count, on the device
        # The buffers stay at fixed addresses and are updated in place, so compiled steps (CUDA graphs
        # included) may read and write them directly instead of copying them in and out.
        for buffer in (*self.k, *self.v, self.next_slot):
            torch._dynamo.mark_static_address(buffer)

    @torch.compiler.disable  # host-side bookkeeping: keeps the changing count out of compiled graphs
    def claim(self, n_tokens: int) -> None:
        """Reserve the next n_tokens slots; raises if they do not fit."""
        end = self.pos + n_tokens
        if end > self.max_len:
            raise ValueError(
                f"KV cache holds {self.max_len} positions; writing {n_tokens} tokens at position {self.pos} needs {end}"
            )
        self.pos = end

    @property
    def kv_len(self) -> int:
        """How many slots attention reads: all of them when static, else those claimed so far."""
        return self.max_len if self.static else self.pos

    def slots(self, n_tokens: int) -> torch.Tensor:
        """(n_tokens,) the slots the current call writes (claimed last), computed on the device when
        static."""
        if self.static:
            return self.next_slot + torch.arange(n_tokens, device=self.next_slot.device)
        return torch.arange(self.pos - n_tokens, self.pos, device=self.next_slot.device)

    def key_positions(self, slots: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """(1 or B, kv_len) the position of the key in each slot attention reads, given the current
        call's slots: negative for left padding, UNWRITTEN for a slot not written yet (static)."""
        keys = torch.arange(self.kv_len, device=slots.device)  # (kv_len,)
        written = keys <= slots[-1]
        positions = keys[None] if pad is None else keys[None] - pad[:, None]
        return torch.where(written, positions, UNWRITTEN)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, H, T, D) keys and values into the current call's slots; return the layer's
        keys and values over kv_len slots, (B, H, kv_len, D) (when static, the caller masks the
        slots not written yet)."""
        if self.static:
            slots = self.slots(k.size(2))
            self.k[layer][:, :, slots] = k
            self.v[layer][:, :, slots] = v
            return self.k[layer], self.v[layer]
        start = self.pos - k.size(2)
        self.k[layer][:, :, start : self.pos] = k
        self.v[layer][:, :, start : self.pos] = v
        return self.k[layer][:, :, : self.pos], self.v[layer][:, :, : self.pos]

    def advance(self, n_tokens: int) -> None:
        if self.static:
            self.next_slot += n_tokens

    def reset(self) -> None:
        """Forget the cached tokens; the memory is kept and overwritten."""
        self.pos = 0
        self.next_slot.zero_()
