"""--init-from MODEL.gguf (sample.py, eval.py) and train.init_from = "MODEL.gguf": a GGUF file of
llama.cpp, Ollama or LM Studio read as a model of this project, to sample from, evaluate and fine-tune.

The file is read with the `gguf` package, the reader of llama.cpp's own format: the architecture and
its settings become our config, the tokenizer and chat template a tokenizer.json
(data/gguf_tokenizer.py), and every tensor is dequantized (float16, bfloat16 and the quantized types
Q4_0 ... Q8_0, the k-quants and i-quants) to float32 and put back in the family's Hugging Face layout,
which families.state_dict_from_hf then reads and checks as it reads a folder's. What makes a GGUF file
differ from a folder is interop/gguf_tensors.py's, read backwards:

    names          gguf's TensorNameMap (blk.3.attn_q.weight is model.layers.3.self_attn.q_proj.weight)
    shapes         a GGUF shape lists the row length first: numpy's shape is its reverse
    llama's RoPE   each head's query and key rows in llama.cpp's adjacent order, put back (unpermute_rope)
    GPT-2          Conv1D's (in, out) layout, which GGUF stores as (out, in)
    StableLM       its per-head norms stacked into one (heads, head_dim) tensor
    tied head      no output.weight, or one equal to token_embd.weight
    Llama 3's RoPE rope_freqs.weight, the divisors of the plain frequencies; YaRN as rope.scaling.* settings

An architecture, a tokenizer, a quantization type or a setting this reader does not compute is refused
in one line naming it.
"""

from pathlib import Path

import gguf
import numpy as np
import torch

from data.gguf_tokenizer import field, gguf_tokenizer, open_gguf
from data.tokenizer import JsonTokenizer
from errors import UserError
from interop.families import ANY, GGUF_FAMILIES, Family, infer_bias, state_dict_from_hf
from interop.gguf_tensors import (
    LLAMA3_ROPE_KEY,
    ROPE_FREQS,
    gguf_layout,
    query_or_key_heads,
    rope_freqs,
    unpermute_rope,
)
from model import GPTConfig
from model.rope import yarn_attention_factor

# the settings of Llama 3.1 and 3.2's stretched RoPE, which rope_freqs.weight alone does not tell apart from
# others that give the same table: low_freq_factor, high_freq_factor, original_max_position_embeddings
LLAMA3_PUBLISHED = (1.0, 4.0, 8192)


def read_gguf(path: Path, key: str) -> tuple[Family, GPTConfig, dict[str, torch.Tensor], JsonTokenizer]:
    """The family, our config and state dict (float32) of the model in a GGUF file, and its tokenizer
    with its chat template; anything it cannot read is a UserError naming key and file."""
    reader = open_gguf(path, key)
    source = str(path)
    try:
        family = gguf_family(reader, source)
        tokenizer = gguf_tokenizer(reader, source)  # before the weights: a tokenizer it cannot rebuild is refused first
    except (ValueError, UserError) as e:
        raise UserError(f"{key}={str(path)!r} cannot be loaded: {e}") from None
    try:
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        config = gguf_config(reader, family, tensors, source)
        hf_tensors = hugging_face_tensors(tensors, config, family, source)
        if family.computes["bias"] is ANY and "bias" not in family.keys:  # GPT-2: zero biases are no biases
            config.bias = infer_bias(hf_tensors, config, family)
        state = state_dict_from_hf(hf_tensors, config, family, source)
    except ValueError as e:
        raise UserError(f"{key}={str(path)!r} cannot be loaded: {e}") from None
    return family, config, state, tokenizer


def gguf_family(reader: gguf.GGUFReader, source: str) -> Family:
    """The family whose llama.cpp architecture the file's general.architecture names."""
    arch = field(reader, "general.architecture")
    for family in GGUF_FAMILIES:
        if family.gguf.arch == arch:
            return family
    names = ", ".join(family.gguf.arch for family in GGUF_FAMILIES)
    raise ValueError(
        f"{source} holds general.architecture={arch!r}, which this model cannot compute (it reads {names})"
    )


