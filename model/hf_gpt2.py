"""Hugging Face GPT-2 directories in and out: config.json plus model.safetensors (or pytorch_model.bin).

GPT-2's tensors have this model's names (transformer.h.0.attn.c_attn.weight, ...), with or without
the "transformer." prefix; its four Linear layers per block are Conv1D modules that store the
weight transposed, (in, out); the attention-mask buffers (attn.bias, attn.masked_bias) are
constants and are skipped; the output layer is tied to the token embedding.

Safetensors is read and written here directly: an 8-byte little-endian header length, a JSON
header mapping each tensor name to its dtype, shape and byte range, then the raw little-endian data.
Problems with a directory raise ValueError naming the file.
"""

import json
import math
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from .gpt import ARCHITECTURE_KEYS, GPT, GPTConfig

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")  # names transformers gives GPT-2's tanh-approximated GELU
# UTF-8 with a leading byte-order mark skipped, as the rest of the project reads text (data/files.py
# TEXT_ENCODING; model/ imports nothing from there): a config.json saved by a Windows editor still parses
TEXT_ENCODING = "utf-8-sig"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, and GPT-2's
# the sizes in config.json, and GPT-2 124M's where one is left out
HF_SIZES = {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257}
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # config.json keys that name a token, when set


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a .safetensors file, on the CPU. A header that does not describe the bytes
    after it (offsets past the end, a byte range that does not fit the shape) is a ValueError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise ValueError(f"{path} is not a safetensors file (it is {size} bytes long)")
        header_len = struct.unpack("<Q", f.read(8))[0]
        if header_len > size - 8:
            raise ValueError(f"{path} is not a safetensors file (its header would end past the end of the file)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path} is not a safetensors file (its header is not a JSON object)")
        header.pop("__metadata__", None)
        data_size = size - 8 - header_len
        tensors = {}
        for name, entry in header.items():
            dtype, shape, (begin, end) = _tensor_entry(entry, name, data_size, path)
            f.seek(8 + header_len + begin)
            data = bytearray(f.read(end - begin))
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            tensors[name] = flat.reshape(shape)
    return tensors


def _tensor_entry(entry: object, name: str, data_size: int, path: Path) -> tuple[torch.dtype, list[int], list[int]]:
    """The dtype, shape and byte range of one tensor of a safetensors header, checked against the
    data: the range lies within it and holds exactly the shape's bytes."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ValueError(f"{path}: the header entry of tensor {name} lacks its dtype, shape or data_offsets")
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']!r}, which is not supported")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise ValueError(f"{path}: tensor {name} has the shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(n) for n in offsets)):
        raise ValueError(f"{path}: tensor {name} has data_offsets {offsets!r}, not a [begin, end] pair")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise ValueError(f"{path} is truncated or damaged: tensor {name} ends past the end of the file")
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(
            f"{path}: tensor {name} of shape {tuple(shape)} in {entry['dtype']} needs "
            f"{math.prod(shape) * dtype.itemsize} bytes, but its data_offsets give {end - begin}"
        )
    return dtype, shape, offsets


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def write_safetensors(tensors: dict[str, torch.Tensor], f: BinaryIO, metadata: dict[str, str]) -> None:
    """Write tensors (any device; stored as they are, contiguous) in the safetensors format."""
    names = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(header_bytes)))
    f.write(header_bytes)
    for tensor in tensors.values():
        f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def gpt_config_from_hf(hf: dict, source: str) -> GPTConfig:
    """Our config for a GPT-2 config.json (dropout 0; the caller sets its own)."""
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"{source} has model_type={hf.get('model_type')!r}; only GPT-2 models ('gpt2') can be loaded")
    sizes = {key: hf.get(key, default) for key, default in HF_SIZES.items()}
    for key, value in sizes.items():
        if not _is_count(value) or value == 0:
            raise ValueError(f"{source} sets {key}={value!r}, which is not a positive integer")
    for key in TOKEN_KEYS:  # one id, or a list of them (newer configs end text at any of several)
        value = hf.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(_is_count(i) and i < sizes["vocab_size"] for i in ids):
            raise ValueError(
                f"{source} sets {key}={value!r}, which is not a token id below its vocab_size={sizes['vocab_size']}"
            )
    n_embd = sizes["n_embd"]
    unsupported = [
        ("activation_function", hf.get("activation_function", "gelu_new") in TANH_GELU, "gelu_new"),
        ("layer_norm_epsilon", hf.get("layer_norm_epsilon", LAYER_NORM_EPS) == LAYER_NORM_EPS, LAYER_NORM_EPS),
        ("n_inner", hf.get("n_inner") in (None, 4 * n_embd), f"null or {4 * n_embd}"),
        ("scale_attn_weights", hf.get("scale_attn_weights", True) is True, True),
        ("scale_attn_by_inverse_layer_idx", hf.get("scale_attn_by_inverse_layer_idx", False) is False, False),
        ("add_cross_attention", hf.get("add_cross_attention", False) is False, False),
    ]
    for key, ok, supported in unsupported:
        if not ok:
            raise ValueError(f"{source} sets {key}={hf[key]!r}; this model supports only {supported!r}")
    return GPTConfig(
        n_layer=sizes["n_layer"],
        n_head=sizes["n_head"],
        n_embd=n_embd,
        block_size=sizes["n_positions"],
        vocab_size=sizes["vocab_size"],
        dropout=0.0,
        bias=True,
    )


def state_dict_from_hf(hf_tensors: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    """Our state dict from GPT-2's tensors, checking that every weight is there with its shape."""
    tensors = {name.removeprefix("transformer."): tensor for name, tensor in hf_tensors.items()}
    tensors = {name: tensor for name, tensor in tensors.items() if not _is_mask_buffer(name)}
    _check_sizes(tensors, config, source)
    state = {}
    for name, shape in _parameter_shapes(config).items():
        hf_name = name.removeprefix("transformer.")
        if hf_name not in tensors:
            raise ValueError(f"{source} lacks the tensor {hf_name}: it is not a complete GPT-2 checkpoint")
        tensor = tensors.pop(hf_name)
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t()  # Conv1D stores (in, out); Linear wants (out, in)
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{source}: {hf_name} has shape {tuple(tensor.shape)} but config.json implies {shape} "
                f"(the weights do not belong to this config)"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(
                f"{source}: {hf_name} holds NaN or infinite values (a damaged copy: fetch the model again)"
            )
        state[name] = tensor.contiguous()
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(lm_head, state["transformer.wte.weight"]):
        raise ValueError(f"{source} has an output layer that differs from the token embedding; this model ties them")
    if tensors:
        raise ValueError(f"{source} holds tensors GPT-2 does not have: {', '.join(sorted(tensors)[:5])}")
    state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def _check_sizes(tensors: dict[str, torch.Tensor], config: GPTConfig, source: str) -> None:
    """The sizes in config.json against the tensors that pin them (the embeddings, the last block),
    before a model of those sizes is described: a config.json that lies about them is named here
    rather than met as a model too large to describe."""
    pinned = {
        "wte.weight": (config.vocab_size, config.n_embd),
        "wpe.weight": (config.block_size, config.n_embd),
        f"h.{config.n_layer - 1}.ln_1.weight": (config.n_embd,),
    }
    for name, shape in pinned.items():
        if name not in tensors:
            raise ValueError(
                f"{source} lacks the tensor {name}: it is not a complete GPT-2 checkpoint of config.json's size"
            )
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{source}: {name} has shape {tuple(tensors[name].shape)} but config.json implies {shape} "
                f"(the weights do not belong to this config)"
            )


