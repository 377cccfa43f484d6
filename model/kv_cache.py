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

A sliding-window model needs only the last W positions (and its S sinks): `RollingKVCache` keeps
W + S slots and overwrites the oldest, so its memory is bounded by the window, not the sequence.
Both caches record what attention patterns need of the cached keys: their positions and, for
document masking, the document of each position (and, for positions that restart at each document,
where the open document started); and, for the switches that read the token before each token (the
smear gate, the bigram table), each row's last token.
"""

import copy

import torch

from .masks import UNWRITTEN, document_ids, document_positions


class KVCache:
    """Keys and values of every layer for the tokens seen so far.

    Allocated once for the longest sequence it will hold. Each forward call first claims room for
    its tokens (`claim`, on the host), its attention layers write their keys and values into the
    claimed slots (`update`), and it ends with `advance`, which moves the device-side write position.
    """

    # the buffers other than the keys and values that hold one row per sequence
    ROW_TABLES = ("doc_ids", "eot_seen", "doc_start", "last_token")

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
        n_slots: int | None = None,
    ):
        # n_head: the key/value heads (fewer than the query heads with grouped-query attention).
        # One (B, H, n_slots, D) tensor per layer (n_slots: max_len unless a subclass keeps fewer):
        # torch.compile writes a whole tensor in place, but a write into a view of a larger one (a
        # layer of a stacked buffer) would copy that buffer
        shape = (batch_size, n_head, n_slots or max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.max_len = max_len
        self.static = static
        self.pos = 0  # slots claimed so far, counted on the host: checking room never waits for the device
        self.next_slot = torch.zeros(1, dtype=torch.long, device=device)  # the same count, on the device
        # document masking: the document of each position (last column: scratch for padding), how
        # many end-of-text tokens each row has had, and where its open document started
        self.doc_ids = torch.zeros(batch_size, max_len + 1, dtype=torch.long, device=device)
        self.eot_seen = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.doc_start = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        # the smear gate and the bigram table: each row's last token, the one before the next call's first
        self.last_token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        # The buffers stay at fixed addresses and are updated in place, so compiled steps (CUDA graphs
        # included) may read and write them directly instead of copying them in and out.
        for buffer in (*self.k, *self.v, self.next_slot, self.doc_ids, self.eot_seen, self.doc_start, self.last_token):
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

    def key_positions(self, q_pos: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """(1 or B, kv_len) the position of the key in each slot attention reads, given the current
        call's query positions (B, T) and slots (T,): negative for left padding, UNWRITTEN for a
        slot not written yet (static). Called once per forward pass, before the layers."""
        keys = torch.arange(self.kv_len, device=slots.device)  # (kv_len,)
        written = keys <= slots[-1]
        positions = keys[None] if pad is None else keys[None] - pad[:, None]
        return torch.where(written, positions, UNWRITTEN)

    def document_ids(self, idx: torch.Tensor, eot_token: int, q_pos: torch.Tensor) -> torch.Tensor:
        """Record the documents of the new tokens idx (B, T) at positions q_pos (B, T); returns the
        table of every position's document (see masks.document_ids). Once per forward pass."""
        table, seen = document_ids(idx, eot_token, q_pos, self.doc_ids, self.eot_seen)
        self.eot_seen.copy_(seen)
        return table

    def document_positions(self, idx: torch.Tensor, eot_token: int, q_pos: torch.Tensor) -> torch.Tensor:
        """The new tokens' positions in their documents (B, T), counting on from the document left
        open by the tokens before them (see masks.document_positions). Once per forward pass."""
        positions, start = document_positions(idx, eot_token, q_pos, self.doc_start)
        self.doc_start.copy_(start)
        return positions

    def tokens_before(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) the token before each of the new tokens idx (B, T): the last cached one before the
        first (meaningless at a row's start, where the caller reads none). Records idx's last token.
        Once per forward pass."""
        before = torch.cat([self.last_token, idx[:, :-1]], dim=1)
        self.last_token.copy_(idx[:, -1:])
        return before

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write (B, H, T, D) keys and values into the current call's slots; return the layer's
        keys and values over kv_len slots, (B, H, kv_len, D) (when static, the caller masks the
        slots not written yet), in k's dtype: a cache in fewer bytes returns them widened, its new
        ones as rounded when written."""
        if self.static:
            slots = self.slots(k.size(2))
            self.k[layer][:, :, slots] = k.to(self.k[layer].dtype)  # an indexed write casts nothing itself
            self.v[layer][:, :, slots] = v.to(self.v[layer].dtype)
            return self.k[layer].to(k.dtype), self.v[layer].to(v.dtype)
        start = self.pos - k.size(2)
        self.k[layer][:, :, start : self.pos] = k
        self.v[layer][:, :, start : self.pos] = v
        return self.k[layer][:, :, : self.pos].to(k.dtype), self.v[layer][:, :, : self.pos].to(v.dtype)

    def advance(self, n_tokens: int) -> None:
        if self.static:
            self.next_slot += n_tokens

    def copy_rows(self, source: "KVCache", rows: torch.Tensor) -> None:
        """Make row i of this cache a copy of row rows[i] of source, a cache of the same kind and
        length: several continuations of one prefix, each in its own row, without encoding the
        prefix once per continuation. rows: (batch_size,) indices into source's rows."""
        for mine, theirs in zip(self._row_buffers(), source._row_buffers(), strict=True):
            torch.index_select(theirs, 0, rows, out=mine)
        self.pos = source.pos
        self.next_slot.copy_(source.next_slot)

    def _row_buffers(self) -> list[torch.Tensor]:
        """Every buffer with one row per sequence."""
        return [*self.k, *self.v, *(getattr(self, name) for name in self.ROW_TABLES)]

    # Rows that come and go (a server's requests): each row keeps its own padding, pad[b] slots before
    # its first key, so rows of different lengths decode together as left-padded prompts do.

    def rows(self, start: int, stop: int) -> "KVCache":
        """The cache of rows start .. stop - 1 alone, sharing this cache's memory: a forward pass over
        the rows in use writes here and computes nothing for the others. It starts at this cache's
        write position, and counts its own from there."""
        view = copy.copy(self)
        view.k, view.v = [k[start:stop] for k in self.k], [v[start:stop] for v in self.v]
        for name in self.ROW_TABLES:
            setattr(view, name, getattr(self, name)[start:stop])
        return view

    def place(self, row: int, source: "KVCache", offset: int) -> None:
        """Make `row` hold the one sequence of `source`, a cache of the same kind that holds one row: its
        slots 0 .. source.pos - 1 become this row's slots offset .. offset + source.pos - 1, so that with
        pad[row] = offset its keys keep their positions. The tables kept by position (documents) and
        the row's last token come as they are, as far as this cache's length holds them."""
        for mine, theirs in zip(self.k + self.v, source.k + source.v, strict=True):
            mine[row, :, offset : offset + source.pos] = theirs[0, :, : source.pos]
        self._place_tables(row, source)

    def _place_tables(self, row: int, source: "KVCache") -> None:
        for name in self.ROW_TABLES:
            mine, theirs = getattr(self, name), getattr(source, name)
            width = min(mine.size(1), theirs.size(1))
            mine[row, :width] = theirs[0, :width]

    def shift(self, by: int) -> None:
        """Move every row's keys and values `by` slots later (earlier when negative), and the write
        position with them: each row's padding grows by `by`. Slots moved out of the written range
        are dropped; the caller shifts earlier by no more than every row's padding."""
        start, stop = max(0, -by), self.pos
        for buffer in self.k + self.v:
            buffer[:, :, start + by : stop + by] = buffer[:, :, start:stop].clone()
        self.pos += by

    def reset(self) -> None:
        """Forget the cached tokens; the memory is kept and overwritten."""
        self.pos = 0
        self.next_slot.zero_()
        self.doc_ids.zero_()
        self.eot_seen.zero_()
        self.doc_start.zero_()
        self.last_token.zero_()


class RollingKVCache(KVCache):
    """A KV cache for a sliding window of `window` positions plus `sinks` sink positions: it keeps
    window + sinks slots, so its memory does not grow with the sequence.

    The first `sinks` positions of each row stay in slots 0 .. sinks - 1; position p >= sinks goes
    to slot sinks + (p - sinks) % window, overwriting the position `window` before it, which no
    later query sees. Each call's queries attend over the slots as they were before the call plus
    the call's own keys (a prompt longer than the window needs all of its keys at once); then the
    keys that later queries will need are written. A row's positions start after its padding, so
    each row writes to its own slots; padding, and keys that a later key of the same call replaces,
    go to a scratch slot that is never read.
    """

    ROW_TABLES = (*KVCache.ROW_TABLES, "positions")  # and the position each slot holds

    def __init__(self, *shape: int, window: int, sinks: int, **options):
        """shape: n_layer, batch_size, n_head, head_dim, max_len; options: device, dtype, static (see KVCache)."""
        self.n_slots = window + sinks
        self.window = window
        self.sinks = sinks
        super().__init__(*shape, **options, n_slots=self.n_slots + 1)
        batch_size, device = shape[1], self.next_slot.device
        # the position held in each slot (the last column is the scratch slot)
        self.positions = torch.full((batch_size, self.n_slots + 1), UNWRITTEN, dtype=torch.long, device=device)
        self.write_slots = torch.zeros(batch_size, 1, dtype=torch.long, device=device)  # the current call's
        torch._dynamo.mark_static_address(self.positions)

    def key_positions(self, q_pos: torch.Tensor, slots: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """(B, n_slots + T) positions of the keys the current call reads: the slots before the call,
        then its own tokens. Also decides where the call's keys go, and records their positions."""
        B, T = q_pos.shape
        keys = torch.cat([self.positions[:, : self.n_slots], q_pos], dim=1)  # (B, n_slots + T)
        latest = torch.arange(T, device=q_pos.device) >= T - self.window  # (T,): not replaced within the call
        ring = self.sinks + (q_pos - self.sinks) % self.window  # (B, T)
        slot = torch.where(q_pos < self.sinks, q_pos, torch.where(latest, ring, self.n_slots))
        self.write_slots = torch.where(q_pos >= 0, slot, self.n_slots)  # (B, T); n_slots: scratch
        self.positions.scatter_(1, self.write_slots, q_pos)
        return keys

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the keys and values before this call followed by the new ones (B, H, T, D), as
        (B, H, n_slots + T, D) in k's dtype (as KVCache.update); then write the new ones into their slots."""
        k_kept, v_kept = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)  # as the cache holds them
        keys = torch.cat([self.k[layer][:, :, : self.n_slots], k_kept], dim=2).to(k.dtype)
        values = torch.cat([self.v[layer][:, :, : self.n_slots], v_kept], dim=2).to(v.dtype)
        index = self.write_slots[:, None, :, None].expand_as(k)  # (B, H, T, D)
        self.k[layer].scatter_(2, index, k_kept)
        self.v[layer].scatter_(2, index, v_kept)
        return keys, values

    def place(self, row: int, source: "KVCache", offset: int) -> None:
        """As KVCache.place; the slots of a rolling cache are set by position, not by offset, so the
        row's slots come as they are."""
        for mine, theirs in zip(self.k + self.v, source.k + source.v, strict=True):
            mine[row] = theirs[0]
        self._place_tables(row, source)

    def shift(self, by: int) -> None:
        """As KVCache.shift: the write position moves; the slots, set by position, stay."""
        self.pos += by

    def reset(self) -> None:
        super().reset()
        self.positions.fill_(UNWRITTEN)
