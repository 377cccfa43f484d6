"""A GPT-2 style decoder-only transformer.

Read top to bottom: the config, the model's forward pass, then the block, norms and MLPs it is
built from. Attention is in attention.py, the attention patterns in masks.py and the KV cache in
kv_cache.py, beside this file.

The defaults are GPT-2. A few keys swap in later practice (rotary positions, RMSNorm, QK-norm,
a ReLU^2 or SwiGLU MLP, grouped-query attention, heads of a width of their own, an untied output
head, soft-capped logits), and a few of modded-nanogpt's speedrun change the residual stream
(value embeddings, U-net skips between early and late blocks, backout, zero-initialised output
projections); each is resolved once, when the model is built, into the module it names, so
forward() reads the same for every choice.

Parameter names follow GPT-2's layout (transformer.wte, transformer.h.0.attn.c_attn, ...), so
GPT-2 weights map one to one; GPT-2 stores its Linear weights transposed (Conv1D), nothing else
differs.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import BlockMask, CausalSelfAttention, NoRotation, Rotary, flex_block_mask, no_rotation
from .kv_cache import KVCache, RollingKVCache
from .masks import Rule, dense_mask, document_ids, document_positions, is_plain_causal, pattern_rule

PATTERN_LIMITS = {
    "attn_sinks": "sinks are the first positions of the context",
    "attn_block": "each position learns the token attn_block positions ahead, which must be in the context",
}
# pairs of patterns that contradict each other, and why
PATTERN_CONFLICTS = {
    ("attn_prefix_lm", "attn_block"): "both let a query see later positions, by different rules",
    ("attn_prefix_lm", "attn_window"): "the window would cut the bidirectional prefix",
    ("attn_prefix_lm", "attn_documents"): "the prefix is the start of the row, which documents cut",
    ("attn_prefix_lm", "attn_sinks"): "a sink sees only its own past, but the prefix is read both ways",
    ("attn_block", "attn_window"): "the window would cut the blocks",
    ("attn_block", "attn_documents"): "blocks would straddle documents",
    ("attn_block", "attn_sinks"): "a sink sees only its own past, but a block is read both ways",
    ("attn_sinks", "attn_documents"): "every document would see the first tokens of the row's first document",
}

SMEAR_GATE_FEATURES = 12  # the smear gate reads a token's first 12 embedding features (modded-nanogpt's choice)
# two odd 32-bit multipliers (Knuth's golden-ratio one and an xxHash prime): the XOR of a pair's products spreads
# the pairs over the buckets of a hashed bigram table, where a sum (prev * vocab + cur) would collide in runs
BIGRAM_HASH = (2654435761, 2246822519)
MAX_ROPE_BASE = 1e12  # rope_base's upper end: far beyond the bases in use, it catches a value typed wrong


def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class GPTConfig:
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # width of the residual stream
    head_dim: int = 0  # width of one attention head; 0 = n_embd / n_head (Qwen3-0.6B: 128, with 1024 / 16 = 64)
    block_size: int = 1024  # context length: the most positions the model sees at once
    vocab_size: int = 0  # token ids the model predicts; 0 = the dataset's vocabulary
    dropout: float = 0.0  # dropout probability on embeddings, attention weights and residual branches
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    pos_emb: str = "learned"  # "learned" (GPT-2: a table of block_size positions) or "rope" (rotary, in attention)
    rope_base: float = 10000.0  # rope: position p turns feature pair i by p * rope_base^(-2i/head_dim)
    norm: str = "layernorm"  # "layernorm" (GPT-2) or "rmsnorm" (no mean subtracted, no bias)
    norm_eps: float = 1e-5  # added to the variance (or mean square) before its root, in every norm
    qk_norm: bool = False  # normalise each head's queries and keys (with `norm`'s kind) before their dot product
    mlp: str = "gelu"  # "gelu" (GPT-2), "relu2" (ReLU squared) or "swiglu" (gated, 2/3 as wide: as many weights)
    mlp_width: int = 0  # the MLP's hidden width; 0 = 4 * n_embd (8/3 * n_embd for swiglu)
    n_kv_head: int = 0  # key/value heads, shared by groups of query heads; 0 = n_head, 1 = multi-query
    tie_embeddings: bool = True  # the output head is the token embedding (GPT-2); false: its own, zero-initialised
    logit_softcap: float = 0.0  # logits become cap * tanh(logits / cap), bounded by +-cap; 0 = off, else >= 1
    # attention pattern (model/masks.py); all off is plain causal attention
    attn_window: int = 0  # sliding window: a query sees the last attn_window positions, itself included; 0 = all
    attn_sinks: int = 0  # the first attn_sinks positions stay visible to all later queries as the window slides
    attn_prefix_lm: bool = False  # a prefix of each row attends both ways (random in training, the prompt in sampling)
    attn_block: int = 0  # block-causal: full attention inside blocks of attn_block positions, causal between; 0 = off
    attn_documents: bool = False  # a query sees only its own document; documents start at eot_token
    attn_document_positions: bool = False  # with attn_documents: positions restart at 0 at each document's start
    eot_token: int = -1  # id of the end-of-text token that separates documents; -1 = the dataset tokenizer's
    # residual-stream switches (modded-nanogpt's speedrun); all off is GPT-2's stack
    value_embeds: int = 0  # N token tables mixed into attention values (table i: layers i, n_layer-N+i); 0..n_layer//2
    unet_skips: bool = False  # block n_layer-1-i adds block i's output (i < n_layer // 2) to its input, weight learned
    backout: bool = False  # subtract a learned multiple of the residual after 2 * n_layer // 3 blocks before ln_f
    zero_init_proj: bool = False  # attention's and the MLP's c_proj start at zero, not at GPT-2's scaled normal
    # neighbouring-token switches (modded-nanogpt's speedrun)
    smear_gate: bool = False  # a token's embedding adds the previous token's through a learned gate, closed at first
    bigram_embed: int = 0  # rows of a zero-initialised table of token pairs: vocab^2+1 exact, fewer hashed; 0 = off
    mtp_tokens: int = 0  # in training, each position also learns the mtp_tokens targets after its own; 0 = off
    mtp_weight: float = 0.5  # the k-th extra target weighs mtp_weight^k (its own: 1), fading to 0, the furthest first

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name}={value} must be a positive integer")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size={self.vocab_size} must be positive (or 0: from the dataset)")
        if self.head_dim < 0:
            raise ValueError(f"head_dim={self.head_dim} must be a positive width, or 0 for n_embd / n_head")
        if self.head_dim == 0 and self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head} "
                f"(choose n_embd = k * n_head, or set head_dim)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        for name, choices in (("pos_emb", POSITION_EMBEDDINGS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        if self.pos_emb == "rope" and self.head_dim % 2 != 0:
            raise ValueError(
                f"pos_emb='rope' rotates pairs of features, but head_dim={self.head_dim} is odd (choose an even one)"
            )
        if self.pos_emb == "rope" and self.head_size % 2 != 0:
            raise ValueError(
                f"pos_emb='rope' rotates pairs of features, but head_dim = n_embd / n_head = {self.head_size} "
                f"is odd (choose n_embd and n_head with an even quotient, or set an even head_dim)"
            )
        if not 0 < self.norm_eps < 1:
            raise ValueError(f"norm_eps={self.norm_eps} must be in (0, 1)")
        if self.mlp_width < 0:
            raise ValueError(f"mlp_width={self.mlp_width} must be a positive width, or 0 for the default")
        if self.rope_base <= 1:
            raise ValueError(f"rope_base={self.rope_base} must be greater than 1")
        if self.rope_base > MAX_ROPE_BASE:
            raise ValueError(
                f"rope_base={self.rope_base} is outside the accepted range (1, {MAX_ROPE_BASE:g}] (far beyond the "
                f"bases in use: 10000 for short contexts, up to about 1e6 and more for long ones)"
            )
        if self.n_kv_head < 0 or (self.n_kv_head > 0 and self.n_head % self.n_kv_head != 0):
            raise ValueError(
                f"n_kv_head={self.n_kv_head} does not divide n_head={self.n_head} "
                f"(use a divisor of n_head, or 0 for n_head)"
            )
        if self.logit_softcap < 0:
            raise ValueError(f"logit_softcap={self.logit_softcap} must be 0 (off) or a positive cap")
        if 0 < self.logit_softcap < 1:
            raise ValueError(
                f"logit_softcap={self.logit_softcap} must be 0 (off) or at least 1: a cap below 1 keeps any two "
                f"logits within 2 * cap of each other, so no token can be predicted with confidence"
            )
        self._check_pattern()
        if not 0 <= self.value_embeds <= self.n_layer // 2:
            raise ValueError(
                f"value_embeds={self.value_embeds} is outside the accepted range 0 .. n_layer // 2 = "
                f"{self.n_layer // 2} (each table serves two of the n_layer={self.n_layer} layers, one at each end)"
            )
        self._check_neighbours()

    def _check_pattern(self) -> None:
        for name in ("attn_window", "attn_sinks", "attn_block"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be 0 (off) or a positive number of positions")
        for name in ("attn_sinks", "attn_block"):
            if getattr(self, name) >= self.block_size:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be smaller than block_size={self.block_size} "
                    f"({PATTERN_LIMITS[name]})"
                )
        for (first, second), reason in PATTERN_CONFLICTS.items():
            if getattr(self, first) and getattr(self, second):
                raise ValueError(
                    f"{first}={_toml(getattr(self, first))} cannot be combined with "
                    f"{second}={_toml(getattr(self, second))}: {reason} (switch one of them off)"
                )
        if self.attn_document_positions and not self.attn_documents:
            raise ValueError(
                "attn_document_positions=true restarts positions at each document, but attn_documents=false "
                "marks no documents (set attn_documents=true as well, or attn_document_positions=false)"
            )
        if self.eot_token < -1:
            raise ValueError(f"eot_token={self.eot_token} must be a token id, or -1 (the dataset tokenizer's)")

    def _check_neighbours(self) -> None:
        if self.bigram_embed < 0 or self.bigram_embed == 1:
            raise ValueError(
                f"bigram_embed={self.bigram_embed} must be 0 (off) or at least 2 rows (one for the tokens with no "
                f"previous token, the others for the pairs)"
            )
        if not 0 <= self.mtp_tokens < self.block_size:
            raise ValueError(
                f"mtp_tokens={self.mtp_tokens} must be 0 (off) or a number of extra targets below "
                f"block_size={self.block_size}"
            )
        if not 0 < self.mtp_weight <= 1:
            raise ValueError(
                f"mtp_weight={self.mtp_weight} must be in (0, 1]: its own target weighs 1, later ones less"
            )

    @property
    def head_size(self) -> int:
        """The width of one attention head: head_dim, or n_embd / n_head when it is 0."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is 0."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width: mlp_width, or by default 4 * n_embd, or 2/3 of that for SwiGLU,
        whose three matrices then hold as many weights as the two of the others (LLaMA's choice)."""
        if self.mlp_width:
            return self.mlp_width
        return 8 * self.n_embd // 3 if self.mlp == "swiglu" else 4 * self.n_embd

    @property
    def bigram_rows(self) -> int:
        """The bigram table's rows: one per pair of tokens and one for no previous token where
        bigram_embed allows as many (exact), else bigram_embed (hashed)."""
        return min(self.bigram_embed, self.vocab_size**2 + 1)

    def num_params(self) -> int:
        """The parameters of GPT(self), counted without building it; a tied output layer is the
        token embedding and counts once."""
        C, hidden = self.n_embd, self.mlp_hidden
        per_feature = 2 if self.norm == "layernorm" and self.bias else 1  # a norm's gain, and bias
        norm = per_feature * C
        q_dim = self.n_head * self.head_size  # what the heads read and write: n_embd unless head_dim is set
        qkv = q_dim + 2 * self.kv_heads * self.head_size  # c_attn's outputs: queries, keys, values
        qk_norm = 2 * per_feature * self.head_size if self.qk_norm else 0
        attention = qkv * C + q_dim * C + (qkv + C if self.bias else 0) + qk_norm  # c_attn, c_proj
        mlp_matrices = 3 if self.mlp == "swiglu" else 2  # SwiGLU's c_fc holds gate and value
        mlp = mlp_matrices * C * hidden + ((mlp_matrices - 1) * hidden + C if self.bias else 0)
        per_block = 2 * norm + attention + mlp
        head = 0 if self.tie_embeddings else self.vocab_size * C
        positions = self.block_size * C if self.pos_emb == "learned" else 0
        value_tables = self.value_embeds * self.vocab_size * self.kv_heads * self.head_size
        value_mixes = 2 * 2 * self.value_embeds  # a and b in each of the 2N layers the tables serve
        skips = self.n_layer // 2 if self.unet_skips else 0
        residual = value_tables + value_mixes + skips + (1 if self.backout else 0)
        smear = min(SMEAR_GATE_FEATURES, C) + 1 if self.smear_gate else 0  # the gate's weights and its scale
        bigram = self.bigram_rows * C if self.bigram_embed else 0
        return self.n_layer * per_block + self.vocab_size * C + positions + norm + head + residual + smear + bigram


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
        self.block_masks = {}  # FlexAttention masks of a pattern that reads nothing of the row, by length
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embedding
                wpe=POSITION_EMBEDDINGS[config.pos_emb](config),  # added to the token embedding
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
        self.rotary = Rotary(config.rope_base, config.head_size) if config.pos_emb == "rope" else NoRotation()
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
        block_size) tokens, on the model's device and in its dtype. static: attention reads every
        slot, masked, so that each step has the same shapes (for torch.compile); see KVCache.
        A sliding-window model gets a rolling cache of attn_window + attn_sinks slots when that is
        fewer than max_len."""
        cfg = self.config
        max_len = max_len or cfg.block_size
        if max_len > cfg.block_size:
            raise ValueError(f"a cache of {max_len} positions exceeds the model's block_size={cfg.block_size}")
        weight = self.transformer.wte.weight  # not lm_head's: packed for inference, it has no .weight
        shape = (cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_size, max_len)
        if cfg.attn_window and cfg.attn_window + cfg.attn_sinks < max_len:
            window = {"window": cfg.attn_window, "sinks": cfg.attn_sinks}
            return RollingKVCache(*shape, **window, device=weight.device, dtype=weight.dtype, static=static)
        return KVCache(*shape, weight.device, weight.dtype, static)

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
        )
        self.ln_2 = norm_layer(config)
        self.mlp = MLPS[config.mlp](config)

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


POSITION_EMBEDDINGS = {  # the values of config.pos_emb, each with the module it builds
    "learned": lambda config: nn.Embedding(config.block_size, config.n_embd),
    "rope": lambda config: NoPositionTable(),
}
NORMS = ("layernorm", "rmsnorm")  # the values of config.norm, built by norm_layer
MLPS = {  # the values of config.mlp, each with the module it builds
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
