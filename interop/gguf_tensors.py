"""A model as llama.cpp reads it: the GGUF architecture's settings and tensors, written with the
`gguf` package (imported by no other file of model/, which runs without it).

Which families llama.cpp runs, and how, is the `gguf` column of families.py's table. The tensors are
the family's Hugging Face tensors (families.tensors_to_hf's rows) under the names gguf's own
TensorNameMap gives them, with three differences from a Hugging Face folder:

    Linear layout: GGUF keeps every matrix as (out, in), ours; GPT-2's Conv1D transposition is undone
    per head:      StableLM's per-head norms are one (heads, head_dim) tensor, not one per head
    adjacent RoPE: llama.cpp's "llama" turns features 2i and 2i+1 together where transformers turns
                   i and i + D/2, so each head's query and key rows are interleaved (permute_rope)

and a stretched RoPE as llama.cpp's converter writes it: Llama 3's as the tensor rope_freqs.weight of
the divisors of the plain frequencies (rope_freqs), YaRN as settings (add_model).

Problems raise ValueError naming the switch or tensor.
"""

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from interop.families import CONVERSIONS, Family, _rows, _shapes
from model import GPTConfig
from model.rope import default_frequencies, rope_frequencies, yarn_attention_factor

# the types a file's matrices are written in (sample.py --gguf-type), each with the file type the file
# declares; norm weights and biases stay float32, as llama.cpp's own converter writes them (its kernels
# multiply by a norm's weight only in float32)
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
DTYPE_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # --dtype's names for the float types
# llama-quantize gives the output layer (or the token embedding it is tied to) Q6_K in a file of 4-bit
# matrices, the type that costs it least; gguf has no Q6_K quantizer, so Q8_0 it is
OUTPUT_TYPES = {"Q4_0": "Q8_0"}
ARCHITECTURES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
EXPORT_SOURCE_KEY = "export.source"  # the checkpoint or folder a file was written from: marks it as ours


def permute_rope(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows (or a bias) of heads query or key heads in transformers' RoPE order (feature i pairs
    with i + D/2) -> llama.cpp's adjacent order (feature 2i pairs with 2i + 1), within each head."""
    rows = tensor.shape[0]
    halves = tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:])  # (H, 2, D/2, ...)
    return halves.transpose(1, 2).reshape(tensor.shape)


def unpermute_rope(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of permute_rope."""
    rows = tensor.shape[0]
    pairs = tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])  # (H, D/2, 2, ...)
    return pairs.transpose(1, 2).reshape(tensor.shape)


def _stacked_name(template: str) -> str:
    """StableLM's per-head norms (q_layernorm.norms.{h}.weight) as one tensor under the container's
    name (q_layernorm.weight), as llama.cpp reads them."""
    return re.sub(r"\.\w+\.\{h\}", "", template)


def gguf_layout(family: Family, config: GPTConfig):
    """Each tensor the family's GGUF file holds for config, as (table row, whether our model has the
    tensor, our name, the family's Hugging Face names of its parts, their GGUF names, heads): a part each,
    or one stacked (heads, head_dim) tensor for StableLM's per-head norms. What export writes and
    import reads."""
    names = gguf.get_tensor_name_map(ARCHITECTURES[family.gguf.arch], config.n_layer)
    for weight, present, ours, theirs, heads in _rows(family, config):
        stacked = [_stacked_name(weight.theirs[0]).format(i=_block(ours))] if weight.convert == "per_head" else []
        found = []
        for their in stacked or theirs:
            name = names.get_name(their, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"gguf's tensor map has no name for {family.model_type}'s {their}")
            found.append(name)
        yield weight, present, ours, theirs, found, heads


def gguf_tensors(state: dict[str, torch.Tensor], config: GPTConfig, family: Family) -> dict[str, torch.Tensor]:
    """The GGUF tensors of the model (state's dtype), by name."""
    shapes = _shapes(config, bias=True)
    tensors = {}
    dtype = state["transformer.wte.weight"].dtype
    for weight, present, ours, _, names, heads in gguf_layout(family, config):
        tensor = state[ours] if present else torch.zeros(shapes[ours], dtype=dtype)
        if weight.convert == "per_head":
            parts = [tensor.expand(heads, -1)]
        elif weight.convert == "conv1d":
            parts = [tensor]
        else:
            parts = CONVERSIONS[weight.convert].to_theirs(tensor, config, heads)
        tensors |= dict(zip(names, parts, strict=True))
    if family.gguf.adjacent_rope:
        for name in list(tensors):
            heads = query_or_key_heads(name, config)
            if heads:
                tensors[name] = permute_rope(tensors[name], heads)
    if family.gguf.output_required and config.tie_embeddings:
        tensors["output.weight"] = tensors["token_embd.weight"]
    if config.pos_emb == "rope" and config.rope_scaling == "llama3":
        tensors[ROPE_FREQS] = rope_freqs(config)
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


def query_or_key_heads(name: str, config: GPTConfig) -> int:
    """The heads of a GGUF tensor of queries (n_head) or keys (kv_heads), whose rows llama.cpp's "llama"
    keeps in its adjacent RoPE order; 0 for any other tensor."""
    kind = re.search(r"\.attn_([qk])\.", name)
    return 0 if kind is None else config.n_head if kind.group(1) == "q" else config.kv_heads


ROPE_FREQS = "rope_freqs.weight"  # Llama 3's stretched RoPE, in a GGUF file
# its settings as this export records them beside the table, which alone does not fix them (interop/gguf_read.py):
# rope_factor, rope_low_freq_factor, rope_high_freq_factor, rope_original_context (llama.cpp reads the table only)
LLAMA3_ROPE_KEY = "export.llama3_rope"


def rope_freqs(config: GPTConfig) -> torch.Tensor:
    """(head_size / 2,) float32: what llama.cpp divides each plain frequency base^(-2i/D) by to turn a
    pair as config's stretched table does (1 where a frequency is kept, rope_factor where divided)."""
    return default_frequencies(config.rope_base, config.head_size) / rope_frequencies(config)[0]


def _block(name: str) -> int:
    """The block number in one of our tensor names (transformer.h.3.attn...)."""
    return int(name.split(".")[2])


def add_model(writer: "gguf.GGUFWriter", config: GPTConfig, family: Family, name: str, source: str) -> None:
    """The architecture's settings: sizes, RoPE, the norm's epsilon."""
    writer.add_name(name)
    writer.add_string(EXPORT_SOURCE_KEY, source)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.mlp_hidden)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.kv_heads)
    writer.add_key_length(config.head_size)
    writer.add_value_length(config.head_size)
    writer.add_vocab_size(config.vocab_size)
    if config.pos_emb == "rope":
        writer.add_rope_dimension_count(config.head_size)
        writer.add_rope_freq_base(config.rope_base)
    if config.pos_emb == "rope" and config.rope_scaling == "llama3":
        numbers = [config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor]
        numbers.append(float(config.rope_original_context))
        writer.add_key_value(LLAMA3_ROPE_KEY, numbers, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT64)
    if config.pos_emb == "rope" and config.rope_scaling == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(config.rope_factor)
        writer.add_rope_scaling_orig_ctx_len(config.rope_original_context)
        if config.rope_attention_factor:  # llama.cpp multiplies its own 0.1 ln(factor) + 1 by this
            writer.add_rope_scaling_attn_factors(
                config.rope_attention_factor / yarn_attention_factor(config.rope_factor)
            )
    if config.norm == "rmsnorm":
        writer.add_layer_norm_rms_eps(config.norm_eps)
    else:
        writer.add_layer_norm_eps(config.norm_eps)


