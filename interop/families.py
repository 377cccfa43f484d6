"""Hugging Face model families as data: which of our switches each computes, and how its
config.json keys and tensor names map to GPTConfig and our parameters.

FAMILIES is the one table. Export picks the first family that computes every switch of a model;
import reads a folder's model_type; both, the refusals and the docs' family table read FAMILIES
and nothing else. A tensor mapping that needs arithmetic names one of the CONVERSIONS, each a pair
of small functions that undo each other bit for bit:

    fused q/k/v:   our c_attn holds the rows of q_proj, k_proj and v_proj one after the other
    gate/up:       our SwiGLU c_fc holds gate_proj's rows, then up_proj's
    per head:      StableLM keeps one QK LayerNorm per head; ours is one shared by all heads
    Conv1D:        GPT-2 stores its Linear weights transposed, (in, out)

RoPE needs no conversion: our Rotary pairs feature i with i + head_dim/2, as transformers'
rotate_half does, with the same angles position * base^(-2i/head_dim).

Problems raise ValueError naming the key or tensor and what would be accepted.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from model import GPT, GPTConfig
from trainer.checkpoint import non_finite

ANY = None  # a switch a family computes at every value


@dataclass(frozen=True)
class Conversion:
    """How one of our tensors becomes a family's tensors (a list: one, or a split) and back."""

    to_theirs: Callable[[torch.Tensor, GPTConfig, int], list[torch.Tensor]]
    to_ours: Callable[[list[torch.Tensor], GPTConfig], torch.Tensor]


def split_qkv(tensor: torch.Tensor, config: GPTConfig, count: int = 3) -> list[torch.Tensor]:
    """c_attn's weight (q_dim + 2 * kv_dim, C) or bias (q_dim + 2 * kv_dim,) -> q, k and v rows
    (q_dim: n_head heads, kv_dim: kv_heads heads, each head_size wide)."""
    q_dim, kv_dim = config.n_head * config.head_size, config.kv_heads * config.head_size
    return list(tensor.split([q_dim, kv_dim, kv_dim], dim=0))


def split_gate_up(tensor: torch.Tensor, config: GPTConfig, count: int = 2) -> list[torch.Tensor]:
    """SwiGLU's c_fc (2 * hidden, C) or its bias -> gate_proj's rows, up_proj's rows."""
    return list(tensor.split(config.mlp_hidden, dim=0))


def fuse_rows(tensors: list[torch.Tensor], config: GPTConfig) -> torch.Tensor:
    """The inverse of split_qkv and split_gate_up: the rows one after the other."""
    return torch.cat(tensors, dim=0)


def copy_per_head(tensor: torch.Tensor, config: GPTConfig, count: int) -> list[torch.Tensor]:
    """One (head_dim,) norm weight shared by all heads -> a copy for each of count heads."""
    return [tensor.clone() for _ in range(count)]


def shared_by_heads(tensors: list[torch.Tensor], config: GPTConfig) -> torch.Tensor:
    """Per-head norm weights -> the one weight they all equal; heads that differ cannot be shared."""
    if any(not torch.equal(tensor, tensors[0]) for tensor in tensors[1:]):
        raise ValueError("its heads have norm weights that differ, where this model shares one among all heads")
    return tensors[0]


def transpose(tensor: torch.Tensor, config: GPTConfig, count: int = 1) -> list[torch.Tensor]:
    return [tensor.t()]


def same(tensor: torch.Tensor, config: GPTConfig, count: int = 1) -> list[torch.Tensor]:
    return [tensor]


CONVERSIONS = {
    "same": Conversion(same, lambda tensors, config: tensors[0]),
    "conv1d": Conversion(transpose, lambda tensors, config: tensors[0].t()),
    "fused_qkv": Conversion(split_qkv, fuse_rows),
    "fused_gate_up": Conversion(split_gate_up, fuse_rows),
    "per_head": Conversion(copy_per_head, shared_by_heads),
}


@dataclass(frozen=True)
class Weight:
    """One of our tensors and the family's tensors it is made of. {i} stands for each block,
    {h} for each head (of `heads`: "n_head" or "kv_heads")."""

    ours: str
    theirs: tuple[str, ...]
    convert: str = "same"
    when: str = ""  # "bias", "qk_norm" or "untied": the switch that gives us this tensor; "" always
    zero_when_off: bool = False  # the family always has it: zeros stand for our missing bias
    heads: str = ""


@dataclass(frozen=True)
class Gguf:
    """How llama.cpp runs a family: its architecture name in a GGUF file, and the two ways its loader
    differs from transformers' (the tensor names are gguf's own map of the family's names)."""

    arch: str  # general.architecture
    adjacent_rope: bool = False  # RoPE turns features 2i and 2i+1 together (llama.cpp's "norm" rope), not i and i + D/2
    output_required: bool = False  # it reads no tied output layer: a tied embedding is written again as the output
    # the stretched RoPEs it computes: llama3's table is a rope_freqs tensor only its "llama" reads; yarn is metadata
    rope_scalings: tuple[str, ...] = ("none", "yarn")


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class AutoModelForCausalLM builds
    computes: dict[str, tuple | None]  # switch -> the values the family computes (ANY: all)
    keys: dict[str, str | tuple[str, ...]]  # our setting -> their config.json key (a tuple: keys that must agree)
    defaults: dict[str, object]  # their keys' values when config.json leaves them out (their class's); absent: required
    defined: frozenset[str]  # every key their config class defines (_defined); any other is read by no model code
    fixed: dict[str, object]  # their keys that must hold this value to compute what we compute
    weights: tuple[Weight, ...]
    skipped: tuple[str, ...] = ()  # their tensors that are constants, not weights (GPT-2's stored causal mask)
    optional_prefix: str = ""  # a prefix some of their files leave off the tensor names
    ignored: tuple[str, ...] = ()  # their defined keys that compute nothing once `fixed` holds (Qwen3's unused window)
    aliases: dict[str, str] = field(default_factory=dict)  # their class's other names of keys (its attribute_map)
    gguf: Gguf | None = None  # how llama.cpp runs it (docs/shipping.md); None: --export-gguf refuses it


