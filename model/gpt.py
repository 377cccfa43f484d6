"""A GPT-2 style decoder-only transformer: the GPT, its blocks, norms and MLPs, top to bottom.

Attention is in attention.py, the attention patterns in masks.py and the KV cache in kv_cache.py,
beside this file; the config and its checks in gpt_config.py.

The defaults are GPT-2. A few keys swap in later practice (rotary positions, RMSNorm, QK-norm,
a ReLU^2 or SwiGLU MLP, grouped-query attention, heads of a width of their own, an untied output
head, soft-capped logits, multi-token prediction); each is resolved once, when the model is built,
into the module it names, so forward() reads the same for every choice. modded-nanogpt's switches
that change the residual stream and the embedding (value embeddings, U-net skips, backout, the smear
gate, the bigram table) live in switches.py and are reached the same way: off, each is a module
that does nothing.

Parameter names follow GPT-2's layout (transformer.wte, transformer.h.0.attn.c_attn, ...), so
GPT-2 weights map one to one; GPT-2 stores its Linear weights transposed (Conv1D), nothing else
differs.
"""

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import BlockMask, CausalSelfAttention, NoRotation, Rotary, flex_block_mask, no_rotation
from .gpt_config import GPTConfig
from .kv_cache import KVCache, RollingKVCache
from .masks import Rule, dense_mask, document_ids, document_positions, is_plain_causal, pattern_rule
from .rope import rope_frequencies
from .switches import (
    Backout,
    BigramTable,
    NeighbourEmbedding,
    NoBackout,
    NoSkips,
    NoValueEmbeddings,
    UNetSkips,
    ValueEmbeddings,
    value_table,
)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.vocab_size <= 0:
            raise ValueError(f"vocab_size={config.vocab_size}: set it to the tokenizer's vocabulary size")
        if config.attn_documents and not 0 <= config.eot_token < config.vocab_size:
            raise ValueError(
                f"attn_documents=true needs eot_token, the id of the token that separates documents, below "
                f"vocab_size={config.vocab_size} (got {config.eot_token}: the tokenizer has none)"
            )
        self.config = config
        self.plain_causal = is_plain_causal(config)  # no mask needed: attention's fused causal path
        # the dtype of the keys and values in new KV caches; None: the model's (prepare_decoding may set one)
        self.cache_dtype: torch.dtype | None = None
        self.block_masks = {}  # FlexAttention masks of a pattern that reads nothing of the row, by length
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding
                wpe=POSITION_TABLES[config.pos_emb](config),  # added to the token embedding
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, layer_idx) for layer_idx in range(config.n_layer)]),
                ln_f=norm_layer(config),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # the residual-stream switches, each a module that does nothing when off
        self.value_embeds = ValueEmbeddings(config) if config.value_embeds else NoValueEmbeddings(config.n_layer)
        self.skips = UNetSkips(config.n_layer) if config.unet_skips else NoSkips()
        self.backout = Backout(config.n_layer) if config.backout else NoBackout()
        if config.tie_embeddings:
            # the output projection shares the token embedding's weights (GPT-2 ties them)
            self.lm_head.weight = self.transformer.wte.weight
        self.softcap = SoftCap(config.logit_softcap) if config.logit_softcap > 0 else nn.Identity()
        # what the position embedding (or rotation) counts from: the row's start, or each document's
        self.positions = DocumentPositions(config.eot_token) if config.attn_document_positions else RowPositions()
        # the smear gate and the bigram table read the token before each token; without them, a token is its row
        reads_previous = config.smear_gate or config.bigram_embed
        self.embed = NeighbourEmbedding(config) if reads_previous else TokenEmbedding()
        # the training loss: next-token cross-entropy, with multi-token prediction's later targets beside it
        self.loss = MultiTokenLoss(config.mtp_tokens, config.mtp_weight) if config.mtp_tokens else NextTokenLoss()
        # RoPE: each layer turns its queries and keys by the tokens' positions; learned: no turn
        self.rotary = Rotary(*rope_frequencies(config)) if config.pos_emb == "rope" else NoRotation()
        self.apply(_init_weights)
        # scale residual projections by 1/sqrt(2 * n_layer) so the residual stream does not grow with
        # depth: each block adds two of them (GPT-2 paper, section 2.3). zero_init_proj: zero, so each
        # block starts as the identity and the stream as the embedding (modded-nanogpt); the first
        # step's gradient of a zero c_proj is its input times the loss's gradient, not zero
        std = 0.02 / math.sqrt(2 * config.n_layer)
        init_proj = nn.init.zeros_ if config.zero_init_proj else partial(nn.init.normal_, mean=0.0, std=std)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                init_proj(param)
        if not config.tie_embeddings:
            # an untied head starts at zero (as in modded-nanogpt): the first prediction is uniform,
            # and the head grows from what the blocks learn to say
            nn.init.zeros_(self.lm_head.weight)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        pad: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx: (B, T) token ids. Returns logits (B, T, vocab_size) and, when targets (B, T) are
        given, the mean cross-entropy over targets that are not -1 (padding, untrained tokens; 0 if all are).
        logits_to_keep: compute the logits of the last logits_to_keep positions only, (B,
        logits_to_keep, vocab_size); 0 = all. Scoring a long context needs only its last position's,
        and the output layer is the largest product of the pass.

        With a cache, idx continues the tokens already cached: it fills the cache's next T slots.
        pad: (B,) left padding, so rows of different lengths share a batch: the first pad[b] slots
        of row b (counted from the start of the cache, or of idx without one) hold filler tokens
        that no query attends to, and the row's first real token has position 0. Pass the same pad
        with every call on one cache.
        prefix: (B,) with attn_prefix_lm, the bidirectional prefix length of each row (positions
        0 .. prefix[b] - 1 see each other); None is no prefix. Pass the same prefix with every call
        on one cache.
        """
        B, T = idx.shape
        if cache is None:
            if T > self.config.block_size:
                raise ValueError(f"{T} positions exceed the model's block_size={self.config.block_size}")
            slots = torch.arange(T, device=idx.device)  # (T,)
        else:
            cache.claim(T)  # raises past cache.max_len, which new_cache keeps within block_size
            slots = cache.slots(T)  # (T,)
        positions = slots[None] if pad is None else slots[None] - pad[:, None]  # (1 or B, T); negative: padding
        mask = self.attention_mask(idx, positions, slots, cache, pad, prefix)  # the pattern reads row positions
        tok_emb = self.embed(self.transformer.wte, idx, positions, cache)  # (B, T, C); reads row positions
        positions = self.positions(idx, positions, cache)  # (1 or B, T): what position embeddings see
        x = tok_emb + self.transformer.wpe(positions.clamp(min=0))  # (B, T, C)
        x = self.transformer.drop(x)
        rotate = self.rotary(positions)  # the same turn for every layer's queries and keys
        value_embeddings = self.value_embeds(idx)  # per block: (B, T, kv_heads * head_size), or None
        # the stream before the first block and after each, kept where skips or backout read it (else
        # None: without autograd, each block's output is freed once the next block has read it)
        keep = self.config.unet_skips or self.config.backout
        residuals = [x if keep else None]
        for block, value_embedding in zip(self.transformer.h, value_embeddings, strict=True):
            x = block(self.skips(x, residuals), mask, cache, rotate, value_embedding)
            residuals.append(x if keep else None)
        x = self.transformer.ln_f(self.backout(x, residuals))
        if cache is not None:
            cache.advance(T)
        logits = self.softcap(self.lm_head(x[:, -logits_to_keep:]))  # (B, T or logits_to_keep, vocab_size)
        if targets is None:
            return logits, None
        return logits, self.loss(logits, targets)

    def attention_mask(
        self,
        idx: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: KVCache | None,
        pad: torch.Tensor | None,
        prefix: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The (B, 1, T, kv_len) mask of the pattern's rule for these queries over the keys they
        read, or None for plain causal attention over exactly these tokens (or a cache's written
        slots), which attention applies itself without building a mask. On CUDA, a whole sequence
        without cache or padding gets a FlexAttention BlockMask of the rule instead (SDPA's dense
        mask where dropout is on: FlexAttention has none)."""
        needs_mask = pad is not None or (cache is not None and cache.static)
        if self.plain_causal and not needs_mask:
            return None
        B = idx.size(0)
        q_pos = positions.expand(B, -1)  # (B, T)
        k_pos = q_pos if cache is None else cache.key_positions(q_pos, slots, pad).expand(B, -1)  # (B, kv_len)
        doc_ids = None
        if self.config.attn_documents and cache is None:
            doc_ids, _ = document_ids(idx, self.config.eot_token, q_pos)
        elif self.config.attn_documents:
            doc_ids = cache.document_ids(idx, self.config.eot_token, q_pos)
        rule = pattern_rule(self.config, prefix, doc_ids)
        dropout = self.training and self.config.dropout > 0
        if idx.is_cuda and cache is None and pad is None and not dropout:
            return self.block_mask(rule, B, idx.size(1), idx.device)
        return dense_mask(rule, q_pos, k_pos)

    def block_mask(self, rule: Rule, batch_size: int, T: int, device: torch.device) -> BlockMask:
        """The rule's FlexAttention BlockMask. A pattern that reads nothing of the row (window,
        sinks, block-causal) has one mask per length, built once and kept; prefix lengths and
        documents change with every batch."""
        if self.config.attn_prefix_lm or self.config.attn_documents:
            return flex_block_mask(rule, batch_size, T, device)
        key = (T, str(device))
        if key not in self.block_masks:
            self.block_masks[key] = flex_block_mask(rule, None, T, device)
        return self.block_masks[key]

    def new_cache(self, batch_size: int, max_len: int | None = None, static: bool = False) -> KVCache:
        """An empty KV cache for batch_size sequences of up to max_len (default and at most
        block_size) tokens, on the model's device and in cache_dtype (None: the model's dtype; attention
        still computes in the model's dtype, the cache's keys widened as read). static: attention reads every
        slot, masked, so that each step has the same shapes (for torch.compile); see KVCache.
        A sliding-window model gets a rolling cache of attn_window + attn_sinks slots when that is
        fewer than max_len."""
        cfg = self.config
        max_len = max_len or cfg.block_size
        if max_len > cfg.block_size:
            raise ValueError(f"a cache of {max_len} positions exceeds the model's block_size={cfg.block_size}")
        weight = self.transformer.wte.weight  # not lm_head's: packed for inference, it has no .weight
        dtype = self.cache_dtype or weight.dtype
        shape = (cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_size, max_len)
        if cfg.attn_window and cfg.attn_window + cfg.attn_sinks < max_len:
            window = {"window": cfg.attn_window, "sinks": cfg.attn_sinks}
            return RollingKVCache(*shape, **window, device=weight.device, dtype=dtype, static=static)
        return KVCache(*shape, weight.device, dtype, static)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count. A tied token embedding counts once (it is also the output layer);
        non_embedding leaves out the tables that do no matrix multiply: the position embedding, the
        value embeddings, the bigram table, and the token embedding when the head is untied."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for p in self.transformer.wpe.parameters())
            n -= sum(table.weight.numel() for table in getattr(self.value_embeds, "tables", ()))
            n -= sum(part.weight.numel() for part in getattr(self.embed, "parts", ()) if isinstance(part, BigramTable))
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
        return n


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = norm_layer(config)
        self.attn = CausalSelfAttention(
            config.n_embd,
            config.n_head,
            config.head_size,
            config.dropout,
            config.bias,
            layer_idx,
            n_kv_head=config.n_kv_head,
            qk_norm=partial(norm_layer, config) if config.qk_norm else None,
            value_mix=value_table(config, layer_idx) is not None,
            qkv_bias=config.qkv_bias,
        )
        self.ln_2 = norm_layer(config)
        self.mlp = MLP_MODULES[config.mlp](config)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rotate: Callable[[torch.Tensor], torch.Tensor] = no_rotation,
        value_embedding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask, cache, rotate, value_embedding)
        x = x + self.mlp(self.ln_2(x))
        return x


