"""modded-nanogpt's speedrun switches that change what flows along the residual stream or into the
embedding: value embeddings, U-net skips, backout, the smear gate and the bigram table.

Each is resolved once, when model/gpt.py builds the model, into a module of this file; a switch that
is off is a module that does nothing (NoValueEmbeddings, NoSkips, NoBackout; model/gpt.py's
TokenEmbedding for the embedding), so the GPT's forward pass reads the same for every choice.
docs/architecture.md says what each computes and what it buys.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt_config import SMEAR_GATE_FEATURES, GPTConfig
from .kv_cache import KVCache

# two odd 32-bit multipliers (Knuth's golden-ratio one and an xxHash prime): the XOR of a pair's products spreads
# the pairs over the buckets of a hashed bigram table, where a sum (prev * vocab + cur) would collide in runs
BIGRAM_HASH = (2654435761, 2246822519)


def value_table(config: GPTConfig, layer: int) -> int | None:
    """The value embedding that serves a layer: of N = value_embeds tables, table i serves the first
    layers' layer i and the last layers' layer n_layer - N + i (modded-nanogpt's 3 tables serve
    layers 0-2 and the last 3 of 12, the same table at both ends of the U); None: no table does."""
    N = config.value_embeds
    if layer < N:
        return layer
    if layer >= config.n_layer - N:
        return layer - (config.n_layer - N)
    return None


class ValueEmbeddings(nn.Module):
    """value_embeds token tables, each a row of kv_heads * head_size per token (the width of a layer's
    values), looked up once per forward pass and handed to the layers value_table assigns them
    (KoszarskyB, in modded-nanogpt's speedrun of December 2024)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        width = config.kv_heads * config.head_size
        self.tables = nn.ModuleList(nn.Embedding(config.vocab_size, width) for _ in range(config.value_embeds))
        self.layer_tables = [value_table(config, layer) for layer in range(config.n_layer)]

    def forward(self, idx: torch.Tensor) -> list[torch.Tensor | None]:
        rows = [table(idx) for table in self.tables]  # each (B, T, kv_heads * head_size)
        return [None if i is None else rows[i] for i in self.layer_tables]


class NoValueEmbeddings(nn.Module):
    """Stands in for ValueEmbeddings without value_embeds: no layer gets one."""

    def __init__(self, n_layer: int):
        super().__init__()
        self.n_layer = n_layer

    def forward(self, idx: torch.Tensor) -> list[None]:
        return [None] * self.n_layer


class UNetSkips(nn.Module):
    """U-net skips between early and late blocks (Brendan Hogan, modded-nanogpt's speedrun of November
    2024): block n_layer - 1 - i, in the second half, adds the output of block i, in the first half,
    times a learned weight starting at 1, to its input; an odd n_layer's middle block adds none."""

    def __init__(self, n_layer: int):
        super().__init__()
        self.n_layer = n_layer
        self.weight = nn.Parameter(torch.ones(n_layer // 2))  # weight[i]: of block i's output

    def forward(self, x: torch.Tensor, residuals: list[torch.Tensor]) -> torch.Tensor:
        """x: (B, T, C), the input of the next block; residuals: the stream before the first block and
        after each block so far (residuals[i + 1] is block i's output)."""
        early = self.n_layer - len(residuals)  # the block whose output the next one adds
        if early >= self.weight.numel():
            return x  # the next block is in the first half (or the middle)
        return x + self.weight[early] * residuals[early + 1]


class NoSkips(nn.Module):
    def forward(self, x: torch.Tensor, residuals: list[torch.Tensor]) -> torch.Tensor:
        return x


class Backout(nn.Module):
    """Backout (modded-nanogpt's speedrun, October 2025): before the final norm, the stream loses a
    learned multiple (starting at 0.5) of itself as it stood after the first 2 * n_layer // 3 blocks
    (8 of 12, the record's choice). What the early blocks wrote is context for later blocks; backing
    part of it out leaves the head the later blocks' prediction."""

    def __init__(self, n_layer: int):
        super().__init__()
        self.layer = 2 * n_layer // 3  # residuals[layer]: the stream after that many blocks
        self.weight = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor, residuals: list[torch.Tensor]) -> torch.Tensor:
        return x - self.weight * residuals[self.layer]  # (B, T, C)


class NoBackout(nn.Module):
    def forward(self, x: torch.Tensor, residuals: list[torch.Tensor]) -> torch.Tensor:
        return x


class NeighbourEmbedding(nn.Module):
    """A token's embedding, plus what it reads of the token before it: the smear gate, the bigram
    table, or both (modded-nanogpt's speedrun).

    A token has no previous token at the row's first real position (left padding has none to give),
    nor, with attn_documents, where it opens a document (the end-of-text token): a document never
    reads the one before it. With a cache, the token before a call's first is the cache's last."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.eot_token = config.eot_token if config.attn_documents else -1  # -1: no token opens a document
        self.parts = nn.ModuleList(
            [part(config) for on, part in ((config.smear_gate, SmearGate), (config.bigram_embed, BigramTable)) if on]
        )

    def forward(
        self, wte: nn.Embedding, idx: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        """idx: (B, T) tokens at row positions (1 or B, T) (negative: left padding). Returns (B, T, C)."""
        before = F.pad(idx[:, :-1], (1, 0)) if cache is None else cache.tokens_before(idx)  # (B, T)
        has_previous = (positions > 0) & (idx != self.eot_token)  # (B, T)
        previous = torch.where(has_previous, before, -1)  # (B, T): the token before each, -1 for none
        x = wte(idx)  # (B, T, C)
        for part in self.parts:
            x = part(x, idx, previous, wte)
        return x


class SmearGate(nn.Module):
    """x + scale * sigmoid(w . x[:12]) * wte(previous token): each token mixes in the previous one's
    embedding, by as much as a gate read from its own first features decides (modded-nanogpt,
    record of 2025-09-18: attention heads spent on the previous token are costly). The scale starts
    at 0, so the gate starts closed and the model at first computes what it would without it."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(min(SMEAR_GATE_FEATURES, config.n_embd)))  # (features,)
        self.scale = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, previous: torch.Tensor, wte: nn.Embedding) -> torch.Tensor:
        """x: (B, T, C) embeddings of idx (B, T); previous: (B, T) the token before each, -1 for none."""
        previous_emb = wte(previous.clamp(min=0)) * (previous >= 0)[..., None]  # (B, T, C): 0 where none
        gate = self.scale * torch.sigmoid(x[..., : self.gate.numel()] @ self.gate)  # (B, T)
        return x + gate[..., None] * previous_emb


class BigramTable(nn.Module):
    """x + table[pair]: a learned, zero-initialised row for each pair (previous token, token), and one
    for a token with no previous token (the last row). One row per pair where vocab_size^2 + 1 rows
    fit in bigram_embed (character vocabularies: 65^2 + 1), else the pairs are hashed into
    bigram_embed - 1 shared rows (modded-nanogpt's bigram hash embedding, record of 2026-01-19)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.pairs = config.bigram_rows - 1  # the rows of the pairs; the last is no previous token's
        self.exact = self.pairs == config.vocab_size**2
        self.weight = nn.Parameter(torch.zeros(config.bigram_rows, config.n_embd))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, previous: torch.Tensor, wte: nn.Embedding) -> torch.Tensor:
        """x: (B, T, C) embeddings of idx (B, T); previous: (B, T) the token before each, -1 for none."""
        if self.exact:
            pair = previous * self.vocab_size + idx  # (B, T): below vocab_size^2 where there is a previous token
        else:
            pair = (previous * BIGRAM_HASH[0]) ^ (idx * BIGRAM_HASH[1])  # (B, T); no overflow below 2^31 tokens
        row = torch.where(previous >= 0, pair % self.pairs, self.pairs)  # (B, T)
        return x + F.embedding(row, self.weight)

    def extra_repr(self) -> str:
        return f"rows={self.pairs + 1}, {'exact' if self.exact else 'hashed'}"