# our settings a family's config.json carries as keys of its own; see resolved() (RoPE's are in rope_parameters)
SETTINGS = (
    "n_layer", "n_head", "kv_heads", "n_embd", "head_size", "block_size", "vocab_size", "mlp_hidden", "norm_eps",
    "tie_embeddings", "bias", "qkv_bias", "qk_norm", "attn_window",
)  # fmt: skip
# the switches that decide the family, with the model's value read by switches()
SWITCHES = (
    "pos_emb", "rope_scaling", "norm", "qk_norm", "mlp", "grouped_query", "head_dim", "tie_embeddings", "bias",
    "qkv_bias", "logit_softcap", "attn_window", "attn_sinks", "attn_prefix_lm", "attn_block", "attn_documents",
    "attn_document_positions", "value_embeds", "unet_skips", "backout", "smear_gate", "bigram_embed",
)  # fmt: skip
PLAIN = {"logit_softcap": (0.0,), "attn_sinks": (0,), "attn_prefix_lm": (False,), "attn_block": (0,)}
PLAIN |= {"attn_documents": (False,), "attn_document_positions": (False,)}
# the residual-stream switches no family computes (model.zero_init_proj is not one: it only starts the weights)
PLAIN |= {"value_embeds": (0,), "unet_skips": (False,), "backout": (False,)}
PLAIN |= {"smear_gate": (False,), "bigram_embed": (0,)}  # no family reads the token before a token's embedding
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # config.json keys that name a token, when set
# Defined keys that change nothing a causal language model computes (transformers 5's modeling code read for
# each): what the file is and how it was written, what forward returns, the kernel that computes attention,
# the weights' dtype (ours keep the file's), initialisation, token ids (where generation starts and stops;
# pad_token_id only keeps one embedding row's gradient at zero), dropout (training only), GPT2DoubleHeadsModel's
# summary head, GPT-2's float32 upcast of scores (the same function), pretraining_tp (read by no code of
# transformers 5; 4.x split the matmuls into that many slices, the same sum)
DESCRIBING = {
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype", "torch_dtype",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "num_labels", "name_or_path",
    "output_attentions", "attn_implementation", "experts_implementation", "initializer_range", "use_cache",
    *TOKEN_KEYS, "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
    "classifier_dropout", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "summary_last_dropout", "reorder_and_upcast_attn", "pretraining_tp",
}  # fmt: skip

# The keys a family's transformers config class defines (transformers 5.24; tests/test_families.py checks
# them against the installed transformers): its dataclass fields, its attribute_map's aliases, the keys
# PreTrainedConfig.__post_init__ consumes, RoPE's keys it folds into rope_parameters, and the names the
# family's modeling code reads that no field holds (Qwen2's and StableLM's head_dim). Transformers sets any
# other key of config.json on the config object as a plain attribute that no model code reads: it cannot
# change what the model computes, and is ignored (ignored_keys), as transformers ignores it.
_EVERY_CLASS = (
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
    # consumed by PreTrainedConfig.__post_init__
    "torch_dtype", "name_or_path", "num_labels", "output_attentions", "attn_implementation",
    "experts_implementation", "per_layer_config",
)  # fmt: skip
ROPE_KEYS = (
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings",
)  # fmt: skip
_LLAMA_CLASS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "attention_dropout",
)  # fmt: skip
_WINDOW_CLASS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")  # Qwen2's and Qwen3's


def _defined(*keys: str, rope: bool = True) -> frozenset[str]:
    """The keys a config class defines: every class's, RoPE's (a class with rope_parameters) and its own."""
    return frozenset(_EVERY_CLASS + (ROPE_KEYS if rope else ()) + keys)


def _gpt2_weights() -> tuple[Weight, ...]:
    block = "transformer.h.{i}."
    weights = [Weight("transformer.wte.weight", ("transformer.wte.weight",))]
    weights.append(Weight("transformer.wpe.weight", ("transformer.wpe.weight",)))
    for name in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
        convert = "same" if name.startswith("ln") else "conv1d"
        weights.append(Weight(block + name + ".weight", (block + name + ".weight",), convert))
        weights.append(Weight(block + name + ".bias", (block + name + ".bias",), when="bias", zero_when_off=True))
    weights.append(Weight("transformer.ln_f.weight", ("transformer.ln_f.weight",)))
    weights.append(Weight("transformer.ln_f.bias", ("transformer.ln_f.bias",), when="bias", zero_when_off=True))
    return tuple(weights)