def norm_layer(config: GPTConfig, features: int = 0) -> nn.Module:
    """The normalisation config.norm names, over the last dimension's features (0 = n_embd: the
    residual stream; QK-norm passes the width of one head)."""
    features = features or config.n_embd
    if config.norm == "rmsnorm":
        return nn.RMSNorm(features, eps=config.norm_eps)  # x / rms(x) * gain: no mean to subtract, no bias
    return nn.LayerNorm(features, eps=config.norm_eps, bias=config.bias)


class MLP(nn.Module):
    """Position-wise feed-forward network, 4x wide: c_proj(act(c_fc(x))), with GPT-2's
    tanh-approximated GELU or with ReLU squared (So et al., Primer, 2021; modded-nanogpt)."""

    def __init__(self, config: GPTConfig, activation: nn.Module):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.act = activation
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class ReLUSquared(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


class SwiGLU(nn.Module):
    """Gated feed-forward network: c_proj(silu(gate) * value), with gate and value from one c_fc
    (Shazeer, GLU Variants Improve Transformer, 2020)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.hidden = config.mlp_hidden
        self.c_fc = nn.Linear(config.n_embd, 2 * self.hidden, bias=config.bias)  # gate and value
        self.c_proj = nn.Linear(self.hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.c_fc(x).split(self.hidden, dim=-1)  # (B, T, hidden) each
        return self.dropout(self.c_proj(F.silu(gate) * value))


class SoftCap(nn.Module):
    """cap * tanh(x / cap): close to x where |x| << cap, never beyond +-cap (Gemma 2; modded-nanogpt)."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cap * torch.tanh(x / self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


class TokenEmbedding(nn.Module):
    """A token's embedding is its row of the token table (GPT-2)."""

    def forward(
        self, wte: nn.Embedding, idx: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        return wte(idx)


class NextTokenLoss(nn.Module):
    """The mean cross-entropy of each position's logits against its target, over the targets that
    are not -1 (padding, untrained tokens)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits: (B, T, vocab_size); targets: (B, T). A scalar."""
        B, T = targets.shape
        # the mean over the targets that count: their sum over their number, which is 0 (not NaN, as
        # cross_entropy's mean gives) when none does, as in a chat micro-batch of prompts only
        losses = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-1, reduction="sum")
        return losses / (targets != -1).sum().clamp(min=1)

    def set_progress(self, progress: float) -> None:
        """Where training stands (0 to 1): nothing here follows it."""


class MultiTokenLoss(NextTokenLoss):
    """Multi-token prediction as an auxiliary loss, with no parameters of its own (modded-nanogpt,
    record of 2025-12-22): in training, position t's logits learn its own target (weight 1) and the
    `tokens` targets after it, the k-th with weight `weight`^k, summed over the number of own targets.

    The extra weights fade to 0 over training, the furthest first: training is cut into tokens + 1
    equal parts; in the first, the furthest target's weight falls linearly to 0, in the next the one
    before it, and so on; the last part trains on the next token alone. The trainer tells the loss
    where training stands (set_progress: the step over the learning-rate schedule's length). In eval
    mode it is NextTokenLoss: evaluation sees the next-token loss only."""

    def __init__(self, tokens: int, weight: float):
        super().__init__()
        self.tokens = tokens
        self.weight = weight
        # where training stands, on the model's device: set each step by a fill, without a host-to-device copy
        self.register_buffer("progress", torch.zeros(()), persistent=False)

    def weights_at(self, progress: float | torch.Tensor) -> torch.Tensor:
        """(1 + tokens,) the weight of each target, its own first, when training is `progress` done."""
        progress = torch.as_tensor(progress, dtype=torch.float32)
        parts = self.tokens + 1
        k = torch.arange(1, parts, device=progress.device)  # the later targets
        # the k-th later target's weight falls from 1 to 0 in part tokens - k (counted from 0)
        fading = (parts - k - progress * parts).clamp(0.0, 1.0)
        return torch.cat([torch.ones(1, device=progress.device), self.weight**k * fading])

    @property
    def weights(self) -> torch.Tensor:
        """(1 + tokens,) the weights at the progress last set."""
        return self.weights_at(self.progress)

    def set_progress(self, progress: float) -> None:
        self.progress.fill_(progress)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(logits, targets)
        # position t's k-th later target is target t + k, never a token t sees: no pattern shows position t a
        # later token than it shows t + k, which does not see its own target; -1 past the row's end
        later = F.pad(targets, (0, self.tokens), value=-1).unfold(1, self.tokens + 1, 1)  # (B, T, 1 + tokens)
        logits = logits.float()  # as cross_entropy computes under autocast
        picked = logits.gather(-1, later.clamp(min=0))  # (B, T, 1 + tokens): each target's logit
        losses = (logits.logsumexp(-1, keepdim=True) - picked) * (later != -1)  # cross-entropy of each target
        return (losses * self.weights).sum() / (targets != -1).sum().clamp(min=1)


class RowPositions(nn.Module):
    """A token's position is its place in the row (counted from the row's first real token): GPT-2."""

    def forward(self, idx: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        return positions


class DocumentPositions(nn.Module):
    """A token's position is its place in its document (attn_document_positions): 0 at the row's first
    token and at each end-of-text token, which opens the document after it. A document then reads
    the same, position embeddings included, wherever it is packed in a row."""

    def __init__(self, eot_token: int):
        super().__init__()
        self.eot_token = eot_token

    def forward(self, idx: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx: (B, T) tokens at row positions (1 or B, T); with a cache, idx continues its tokens."""
        positions = positions.expand_as(idx)  # (B, T)
        if cache is None:
            return document_positions(idx, self.eot_token, positions)[0]
        return cache.document_positions(idx, self.eot_token, positions)

    def extra_repr(self) -> str:
        return f"eot_token={self.eot_token}"


class NoPositionTable(nn.Module):
    """Stands in for the learned position table with RoPE, where attention rotates queries and keys
    by position instead: adds nothing to the token embedding."""

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), device=positions.device)


POSITION_TABLES = {  # the values of config.pos_emb, each with the module it builds
    "learned": lambda config: nn.Embedding(config.block_size, config.n_embd),
    "rope": lambda config: NoPositionTable(),
}
MLP_MODULES = {  # the values of config.mlp, each with the module it builds
    "gelu": lambda config: MLP(config, nn.GELU(approximate="tanh")),
    "relu2": lambda config: MLP(config, ReLUSquared()),
    "swiglu": SwiGLU,
}


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: normal(0, 0.02) weights, zero biases; LayerNorms keep weight 1, bias 0."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