def gguf_config(reader: gguf.GGUFReader, family: Family, tensors: dict, source: str) -> GPTConfig:
    """Our config of the architecture's settings; the switches a folder's config.json would state (biases,
    QK-norm, a tied head) are read from the tensors the file holds, as llama.cpp's loader reads them."""
    arch = family.gguf.arch

    def setting(name: str, default: object = None) -> object:
        value = field(reader, f"{arch}.{name}", default)
        if isinstance(value, list):  # per-layer values (llama.cpp allows them): this model has one for all
            if len(set(value)) != 1:
                raise ValueError(f"{source} sets {arch}.{name} per layer ({value[:4]}...): this model has one for all")
            value = value[0]
        if value is None:
            raise ValueError(f"{source} lacks {arch}.{name}: it is not a complete {arch} GGUF file")
        return value

    n_embd, n_head = setting("embedding_length"), setting("attention.head_count")
    head_size = setting("attention.key_length", n_embd // n_head)
    if setting("attention.value_length", head_size) != head_size:
        raise ValueError(f"{source} sets {arch}.attention.value_length otherwise than key_length: one width here")
    computed = {name: family.computes[name][0] for name in ("pos_emb", "norm", "mlp")}
    eps = "attention.layer_norm_rms_epsilon" if computed["norm"] == "rmsnorm" else "attention.layer_norm_epsilon"
    kv_heads = setting("attention.head_count_kv", n_head)
    bias = "blk.0.attn_output.bias" in tensors or arch == "gpt2"  # GPT-2's always are: zeros read as none
    config = GPTConfig(
        n_layer=setting("block_count"),
        n_head=n_head,
        n_embd=n_embd,
        head_dim=0 if head_size * n_head == n_embd else head_size,
        n_kv_head=0 if kv_heads == n_head else kv_heads,
        block_size=setting("context_length"),
        vocab_size=int(tensors["token_embd.weight"].shape[1]) if "token_embd.weight" in tensors else 0,
        mlp_width=setting("feed_forward_length"),  # 0 below where it is the default width
        norm_eps=setting(eps),
        dropout=0.0,
        bias=bias,
        qkv_bias="blk.0.attn_q.bias" in tensors and not bias,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_embeddings=_tied(tensors),
        **computed,
        **(_rope(reader, family, tensors, head_size, setting, source) if computed["pos_emb"] == "rope" else {}),
    )
    if config.vocab_size == 0:
        raise ValueError(f"{source} lacks the tensor token_embd.weight: it is not a complete {arch} GGUF file")
    if config.mlp_width == GPTConfig(**{**vars(config), "mlp_width": 0}).mlp_hidden:
        config.mlp_width = 0  # the default width, as a config.json's is read
    return config


def _tied(tensors: dict) -> bool:
    """Whether the output layer is the token embedding: no output.weight (llama.cpp then reads the
    embedding), or one stored as the same bytes (StableLM's llama.cpp reads no tied one, so it is written twice)."""
    output, embedding = tensors.get("output.weight"), tensors["token_embd.weight"]
    if output is None:
        return True
    return output.tensor_type == embedding.tensor_type and np.array_equal(output.data, embedding.data)


def _rope(reader: gguf.GGUFReader, family: Family, tensors: dict, head_size: int, setting, source: str) -> dict:
    """Our RoPE settings: the base, and a stretch as llama.cpp computes it: YaRN's settings, or Llama 3's
    rope_freqs.weight (which only its "llama" reads)."""
    arch = family.gguf.arch
    if setting("rope.dimension_count", head_size) != head_size:
        raise ValueError(
            f"{source} sets {arch}.rope.dimension_count={setting('rope.dimension_count')} for heads {head_size} "
            f"wide: it turns part of each head, where this model turns every feature"
        )
    rope = {"rope_base": float(setting("rope.freq_base", 10000.0))}
    scaling, factor = field(reader, f"{arch}.rope.scaling.type", "none"), field(reader, f"{arch}.rope.scaling.factor")
    if scaling == "yarn":
        factor = float(setting("rope.scaling.factor"))
        attention = field(reader, f"{arch}.rope.scaling.attn_factor", 1.0)  # llama.cpp multiplies its own by it
        rope |= {"rope_scaling": "yarn", "rope_factor": factor, "rope_attention_factor": 0.0}
        rope["rope_original_context"] = setting("rope.scaling.original_context_length", setting("context_length"))
        if attention != 1.0:
            rope["rope_attention_factor"] = attention * yarn_attention_factor(factor)
    elif scaling not in ("none", "linear") or (scaling == "linear" and factor not in (None, 0.0, 1.0)):
        raise ValueError(
            f"{source} sets {arch}.rope.scaling.type={scaling!r}, a stretched RoPE this model does not compute "
            f"(it computes yarn, and Llama 3's rope_freqs.weight)"
        )
    if ROPE_FREQS in tensors and "llama3" in family.gguf.rope_scalings:  # other architectures' loaders lack it
        divisors = _dequantized(tensors[ROPE_FREQS], source)
        rope |= llama3_settings(field(reader, LLAMA3_ROPE_KEY), rope["rope_base"], head_size, divisors, source)
    return rope


def llama3_settings(
    recorded: list[float] | None, base: float, head_size: int, divisors: torch.Tensor, source: str
) -> dict[str, object]:
    """Llama 3's settings whose rope_freqs divisors a file holds: those an export of this project records
    beside them (recorded: factor, low_freq_factor, high_freq_factor, original context), else Llama
    3.1/3.2's published ones with the largest divisor as the factor. The table alone does not fix them
    (settings that give the same table compute the same model): a table neither gives is refused."""
    candidates = [recorded] if recorded is not None else []
    candidates.append([float(divisors.max()), *LLAMA3_PUBLISHED])
    for factor, low, high, original in candidates:
        rope = {"rope_scaling": "llama3", "rope_factor": float(factor), "rope_low_freq_factor": float(low)}
        rope |= {"rope_high_freq_factor": float(high), "rope_original_context": int(original)}
        config = GPTConfig(n_layer=1, n_head=1, n_embd=head_size, pos_emb="rope", rope_base=base, **rope)
        if torch.allclose(rope_freqs(config), divisors, rtol=1e-5, atol=0):
            return rope
    raise ValueError(
        f"{source}: {ROPE_FREQS} is no Llama 3.1/3.2 stretch (low_freq_factor 1, high_freq_factor 4 over 8192 "
        f"positions) this reader recognises"
    )


def hugging_face_tensors(tensors: dict, config: GPTConfig, family: Family, source: str) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized to float32, under the family's Hugging Face names and in its
    layout (interop/gguf_tensors.py's, undone); a tensor the layout does not name is a ValueError."""
    parts_of = {}  # GGUF name -> (the table row, the Hugging Face names it holds)
    for weight, _, _, theirs, names, _ in gguf_layout(family, config):
        if weight.convert == "per_head":
            parts_of[names[0]] = (weight, theirs)
        else:
            parts_of |= {name: (weight, [their]) for name, their in zip(names, theirs, strict=True)}
    hf_tensors = {}
    for name, tensor in tensors.items():
        if name == ROPE_FREQS and config.rope_scaling == "llama3":
            continue  # read into the config
        if name == "output.weight" and config.tie_embeddings:
            hf_tensors["lm_head.weight"] = _dequantized(tensor, source)  # the embedding again: checked equal
            continue
        if name not in parts_of:
            arch = family.gguf.arch
            raise ValueError(f"{source} holds the tensor {name}, which a {arch} model of its settings lacks")
        weight, theirs = parts_of[name]
        values = _dequantized(tensor, source)
        heads = query_or_key_heads(name, config) if family.gguf.adjacent_rope else 0
        if heads:
            values = unpermute_rope(values, heads)
        if weight.convert == "conv1d":
            values = values.t()
        if weight.convert == "per_head":  # (heads, head_dim): a norm for each head
            hf_tensors |= {their: values[h] for h, their in enumerate(theirs)}
        else:
            hf_tensors[theirs[0]] = values.contiguous()
    return hf_tensors


def _dequantized(tensor, source: str) -> torch.Tensor:
    """A GGUF tensor as float32 in torch's axis order (its GGUF shape reversed)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{source}: {tensor.name} is of type {tensor.tensor_type.name}, which the gguf package cannot "
            f"dequantize (F32, F16, BF16, Q4_0 to Q8_0, the k- and i-quants are read)"
        ) from None
    shape = tuple(reversed([int(n) for n in tensor.shape]))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: the file is read-only