def _llama_weights(
    norm_bias: bool = False,
    linear_bias: bool = False,
    mlp_bias: bool = False,
    qkv_bias: bool = False,
    qk_norm: tuple[str, str] | None = None,
) -> tuple[Weight, ...]:
    """The tensors of the Llama layout. norm_bias: LayerNorms that always have a bias (StableLM);
    linear_bias, mlp_bias: the attention's and the MLP's biases follow our bias; qkv_bias: the queries',
    keys' and values' biases alone follow our qkv_bias (Qwen2, StableLM); qk_norm: the names of the query
    and key norms ({h}: a norm per head)."""
    layer, attn, mlp = "model.layers.{i}.", "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    ours = "transformer.h.{i}."
    qkv = tuple(attn + f"{x}_proj" for x in "qkv")

    def norm(our: str, their: str) -> list[Weight]:
        weights = [Weight(our + ".weight", (their + ".weight",))]
        if norm_bias:
            weights.append(Weight(our + ".bias", (their + ".bias",), when="bias", zero_when_off=True))
        return weights

    weights = [
        Weight("transformer.wte.weight", ("model.embed_tokens.weight",)),
        *norm(ours + "ln_1", layer + "input_layernorm"),
    ]
    weights.append(Weight(ours + "attn.c_attn.weight", tuple(p + ".weight" for p in qkv), "fused_qkv"))
    weights.append(Weight(ours + "attn.c_proj.weight", (attn + "o_proj.weight",)))
    if linear_bias or qkv_bias:
        when = "bias" if linear_bias else "qkv_bias"
        weights.append(Weight(ours + "attn.c_attn.bias", tuple(p + ".bias" for p in qkv), "fused_qkv", when=when))
    if linear_bias:
        weights.append(Weight(ours + "attn.c_proj.bias", (attn + "o_proj.bias",), when="bias"))
    if qk_norm:
        for our, their, heads in (("q_norm", qk_norm[0], "n_head"), ("k_norm", qk_norm[1], "kv_heads")):
            convert = "per_head" if "{h}" in their else "same"
            weights.append(Weight(ours + f"attn.{our}.weight", (attn + their,), convert, when="qk_norm", heads=heads))
    weights += norm(ours + "ln_2", layer + "post_attention_layernorm")
    weights.append(
        Weight(ours + "mlp.c_fc.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "fused_gate_up")
    )
    weights.append(Weight(ours + "mlp.c_proj.weight", (mlp + "down_proj.weight",)))
    if mlp_bias:
        gate_up = (mlp + "gate_proj.bias", mlp + "up_proj.bias")
        weights.append(Weight(ours + "mlp.c_fc.bias", gate_up, "fused_gate_up", when="bias"))
        weights.append(Weight(ours + "mlp.c_proj.bias", (mlp + "down_proj.bias",), when="bias"))
    weights += norm("transformer.ln_f", "model.norm")
    weights.append(Weight("lm_head.weight", ("lm_head.weight",), when="untied"))
    return tuple(weights)


# the switches every Llama-shaped family computes the same way (RoPE's stretched tables too: transformers'
# rotary embedding of each reads rope_parameters' rope_type)
_ROPE_SWIGLU = {"pos_emb": ("rope",), "rope_scaling": ANY, "mlp": ("swiglu",), "grouped_query": ANY,
                "tie_embeddings": ANY}  # fmt: skip
_LLAMA_KEYS = {
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "kv_heads": "num_key_value_heads",
    "head_size": "head_dim",
    "n_embd": "hidden_size", "block_size": "max_position_embeddings", "vocab_size": "vocab_size",
    "mlp_hidden": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
}  # fmt: skip
# their classes' defaults (None: num_key_value_heads is num_attention_heads, head_dim hidden_size / heads)
_LLAMA_DEFAULTS = {"tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-6, "head_dim": None}
# keys every class holds that change the model: a per-layer override of any key, an encoder-decoder
_EVERY_FIXED = {"is_encoder_decoder": False, "per_layer_config": None}
_LLAMA_FIXED = {**_EVERY_FIXED, "hidden_act": "silu"}

FAMILIES = (
    Family(
        model_type="gpt2",
        architecture="GPT2LMHeadModel",
        computes={"pos_emb": ("learned",), "rope_scaling": ("none",), "norm": ("layernorm",), "qk_norm": (False,),
                  "mlp": ("gelu",), "grouped_query": (False,), "head_dim": (0,), "tie_embeddings": (True,),
                  "bias": ANY, "qkv_bias": (False,), "attn_window": (0,), **PLAIN},
        keys={"n_layer": "n_layer", "n_head": "n_head", "n_embd": "n_embd", "block_size": "n_positions",
              "vocab_size": "vocab_size", "mlp_hidden": "n_inner", "norm_eps": "layer_norm_epsilon"},
        # GPT-2 124M's sizes where config.json leaves one out, as transformers' GPT2Config
        defaults={"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257,
                  "n_inner": None, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
                  "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
                  "tie_word_embeddings": True},
        defined=_defined(
            "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
            "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range", "summary_type",
            "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
            "scale_attn_weights", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id",
            "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention", "tie_word_embeddings",
            # GPT2Config.attribute_map's aliases, and the other heads' dropouts its modeling code reads
            "hidden_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
            "summary_last_dropout", "classifier_dropout", "hidden_dropout",
            rope=False,
        ),
        fixed={**_EVERY_FIXED, "activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": True,
               "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False, "tie_word_embeddings": True},
        weights=_gpt2_weights(),
        skipped=("transformer.h.{i}.attn.bias", "transformer.h.{i}.attn.masked_bias"),
        optional_prefix="transformer.",
        aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
                 "num_hidden_layers": "n_layer"},
        gguf=Gguf("gpt2", rope_scalings=("none",)),
    ),
    Family(
        model_type="llama",
        architecture="LlamaForCausalLM",
        computes={**_ROPE_SWIGLU, "norm": ("rmsnorm",), "qk_norm": (False,), "head_dim": ANY, "bias": ANY,
                  "qkv_bias": (False,), "attn_window": (0,), **PLAIN},
        keys={**_LLAMA_KEYS, "norm_eps": "rms_norm_eps", "bias": ("attention_bias", "mlp_bias")},
        defaults={**_LLAMA_DEFAULTS, "num_key_value_heads": None, "intermediate_size": 11008, "attention_bias": False,
                  "mlp_bias": False},
        defined=_defined(*_LLAMA_CLASS, "pretraining_tp", "attention_bias", "mlp_bias"),
        fixed=_LLAMA_FIXED,
        weights=_llama_weights(linear_bias=True, mlp_bias=True),
        gguf=Gguf("llama", adjacent_rope=True, rope_scalings=("none", "llama3", "yarn")),
    ),
    Family(
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        # q_proj, k_proj and v_proj always have biases, o_proj and the MLP never (no config.json key says so)
        computes={**_ROPE_SWIGLU, "norm": ("rmsnorm",), "qk_norm": (False,), "head_dim": ANY, "bias": (False,),
                  "qkv_bias": (True,), "attn_window": (0,), **PLAIN},
        keys={**_LLAMA_KEYS, "norm_eps": "rms_norm_eps"},
        defaults={**_LLAMA_DEFAULTS, "num_key_value_heads": 32, "intermediate_size": 22016,
                  "use_sliding_window": False},
        defined=_defined(*_LLAMA_CLASS, *_WINDOW_CLASS),  # head_dim: no field, but its attention reads it
        fixed={**_LLAMA_FIXED, "use_sliding_window": False},
        weights=_llama_weights(qkv_bias=True),
        ignored=("sliding_window", "max_window_layers"),
        gguf=Gguf("qwen2"),
    ),
    Family(
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        computes={**_ROPE_SWIGLU, "norm": ("rmsnorm",), "qk_norm": (True,), "head_dim": ANY, "bias": (False,),
                  "qkv_bias": (False,), "attn_window": (0,), **PLAIN},
        keys={**_LLAMA_KEYS, "norm_eps": "rms_norm_eps"},
        defaults={**_LLAMA_DEFAULTS, "num_key_value_heads": 32, "head_dim": 128, "intermediate_size": 22016,
                  "attention_bias": False, "use_sliding_window": False},
        defined=_defined(*_LLAMA_CLASS, *_WINDOW_CLASS, "attention_bias"),
        fixed={**_LLAMA_FIXED, "attention_bias": False, "use_sliding_window": False},
        weights=_llama_weights(qk_norm=("q_norm.weight", "k_norm.weight")),
        ignored=("sliding_window", "max_window_layers"),
        gguf=Gguf("qwen3"),
    ),
    Family(
        model_type="stablelm",
        architecture="StableLmForCausalLM",
        # StableLM's config.json has no head_dim: its heads are hidden_size / num_attention_heads wide
        computes={**_ROPE_SWIGLU, "norm": ("layernorm",), "qk_norm": ANY, "head_dim": (0,), "bias": (False,),
                  "qkv_bias": ANY, "attn_window": (0,), **PLAIN},
        keys={**{k: v for k, v in _LLAMA_KEYS.items() if k != "head_size"}, "norm_eps": "layer_norm_eps",
              "qkv_bias": "use_qkv_bias", "qk_norm": "qk_layernorm"},
        defaults={"tie_word_embeddings": False, "hidden_act": "silu", "num_key_value_heads": 32,
                  "intermediate_size": 6912, "layer_norm_eps": 1e-5, "use_qkv_bias": False, "qk_layernorm": False,
                  "use_parallel_residual": False, "partial_rotary_factor": 0.25},
        defined=_defined(
            *(key for key in _LLAMA_CLASS if key != "rms_norm_eps"), "layer_norm_eps", "use_qkv_bias",
            "qk_layernorm", "use_parallel_residual", "hidden_dropout",
        ),  # head_dim: no field, but its rotary embedding reads it
        fixed={**_LLAMA_FIXED, "use_parallel_residual": False},
        weights=_llama_weights(
            norm_bias=True, qkv_bias=True, qk_norm=("q_layernorm.norms.{h}.weight", "k_layernorm.norms.{h}.weight")
        ),
        gguf=Gguf("stablelm", output_required=True),
    ),
    Family(
        model_type="mistral",
        architecture="MistralForCausalLM",
        computes={**_ROPE_SWIGLU, "norm": ("rmsnorm",), "qk_norm": (False,), "head_dim": ANY, "bias": (False,),
                  "qkv_bias": (False,), "attn_window": ANY, **PLAIN},
        keys={**_LLAMA_KEYS, "norm_eps": "rms_norm_eps", "attn_window": "sliding_window"},
        defaults={**_LLAMA_DEFAULTS, "num_key_value_heads": 8, "intermediate_size": 14336, "sliding_window": 4096},
        defined=_defined(*_LLAMA_CLASS, "sliding_window"),
        fixed=_LLAMA_FIXED,
        weights=_llama_weights(),
    ),
)  # fmt: skip
FAMILY_BY_TYPE = {family.model_type: family for family in FAMILIES}


def switches(config: GPTConfig) -> dict[str, object]:
    """The values of SWITCHES for a model: what decides which family computes it. head_dim is 0 for
    heads n_embd / n_head wide, however it is set: a family without a head_dim key computes those."""
    derived = ("grouped_query", "head_dim", "qkv_bias", "rope_scaling")
    values = {name: getattr(config, name) for name in SWITCHES if name not in derived}
    own_width = config.n_head * config.head_size != config.n_embd
    return values | {
        "grouped_query": config.kv_heads < config.n_head,
        "head_dim": config.head_size if own_width else 0,
        "qkv_bias": config.qkv_bias and not config.bias,  # with bias, the queries' biases are bias's
        "rope_scaling": config.rope_scaling if config.pos_emb == "rope" else "none",
    }


def resolved(config: GPTConfig) -> dict[str, object]:
    """The values of SETTINGS for a model, with defaults resolved (n_kv_head 0 is n_head, ...)."""
    return {name: getattr(config, name) for name in SETTINGS}


def _accepts(family: Family, switch: str, value: object) -> bool:
    accepted = family.computes.get(switch)
    if switch == "attn_window" and accepted is ANY:
        return value > 0  # a window family with no window is the plain family listed before it
    return accepted is ANY or value in accepted


def _setting(switch: str, value: object) -> str:
    """How a switch's value reads in a config: model.qk_norm=true."""
    if switch == "grouped_query":
        return "model.n_kv_head (fewer key/value heads than query heads)" if value else "model.n_kv_head=0"
    if switch == "head_dim" and not value:
        return "model.head_dim=0 (heads n_embd / n_head wide)"
    shown = str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else value
    return f"model.{switch}={shown}"


def family_for(
    config: GPTConfig, families: tuple[Family, ...] = FAMILIES, reader: str = "Hugging Face family"
) -> Family:
    """The first of families that computes every switch of config. None computes it: a ValueError
    naming the switch (one no family computes, or the nearest family's first difference) and what
    would export; `reader` says what a family stands for in the message."""
    values = switches(config)
    for family in families:
        if all(_accepts(family, switch, value) for switch, value in values.items()):
            return family
    names = ", ".join(family.model_type for family in families)
    for switch, value in values.items():
        if not any(_accepts(family, switch, value) for family in families):
            accepted = sorted({str(v) for f in families for v in (f.computes[switch] or ())})
            return_to = (
                f"model.{switch}={accepted[0].lower()}" if len(accepted) == 1 else f"one of {', '.join(accepted)}"
            )
            raise ValueError(
                f"{_setting(switch, value)} is computed by no {reader} ({names}): only a model with {return_to} exports"
            )
    misses = {f.model_type: [s for s, v in values.items() if not _accepts(f, s, v)] for f in families}
    nearest = min(families, key=lambda f: len(misses[f.model_type]))
    switch = misses[nearest.model_type][0]
    accepted = nearest.computes[switch]
    need = _setting(switch, accepted[0]) if accepted else f"model.{switch} > 0"
    raise ValueError(
        f"{_setting(switch, values[switch])} with this model's other switches is computed by no {reader}: "
        f"the nearest, {nearest.model_type}, needs {need}"
        + (f" and {len(misses[nearest.model_type]) - 1} more change(s)" if len(misses[nearest.model_type]) > 1 else "")
    )


GGUF_FAMILIES = tuple(family for family in FAMILIES if family.gguf is not None)


def gguf_family_for(config: GPTConfig) -> Family:
    """The first family llama.cpp runs that computes every switch of config, or family_for's ValueError
    naming the switch; a stretched RoPE its architecture does not compute is a ValueError naming it."""
    family = family_for(config, GGUF_FAMILIES, reader="llama.cpp architecture")
    scaling = switches(config)["rope_scaling"]
    if scaling not in family.gguf.rope_scalings:
        runs = ", ".join(f.gguf.arch for f in GGUF_FAMILIES if scaling in f.gguf.rope_scalings)
        raise ValueError(
            f"model.rope_scaling={scaling!r} is computed by llama.cpp's {runs} but not by its {family.gguf.arch}, "
            f"the architecture of this model's other switches"
        )
    if scaling == "yarn":  # llama.cpp's YaRN reads no betas and always rounds the ramp's ends (ggml's corr dims)
        for name, value, runs in (
            ("rope_beta_fast", 32.0, 32),
            ("rope_beta_slow", 1.0, 1),
            ("rope_truncate", True, "true"),
        ):
            if getattr(config, name) != value:
                raise ValueError(
                    f"model.{name}={_shown(getattr(config, name))} is computed by no llama.cpp architecture: its YaRN "
                    f"reads only {name.removeprefix('rope_')} = {runs}"
                )
    return family


def hf_config(config: GPTConfig, family: Family, bos_token_id: int | None, eos_token_id: int | None) -> dict:
    """config.json for the family's transformers class, computing what config computes, naming its
    tokenizer's bos and eos by id."""
    hf: dict[str, object] = {"model_type": family.model_type, "architectures": [family.architecture]}
    values = resolved(config)
    for setting, keys in family.keys.items():
        for key in keys if isinstance(keys, tuple) else (keys,):
            hf[key] = values[setting] if setting != "attn_window" else values[setting] or None
    for key, value in family.fixed.items():
        value = value[0] if isinstance(value, tuple) else value
        if value is not None:
            hf[key] = value
    if config.pos_emb == "rope":
        hf["rope_parameters"] = rope_parameters(config, family)
        hf["rope_theta"] = config.rope_base  # where readers older than transformers 5 look
    # written even when None (null: a character vocabulary has no end-of-text token), since a config.json
    # without them reads as its class's defaults (GPT-2's 50256, Llama's 1 and 2), which transformers'
    # save_pretrained then writes down: ids beyond a small vocabulary, or characters taken for text's end
    hf["bos_token_id"], hf["eos_token_id"] = bos_token_id, eos_token_id
    return hf


def rope_parameters(config: GPTConfig, family: Family) -> dict:
    """transformers 5's rope_parameters for config's rotation: its type, base and the numbers of its
    stretch (docs/models.md); partial_rotary_factor where the family's default is not 1 (StableLM's 0.25)."""
    rope: dict[str, object] = {"rope_type": "default" if config.rope_scaling == "none" else config.rope_scaling}
    rope["rope_theta"] = config.rope_base
    if family.defaults.get("partial_rotary_factor", 1.0) != 1.0:
        rope["partial_rotary_factor"] = 1.0
    if config.rope_scaling != "none":
        rope |= {"factor": config.rope_factor, "original_max_position_embeddings": config.rope_original_context}
    if config.rope_scaling == "llama3":
        rope |= {"low_freq_factor": config.rope_low_freq_factor, "high_freq_factor": config.rope_high_freq_factor}
    if config.rope_scaling == "yarn":
        rope |= {"beta_fast": config.rope_beta_fast, "beta_slow": config.rope_beta_slow}
        rope |= {"truncate": config.rope_truncate} if not config.rope_truncate else {}
        rope |= {"attention_factor": config.rope_attention_factor} if config.rope_attention_factor else {}
    return rope


_SIZES = ("n_layer", "n_head", "kv_heads", "n_embd", "head_size", "block_size", "vocab_size", "mlp_hidden")
# the keys of rope_parameters each rope_type reads (transformers' rope functions); "type": older files' rope_type
ROPE_TYPES = {
    "default": ("rope_type", "type", "rope_theta", "partial_rotary_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim",
             "beta_fast", "beta_slow", "truncate"),
}  # fmt: skip


def _family(hf: dict, source: str) -> Family:
    model_type = hf.get("model_type")
    family = FAMILY_BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(
            f"{source} has model_type={model_type!r}, a family this model cannot compute "
            f"(it reads {', '.join(FAMILY_BY_TYPE)})"
        )
    return family


def _rope_section(hf: dict) -> tuple[str, dict]:
    """The name and contents of the RoPE settings transformers reads: a truthy rope_scaling (an older
    file's) replaces rope_parameters whole, as transformers' convert_rope_params_to_dict does."""
    if hf.get("rope_scaling"):
        return "rope_scaling", hf["rope_scaling"]
    return "rope_parameters", hf.get("rope_parameters") or {}


def ignored_keys(hf: dict, source: str = "config.json") -> list[str]:
    """The keys of a config.json that its family's transformers class does not define (Family.defined),
    which no model code reads, and the keys of its RoPE section that its rope type does not read: what
    transformers loads the file without; in the file's order. A family this model cannot compute is a
    ValueError."""
    family = _family(hf, source)
    ignored = [key for key in hf if key != "model_type" and key not in family.defined]
    if "rope_parameters" not in family.defined:
        return ignored
    name, section = _rope_section(hf)
    if name == "rope_scaling" and "rope_parameters" in hf:
        ignored.append("rope_parameters")
    if isinstance(section, dict):
        kind = section.get("rope_type", section.get("type", "default"))
        reads = ROPE_TYPES["default"] + ROPE_TYPES.get(kind, tuple(section))
        unread = [key for key in section if key not in reads or (key == "type" and "rope_type" in section)]
        ignored += [f"{name}.{key}" for key in unread]
    return ignored


def ignored_note(hf: dict, source: str) -> str | None:
    """The one line a load prints about the keys of source (a config.json) it ignored (ignored_keys),
    or None when there are none."""
    ignored = ignored_keys(hf, source)
    if not ignored:
        return None
    family = _family(hf, source)
    return (
        f"note: {source}: ignored {', '.join(ignored)}: keys transformers' {family.model_type} config does not "
        f"define, which no model code reads"
    )


def config_from_hf(hf: dict, source: str) -> tuple[Family, GPTConfig]:
    """The family and our config of a config.json (dropout 0: the caller sets its own), read as
    transformers reads it: a key the family's class does not define is read by no model code and
    ignored (ignored_keys); a defined key the family computes differently from us is a ValueError
    naming it, never dropped."""
    family = _family(hf, source)
    skipped = set(ignored_keys(hf, source)) | set(ROPE_KEYS) | {"model_type"}
    flat = {key: (key, value) for key, value in hf.items() if key not in skipped and key not in family.aliases}
    # an alias sets the key it stands for, over the key itself (transformers sets the aliases after the fields)
    flat |= {family.aliases[key]: (key, value) for key, value in hf.items() if key in family.aliases}
    for key, required in family.fixed.items():
        name, value = flat.get(key, (key, family.defaults.get(key, required)))
        allowed = required if isinstance(required, tuple) else (required,)
        if value not in allowed:
            wanted = " or ".join(repr(v) for v in allowed)
            said = f"sets {name}={value!r}" if key in flat else f"leaves {key} out, which means {value!r}"
            raise ValueError(f"{source} {said}; this model computes only {wanted}")
    mapped = {key for keys in family.keys.values() for key in (keys if isinstance(keys, tuple) else (keys,))}
    for key, (name, value) in flat.items():
        checked = key in mapped or key in family.fixed or key == "layer_types"
        if not (checked or key in DESCRIBING or key in family.ignored):
            raise ValueError(
                f"{source} sets {name}={value!r}, a key transformers' {family.model_type} model reads and this "
                f"model does not compute: a model that needs it cannot be imported"
            )
    values = _settings(family, flat, source)
    _check_token_ids(flat, values["vocab_size"], source)
    layer_types = flat.get("layer_types", ("layer_types", None))[1]
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise ValueError(
            f"{source} sets layer_types with {sorted(set(layer_types))}; this model computes only full_attention"
        )
    computed = {s: family.computes[s][0] for s in ("pos_emb", "norm", "mlp") if family.computes[s] is not ANY}
    qk_norm = values.get("qk_norm", family.computes["qk_norm"] and family.computes["qk_norm"][0])
    qkv_bias = values.get("qkv_bias", family.computes["qkv_bias"] == (True,))
    head_size = values.get("head_size")  # None: the family's heads are n_embd / n_head wide
    rope = _rope_settings(hf, family, values["block_size"], source) if computed["pos_emb"] == "rope" else {}
    config = GPTConfig(
        n_layer=values["n_layer"],
        n_head=values["n_head"],
        n_embd=values["n_embd"],
        block_size=values["block_size"],
        vocab_size=values["vocab_size"],
        dropout=0.0,
        bias=values.get("bias", True if family.computes["bias"] is ANY else family.computes["bias"][0]),
        qkv_bias=bool(qkv_bias),
        **computed,
        **rope,
        norm_eps=float(values["norm_eps"]),
        qk_norm=bool(qk_norm),
        n_kv_head=0 if values["kv_heads"] == values["n_head"] else values["kv_heads"],
        head_dim=0 if head_size is None or head_size * values["n_head"] == values["n_embd"] else head_size,
        tie_embeddings=values.get("tie_embeddings", True),
        attn_window=values.get("attn_window") or 0,
    )
    if values["mlp_hidden"] != config.mlp_hidden:
        config.mlp_width = values["mlp_hidden"]
    return family, config


def _rope_settings(hf: dict, family: Family, max_positions: int, source: str) -> dict[str, object]:
    """Our RoPE settings (rope_base, rope_scaling and its numbers) from a config.json's RoPE section, with
    transformers' precedence: the section's rope_theta and partial_rotary_factor over the top-level keys,
    a top-level original_max_position_embeddings over the section's, max_position_embeddings where neither
    has one. A rope type other than default, llama3 and yarn, or a partial rotation, is a ValueError."""
    name, section = _rope_section(hf)
    if not isinstance(section, dict):
        raise ValueError(f"{source} sets {name}={section!r}, which is not an object of RoPE settings")

    def get(key: str, default: object = None, top: bool = True) -> tuple[str, object]:
        """A key of the section (quoted as name.key), else of the file's top level, else default."""
        if key in section:
            return f"{name}.{key}", section[key]
        if top and key in hf:
            return key, hf[key]
        return key, default

    kind_key = "rope_type" if "rope_type" in section or "type" not in section else "type"
    kind_name, kind = get(kind_key, "default", top=False)
    if kind not in ROPE_TYPES:
        wanted = " or ".join(repr(k) for k in ROPE_TYPES)
        raise ValueError(f"{source} sets {kind_name}={kind!r}; this model computes only {wanted}")
    theta = get("rope_theta", family.defaults.get("rope_theta", 10000.0))
    _check_type("rope_base", *theta, source)
    partial_name, partial = get("partial_rotary_factor", family.defaults.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        written = partial_name != "partial_rotary_factor" or partial_name in hf
        said = f"sets {partial_name}={partial!r}" if written else f"leaves {partial_name} out, which means {partial!r}"
        raise ValueError(f"{source} {said}; this model computes only 1.0 (it turns every feature of a head)")
    settings: dict[str, object] = {"rope_base": float(theta[1])}
    if kind == "default":
        return settings
    if "original_max_position_embeddings" in hf:  # a top-level one is read first (Phi-3's place for it)
        original = ("original_max_position_embeddings", hf["original_max_position_embeddings"])
    else:
        original = get("original_max_position_embeddings", max_positions, top=False)
    _check_type("rope_original_context", *original, source)
    factor = get("factor", top=False)
    if factor[1] is None and kind == "yarn":  # as transformers: the stretch from the original context to the file's
        factor = (factor[0], max_positions / original[1])
    numbers = {"rope_factor": factor}
    if kind == "llama3":
        numbers |= {"rope_low_freq_factor": get("low_freq_factor", top=False)}
        numbers |= {"rope_high_freq_factor": get("high_freq_factor", top=False)}
    else:
        numbers |= {"rope_beta_fast": get("beta_fast", top=False), "rope_beta_slow": get("beta_slow", top=False)}
        numbers["rope_attention_factor"] = _attention_factor(section, factor[1], name, source)
    for setting, (key, value) in numbers.items():
        if value is None and setting in ("rope_beta_fast", "rope_beta_slow", "rope_attention_factor"):
            continue  # yarn's defaults: 32 and 1, 0.1 ln(factor) + 1
        if value is None:
            raise ValueError(f"{source} lacks {name}.{key.split('.')[-1]}, which a {kind} RoPE needs")
        _check_type(setting, key, value, source)
        settings[setting] = float(value)
    truncate = get("truncate", True, top=False)
    if kind == "yarn" and not isinstance(truncate[1], bool):
        raise ValueError(f"{source} sets {truncate[0]}={truncate[1]!r}, which is not true or false")
    return (
        settings
        | {"rope_scaling": kind, "rope_original_context": original[1]}
        | ({"rope_truncate": truncate[1]} if kind == "yarn" else {})
    )


def _attention_factor(section: dict, factor: object, name: str, source: str) -> tuple[str, object]:
    """YaRN's attention factor as transformers takes it: attention_factor, else DeepSeek's ratio of two
    mscale terms where mscale and mscale_all_dim are both set, else (None) 0.1 ln(factor) + 1."""
    if section.get("attention_factor") is not None:
        return f"{name}.attention_factor", section["attention_factor"]
    mscale, mscale_all_dim = section.get("mscale"), section.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        return f"{name}.attention_factor", None
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        _check_type("rope_attention_factor", f"{name}.{key}", value, source)
    _check_type("rope_factor", f"{name}.factor", factor, source)

    def term(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return f"{name}.mscale", float(term(mscale) / term(mscale_all_dim))


def _check_token_ids(flat: dict[str, tuple[str, object]], vocab_size: int, source: str) -> None:
    """The keys that name a token, when set, name tokens of the vocabulary: one id, or a list of them
    (newer configs end text at any of several)."""
    for key in TOKEN_KEYS:
        name, value = flat.get(key, (key, None))
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids
        ):
            raise ValueError(
                f"{source} sets {name}={value!r}, which is not a token id below its vocab_size={vocab_size}"
            )


def _settings(family: Family, flat: dict[str, tuple[str, object]], source: str) -> dict[str, object]:
    """Our settings from their keys (or their class's defaults), checked for type; sizes that are left
    out and follow from others (key/value heads, head width, MLP width) are derived."""
    values = {}
    for setting, keys in family.keys.items():
        found = []
        for key in keys if isinstance(keys, tuple) else (keys,):
            if key in flat:
                found.append(flat[key])
            elif key in family.defaults:
                found.append((key, family.defaults[key]))
            else:
                raise ValueError(f"{source} lacks {key}: it is not a complete {family.model_type} config.json")
        if any(value != found[0][1] for _, value in found[1:]):
            shown = " and ".join(f"{name}={value!r}" for name, value in found)
            raise ValueError(f"{source} sets {shown}; this model has biases everywhere or nowhere (set them equal)")
        values[setting] = found[0][1]
        _check_type(setting, *found[0], source)
    values["kv_heads"] = values.get("kv_heads") or values["n_head"]
    if values.get("head_size") is None and "head_size" in family.keys:
        values["head_size"] = values["n_embd"] // values["n_head"]  # as transformers' config classes take it
    elif values.get("head_size") is None and values["n_embd"] % values["n_head"]:
        width, heads = family.keys["n_embd"], family.keys["n_head"]
        raise ValueError(
            f"{source} sets {width}={values['n_embd']} and {heads}={values['n_head']}, which does not divide it: "
            f"a {family.model_type} model's heads are {width} / {heads} wide"
        )
    if values.get("mlp_hidden") is None:
        values["mlp_hidden"] = 4 * values["n_embd"]  # GPT-2's n_inner: null
    return values


_INTEGERS = (*_SIZES, "attn_window", "rope_original_context")
_BOOLEANS = ("tie_embeddings", "bias", "qkv_bias", "qk_norm")


def _check_type(setting: str, key: str, value: object, source: str) -> None:
    if value is None and setting in ("kv_heads", "head_size", "mlp_hidden", "attn_window"):
        return
    if setting in _INTEGERS:
        ok, wanted = isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"
    elif setting in _BOOLEANS:
        ok, wanted = isinstance(value, bool), "true or false"
    else:  # norm_eps, rope_base and the RoPE stretch's numbers
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        wanted = "a positive number"
    if not ok:
        raise ValueError(f"{source} sets {key}={value!r}, which is not {wanted}")


def _present(weight: Weight, config: GPTConfig) -> bool:
    """Whether GPT(config) has this tensor."""
    when = {"": True, "bias": config.bias, "qkv_bias": config.bias or config.qkv_bias, "qk_norm": config.qk_norm}
    return (when | {"untied": not config.tie_embeddings})[weight.when]


def _expand(weight: Weight, config: GPTConfig) -> list[tuple[str, list[str], int]]:
    """Each block's (our name, their names, heads) of one table row."""
    layers = range(config.n_layer) if "{i}" in weight.ours else [0]
    heads = getattr(config, weight.heads) if weight.heads else 1
    rows = []
    for i in layers:
        theirs = [name.format(i=i, h=h) for name in weight.theirs for h in (range(heads) if "{h}" in name else [0])]
        rows.append((weight.ours.format(i=i), theirs, heads))
    return rows


def tensors_to_hf(state: dict[str, torch.Tensor], config: GPTConfig, family: Family) -> dict[str, torch.Tensor]:
    """The family's tensors for our state dict, by the table; a bias the family always has and we
    lack is written as zeros (which computes what no bias computes)."""
    tensors = {}
    shapes = _shapes(config, bias=True)
    for weight, present, ours, theirs, heads in _rows(family, config):
        if present:
            parts = CONVERSIONS[weight.convert].to_theirs(state[ours], config, heads)
        else:
            parts = [torch.zeros(shapes[ours], dtype=state["transformer.wte.weight"].dtype)]
        tensors |= {name: part.contiguous() for name, part in zip(theirs, parts, strict=True)}
    return tensors


def _rows(family: Family, config: GPTConfig):
    """(table row, whether our model has the tensor, our name, their names, heads) for every tensor
    of the family's folder for config: ours, and the zero biases it always has."""
    for weight in family.weights:
        present = _present(weight, config)
        if present or weight.zero_when_off:
            for ours, theirs, heads in _expand(weight, config):
                yield weight, present, ours, theirs, heads


def state_dict_from_hf(
    hf_tensors: dict[str, torch.Tensor], config: GPTConfig, family: Family, source: str
) -> dict[str, torch.Tensor]:
    """Our state dict from the family's tensors, checking each is there with its shape and finite (an
    error names the file's tensor, before any are joined); a tensor the table does not name is an
    error, never dropped."""
    tensors = normalise_names(hf_tensors, family)
    _check_embedding(tensors, config, family, source)
    shapes = _shapes(config, bias=True)
    state = {}
    for weight, present, ours, theirs, heads in _rows(family, config):
        parts = {}
        for name in theirs:
            if name not in tensors:
                raise ValueError(
                    f"{source} lacks the tensor {name}: it is not a complete {family.model_type} checkpoint"
                )
            parts[name] = tensors.pop(name)
        conversion = CONVERSIONS[weight.convert]
        # each of their tensors against its own shape (ours split as export splits it, on the meta
        # device) before any are joined, so that a message names the one that differs
        expected = conversion.to_theirs(torch.empty(shapes[ours], device="meta"), config, heads)
        for (name, part), shape in zip(parts.items(), [tuple(t.shape) for t in expected], strict=True):
            _check_shape(name, part, shape, source)
        problem = non_finite(parts)
        if problem is not None:
            raise ValueError(
                f"{source}: {problem} (a damaged copy, or a model that diverged in training: fetch the model "
                f"again, or use one from before it diverged)"
            )
        try:
            tensor = conversion.to_ours(list(parts.values()), config)
        except ValueError as e:
            raise ValueError(f"{source}: {theirs[0]} cannot be read ({e})") from None
        if not present and tensor.count_nonzero():
            raise ValueError(f"{source}: {theirs[0]} is not zero, and this {family.model_type} model has no biases")
        if present:
            state[ours] = tensor.contiguous()
    _check_leftovers(tensors, state, config, family, source)
    if config.tie_embeddings:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def _check_leftovers(
    tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], config: GPTConfig, family: Family, source: str
) -> None:
    """Tensors the table does not read: GPT-2's stored mask and a copy of a tied head pass, the rest is refused."""
    skipped = {name.format(i=i) for name in family.skipped for i in range(config.n_layer)}
    for name in [name for name in tensors if name in skipped]:
        del tensors[name]
    head = tensors.pop("lm_head.weight", None)
    if head is not None and config.tie_embeddings and not torch.equal(head, state["transformer.wte.weight"]):
        raise ValueError(
            f"{source} has an output layer that differs from the token embedding, but config.json ties them"
        )
    if tensors:
        raise ValueError(f"{source} holds tensors {family.model_type} does not have: {', '.join(sorted(tensors)[:5])}")


def _check_embedding(tensors: dict[str, torch.Tensor], config: GPTConfig, family: Family, source: str) -> None:
    """The token embedding against config.json's sizes, before a model of those sizes is described:
    a config.json that lies about them is named here."""
    name = family.weights[0].theirs[0]
    if name not in tensors:
        raise ValueError(f"{source} lacks the tensor {name}: it is not a complete {family.model_type} checkpoint")
    _check_shape(name, tensors[name], (config.vocab_size, config.n_embd), source)


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], source: str) -> None:
    """One tensor of a folder, under its name there, against the shape config.json implies for it."""
    if tuple(tensor.shape) != shape:
        raise ValueError(
            f"{source}: {name} has shape {tuple(tensor.shape)} but config.json implies {shape} "
            f"(the weights do not belong to this config)"
        )


