"""Hugging Face model folders in and out: config.json, and model.safetensors (or shards with
model.safetensors.index.json, or an older pytorch_model.bin).

Which family a folder holds and how its keys and tensors map to ours is in families.py; this file
reads and writes the files. Safetensors files go through the `safetensors` package, memory-mapped,
with its own checks of the header against the data. Problems raise ValueError naming the file.
"""

import json
from pathlib import Path
from typing import BinaryIO

import safetensors
import safetensors.torch
import torch

from interop.families import Family, config_from_hf, infer_bias, state_dict_from_hf
from model import GPTConfig

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
PICKLED_NAME = "pytorch_model.bin"
# UTF-8 with a leading byte-order mark skipped, as the rest of the project reads text (data/files.py
# TEXT_ENCODING; model/ imports nothing from there): a config.json saved by a Windows editor still parses
TEXT_ENCODING = "utf-8-sig"


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file, on the CPU. A file whose header does not describe its
    bytes is a ValueError carrying the library's reason."""
    try:
        with safetensors.safe_open(path, framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except safetensors.SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


def write_safetensors(tensors: dict[str, torch.Tensor], f: BinaryIO, metadata: dict[str, str]) -> None:
    """Write tensors (any device, none sharing memory) to an open file in the safetensors format."""
    f.write(safetensors.torch.save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, metadata))


def read_config(directory: Path) -> dict:
    """The settings in a folder's config.json."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} has no config.json: it is not a Hugging Face model directory")
    try:
        settings = json.loads(config_path.read_text(encoding=TEXT_ENCODING))
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested deeper than json's parser recurses
        raise ValueError(f"{config_path} is not valid JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{config_path} holds a JSON {type(settings).__name__}, not an object of settings")
    return settings


def load_dir(directory: Path) -> tuple[Family, GPTConfig, dict[str, torch.Tensor]]:
    """The family, our config and our state dict of the model in a Hugging Face folder."""
    directory = Path(directory)
    family, config = config_from_hf(read_config(directory), str(directory / "config.json"))
    weights_path, hf_tensors = _read_weights(directory)
    if family.computes["bias"] is None and "bias" not in family.keys:  # GPT-2: config.json does not say
        config.bias = infer_bias(hf_tensors, config, family)
    return family, config, state_dict_from_hf(hf_tensors, config, family, str(weights_path))


def _read_weights(directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    single = directory / SAFETENSORS_NAME
    if single.is_file():
        return single, read_safetensors(single)
    index = directory / SAFETENSORS_INDEX_NAME
    if index.is_file():  # a checkpoint split into shards
        tensors = {}
        for shard in _shards(index):
            tensors.update(read_safetensors(shard))
        return index, tensors
    pickled = directory / PICKLED_NAME
    if pickled.is_file():
        return pickled, _read_pickled(pickled)
    raise ValueError(f"{directory} has neither {SAFETENSORS_NAME} nor {PICKLED_NAME}")


def _shards(index: Path) -> list[Path]:
    """The shard files an index names: files beside it, never anywhere else."""
    try:
        weight_map = json.loads(index.read_text(encoding=TEXT_ENCODING))["weight_map"]
    except (ValueError, RecursionError, TypeError, KeyError):
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