def tensor_type(name: str, shape: tuple[int, ...], file_type: str, output: str) -> gguf.GGMLQuantizationType:
    """The GGML type of one tensor (shape: ours, (out, in)) in a file of `file_type` (FILE_TYPES),
    by llama-quantize's rules (its llama-quant.cpp): vectors and norm weights stay F32 (StableLM's
    per-head norms are 2-D), and so does a quantized file's position table; `output`, the name of the
    output layer (or the token embedding it is tied to), takes OUTPUT_TYPES' type; a matrix whose rows
    do not fill whole blocks of its quantized type falls back to F16."""
    quantized = file_type not in ("F32", "F16", "BF16")
    if len(shape) < 2 or name.endswith("_norm.weight") or (quantized and name == "position_embd.weight"):
        return gguf.GGMLQuantizationType.F32
    kind = gguf.GGMLQuantizationType[OUTPUT_TYPES.get(file_type, file_type) if name == output else file_type]
    block, _ = gguf.GGML_QUANT_SIZES[kind]
    return gguf.GGMLQuantizationType.F16 if shape[-1] % block else kind


def add_tensors(writer: "gguf.GGUFWriter", tensors: dict[str, torch.Tensor], file_type: str) -> list[str]:
    """Each tensor in its type (tensor_type) for a file of `file_type`, quantized by gguf's own
    quantizers. Returns the names of the matrices that fell back to F16 in a quantized file."""
    writer.add_file_type(FILE_TYPES[file_type])
    output = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    fell_back = []
    for name, tensor in tensors.items():
        data = tensor.detach().to("cpu", torch.float32).numpy()
        kind = tensor_type(name, tuple(data.shape), file_type, output)
        if kind == gguf.GGMLQuantizationType.F16:
            fell_back += [name] if file_type != "F16" else []
            data = data.astype(np.float16)
        elif kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)  # bytes: the writer takes the shape from them and raw_dtype
        writer.add_tensor(name, data, raw_dtype=kind)
    return fell_back


def is_export(path: Path) -> bool:
    """Whether path is a GGUF file this export wrote (it carries EXPORT_SOURCE_KEY)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return False
        return EXPORT_SOURCE_KEY in gguf.GGUFReader(path).fields
    except Exception:  # a damaged or foreign file fails GGUFReader in many ways; each means "not ours"
        return False