def _shapes(config: GPTConfig, bias: bool) -> dict[str, tuple[int, ...]]:
    """The name and shape of every weight of GPT(config) (with biases, if bias), without building it."""

    with torch.device("meta"):
        model = GPT(GPTConfig(**{**vars(config), "bias": bias or config.bias}))
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def infer_bias(hf_tensors: dict[str, torch.Tensor], config: GPTConfig, family: Family) -> bool:
    """For a family whose config.json does not say (GPT-2): biases that are all zero are no biases
    (a model exported without biases comes back without them)."""
    tensors = normalise_names(hf_tensors, family)
    names = [name for w in family.weights if w.when == "bias" for _, theirs, _ in _expand(w, config) for name in theirs]
    return any(name in tensors and bool(tensors[name].count_nonzero()) for name in names)


def normalise_names(tensors: dict[str, torch.Tensor], family: Family) -> dict[str, torch.Tensor]:
    """The tensors under the table's names: with the family's optional prefix where a file left it off."""
    prefix = family.optional_prefix
    if not prefix:
        return dict(tensors)
    return {
        name if name.startswith(prefix) or name == "lm_head.weight" else prefix + name: t for name, t in tensors.items()
    }


def _shown(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, tuple):
        return " or ".join(_shown(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _cell(switch: str, accepted: tuple | None) -> str:
    """What the family table says a family computes of a switch."""
    if accepted is ANY:
        return "> 0" if switch == "attn_window" else "any"
    if switch == "head_dim" and accepted == (0,):
        return "n_embd / n_head"
    return _shown(accepted)


def markdown_tables() -> str:
    """docs/models.md's tables, from FAMILIES: the switches each family computes; the config.json
    key each of our settings is written to and read from; the keys that must hold one value."""
    head = "| | " + " | ".join(f"{f.model_type} (`{f.architecture}`)" for f in FAMILIES) + " |"
    rule = "|---" * (len(FAMILIES) + 1) + "|"
    lines = ["Switches each family computes (export picks the first column that has every value):", "", head, rule]
    runners = [f"`{f.gguf.arch}`" if f.gguf else "-" for f in FAMILIES]
    lines.append("| llama.cpp architecture (`--export-gguf`) | " + " | ".join(runners) + " |")
    scalings = [_shown(f.gguf.rope_scalings) if f.gguf else "-" for f in FAMILIES]
    lines.append("| `model.rope_scaling` llama.cpp computes | " + " | ".join(scalings) + " |")
    for switch in SWITCHES:
        name = "n_kv_head < n_head" if switch == "grouped_query" else switch
        cells = [_cell(switch, f.computes[switch]) for f in FAMILIES]
        lines.append(f"| `model.{name}` | " + " | ".join(cells) + " |")
    resolved_keys = "kv_heads, head_size and mlp_hidden are `model.n_kv_head`, `model.head_dim` and `model.mlp_width`"
    lines += [
        "",
        f"Our settings and the config.json keys that carry them ({resolved_keys}, 0 resolved):",
        "",
        head,
        rule,
    ]
    for setting in SETTINGS:
        cells = [" = ".join(f"`{k}`" for k in ((keys,) if isinstance(keys, str) else keys or ())) or "-"
                 for keys in (f.keys.get(setting) for f in FAMILIES)]  # fmt: skip
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    rope = ["`rope_parameters`" if f.computes["pos_emb"] == ("rope",) else "-" for f in FAMILIES]
    lines.append("| rope_base, rope_scaling, rope_* | " + " | ".join(rope) + " |")
    lines += ["", "Keys that must hold one value (left out: the family's default must be it):", ""]
    for f in FAMILIES:
        lines.append(f"- {f.model_type}: " + ", ".join(f"`{key}` = {_shown(v)}" for key, v in f.fixed.items()))
    return "\n".join(lines) + "\n"
