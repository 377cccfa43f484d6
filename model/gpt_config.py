"""The model's config: its sizes and switches, each checked where it is set.

GPTConfig holds every key of the `[model]` section (docs/configs.md); the defaults are GPT-2. Its
checks refuse, with the key, the value and what would be accepted, any combination the model
cannot build; model/gpt.py builds the model from a config that passed them.
"""

from dataclasses import dataclass

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
MAX_ROPE_BASE = 1e12  # rope_base's upper end: far beyond the bases in use, it catches a value typed wrong
POSITION_EMBEDDINGS = ("learned", "rope")  # the values of pos_emb (the modules: model/gpt.py's POSITION_TABLES)
NORMS = ("layernorm", "rmsnorm")  # the values of norm, built by model/gpt.py's norm_layer
MLPS = ("gelu", "relu2", "swiglu")  # the values of mlp (the modules: model/gpt.py's MLP_MODULES)
ROPE_SCALINGS = ("none", "llama3", "yarn")  # the values of rope_scaling (the tables: model/rope.py)


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
    qkv_bias: bool = False  # with bias=false: biases on the queries, keys and values alone (Qwen2)
    pos_emb: str = "learned"  # "learned" (GPT-2: a table of block_size positions) or "rope" (rotary, in attention)
    rope_base: float = 10000.0  # rope: position p turns feature pair i by p * rope_base^(-2i/head_dim)
    # a stretched RoPE (model/rope.py): the frequencies of a model pretrained with rope_original_context positions
    rope_scaling: str = "none"  # "none", "llama3" (Llama 3.1, 3.2) or "yarn" (Qwen's long context)
    rope_factor: float = 1.0  # llama3, yarn: how many times longer a context the frequencies are stretched for
    rope_original_context: int = 0  # llama3, yarn: the context length the model was pretrained with
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above rope_original_context / this are divided
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below rope_original_context / this are kept
    rope_beta_fast: float = 32.0  # yarn: pairs turning more often than this in rope_original_context are kept
    rope_beta_slow: float = 1.0  # yarn: pairs turning less often than this are divided by rope_factor
    rope_attention_factor: float = 0.0  # yarn: cos and sin are multiplied by it; 0 = 0.1 ln(rope_factor) + 1
    rope_truncate: bool = True  # yarn: the ramp between fast and slow pairs starts and ends on whole pairs
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
        self._check_rope_scaling()
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

    def _check_rope_scaling(self) -> None:
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling={self.rope_scaling!r} is not one of {', '.join(ROPE_SCALINGS)}")
        if self.rope_scaling == "none":
            return
        if self.rope_factor < 1:
            raise ValueError(
                f"rope_factor={self.rope_factor} must be at least 1 with rope_scaling={self.rope_scaling!r} (the "
                f"frequencies are stretched for a context rope_factor times rope_original_context long)"
            )
        if self.rope_original_context <= 0:
            raise ValueError(
                f"rope_original_context={self.rope_original_context} must be the positive context length the model "
                f"was pretrained with, with rope_scaling={self.rope_scaling!r}"
            )
        if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError(
                f"rope_low_freq_factor={self.rope_low_freq_factor} and rope_high_freq_factor="
                f"{self.rope_high_freq_factor} must be positive, the low one the smaller (Llama 3.1's: 1 and 4)"
            )
        if not 0 < self.rope_beta_slow < self.rope_beta_fast:
            raise ValueError(
                f"rope_beta_slow={self.rope_beta_slow} and rope_beta_fast={self.rope_beta_fast} must be positive "
                f"numbers of turns, the slow one the smaller (YaRN's: 1 and 32)"
            )
        if self.rope_attention_factor < 0:
            raise ValueError(
                f"rope_attention_factor={self.rope_attention_factor} must be positive, or 0 for 0.1 ln(rope_factor) + 1"
            )

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
        biases = qkv + C if self.bias else qkv if self.qkv_bias else 0  # c_attn's and c_proj's, or c_attn's alone
        attention = qkv * C + q_dim * C + biases + qk_norm  # c_attn, c_proj
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