def _is_mask_buffer(name: str) -> bool:
    """h.N.attn.bias and h.N.attn.masked_bias: the causal mask older GPT-2 code stored with the weights."""
    *_, module, tensor = name.split(".")
    return module == "attn" and tensor in ("bias", "masked_bias")


def _parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every weight of GPT(config), without building it (the output layer,
    tied to the token embedding, is left out)."""
    with torch.device("meta"):
        model = GPT(config)
    return {name: tuple(p.shape) for name, p in model.state_dict().items() if name != "lm_head.weight"}


def load_gpt2_dir(directory: Path) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The config and state dict of the GPT-2 model in a Hugging Face directory."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} has no config.json: it is not a Hugging Face model directory")
    try:
        hf_config = json.loads(config_path.read_text(encoding=TEXT_ENCODING))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_path} holds a JSON {type(hf_config).__name__}, not an object of settings")
    config = gpt_config_from_hf(hf_config, str(config_path))
    weights_path, hf_tensors = _read_weights(directory)
    return config, state_dict_from_hf(hf_tensors, config, str(weights_path))


def _read_weights(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    single = directory / "model.safetensors"
    if single.is_file():
        return single, read_safetensors(single)
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # a checkpoint split into shards
        tensors = {}
        for shard in _shards(index):
            tensors.update(read_safetensors(shard))
        return index, tensors
    pickled = directory / "pytorch_model.bin"
    if pickled.is_file():
        return pickled, _read_pickled(pickled)
    raise ValueError(f"{directory} has neither model.safetensors nor pytorch_model.bin")


def _shards(index: Path) -> list[Path]:
    """The shard files an index names: files beside it, never anywhere else."""
    try:
        weight_map = json.loads(index.read_text(encoding=TEXT_ENCODING))["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
    if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise ValueError(f"{index}: weight_map is not a table of tensor names to shard file names")
    shards = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if Path(name).name != name or not shard.is_file():
            raise ValueError(f"{index} names the shard {name!r}, which is not a file in {index.parent}")
        shards.append(shard)
    return shards


def _read_pickled(path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged or foreign file fails torch.load in many ways; each means the same here
        raise ValueError(
            f"{path} is not a readable PyTorch weights file (truncated, damaged, or holding Python objects "
            f"beyond tensors)"
        ) from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise ValueError(f"{path} does not hold a table of tensors")
    return tensors


def gpt2_difference(config: GPTConfig) -> tuple[str, object, object] | None:
    """The first architecture key in which config is not GPT-2, with its value and GPT-2's, or None
    when the model is GPT-2 (of any size)."""
    gpt2 = GPTConfig()
    for key in ARCHITECTURE_KEYS:
        value = getattr(config, key)
        if key == "n_kv_head" and value == config.n_head:
            continue  # as many key/value heads as query heads: GPT-2's attention, spelled out
        if value != getattr(gpt2, key):
            return key, value, getattr(gpt2, key)
    return None


def hf_config(config: GPTConfig, eos_token_id: int | None) -> dict:
    """config.json for transformers' GPT2LMHeadModel. A model without biases is exported with zero
    biases, which computes the same function."""
    hf = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "vocab_size": config.vocab_size,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "tie_word_embeddings": True,
    }
    if eos_token_id is not None:
        hf["bos_token_id"] = hf["eos_token_id"] = eos_token_id
    return hf


def state_dict_to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2's tensors for a model, as GPT2LMHeadModel.save_pretrained names them (the tied output
    layer is left out)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        tensors[name] = tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor
    if not model.config.bias:
        for name, shape in _parameter_shapes(GPTConfig(**{**vars(model.config), "bias": True})).items():
            if name not in tensors:
                tensors[name] = torch.zeros(shape, dtype=model.lm_head.weight.dtype)
    return dict(sorted(tensors.items()))
