"""Hugging Face model folders for training and sampling: load one (or a hub id, through the
Hugging Face cache) to fine-tune or sample from, export a trained model to one. Which family a
model belongs to is model/families.py's table; the files are read and written by model/hf.py."""

import dataclasses
import json
import pickle
import re
from pathlib import Path

import torch

from data.files import atomic_open, check_writable_dir, make_dir
from data.tokenizer import GPT2Tokenizer, Tokenizer
from data.tokenizer_json import tokenizer_config, tokenizer_json
from errors import UserError
from model import GPT, GPTConfig
from model.families import Family, family_for, hf_config, tensors_to_hf
from model.hf import SAFETENSORS_NAME, load_dir, write_safetensors
from trainer.config import Config

TOKENIZER_NAME = "tokenizer.json"
# what a hub download fetches: the files this project reads (not other formats' weights)
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name
# switches that make a model compute something else: a run that sets one differently from the folder is refused
KEPT_SWITCHES = ("pos_emb", "norm", "qk_norm", "mlp", "tie_embeddings", "logit_softcap")
# what the folder decides of the model's shape, whatever the run's config says
FOLDER_SHAPE = ("n_layer", "n_head", "n_embd", "vocab_size", "n_kv_head", "mlp_width", "norm_eps", "rope_base", "bias")


@dataclasses.dataclass
class Pretrained:
    """A model read from a Hugging Face folder: its family, our config and state dict, the folder."""

    family: Family
    config: GPTConfig
    state: dict[str, torch.Tensor]
    directory: Path


def is_hub_id(value: str) -> bool:
    """owner/name that is not a path on this machine: a model on the Hugging Face hub."""
    return bool(HUB_ID.match(value)) and not Path(value).exists()


def resolve_folder(value: str, key: str) -> Path:
    """The local folder of value: itself, or the Hugging Face cache's copy of a hub id (downloaded
    there when it is not cached yet)."""
    if Path(value).is_dir():
        return Path(value)
    if not is_hub_id(value):
        raise UserError(f"{key}={value!r} is not a directory (give a Hugging Face model folder, or a hub id owner/name)")
    from huggingface_hub import snapshot_download  # only a hub id needs it
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    try:
        return Path(snapshot_download(value, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"{key}={value!r} is not a folder here, and the hub model {value} cannot be downloaded ({reason}): "
            f"download it (huggingface-cli download {value}) or pass a folder"
        ) from None


def load_pretrained(value: str, key: str) -> Pretrained:
    """The model in a Hugging Face folder or hub id; any problem is a UserError naming key and file."""
    directory = resolve_folder(value, key)
    try:
        family, config, state = load_dir(directory)
    except (ValueError, OSError, pickle.UnpicklingError, KeyError) as e:
        raise UserError(f"{key}={value!r} cannot be loaded: {e}") from None
    return Pretrained(family, config, state, directory)


def folder_tokenizer(pretrained: Pretrained, key: str) -> Tokenizer:
    """The tokenizer of a folder: GPT-2's BPE for a GPT-2 folder without a tokenizer.json."""
    path = pretrained.directory / TOKENIZER_NAME
    if path.is_file() and path.read_text(encoding="utf-8") != tokenizer_json(GPT2Tokenizer()):
        raise UserError(
            f"{key}={str(pretrained.directory)!r} carries {TOKENIZER_NAME}, which this version cannot read yet "
            f"(only GPT-2 folders with GPT-2's BPE are read)"
        )
    if pretrained.family.model_type != "gpt2" and not path.is_file():
        raise UserError(f"{key}={str(pretrained.directory)!r} has no {TOKENIZER_NAME}: a {pretrained.family.model_type} folder needs its tokenizer")
    tokenizer = GPT2Tokenizer()
    if tokenizer.vocab_size > pretrained.config.vocab_size:
        raise UserError(
            f"{key}={str(pretrained.directory)!r}: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"embedding only {pretrained.config.vocab_size} rows (the tokenizer does not belong to these weights)"
        )
    return tokenizer


def model_from_pretrained(value: str, key: str) -> tuple[GPT, Tokenizer, Path]:
    """The model in a folder or hub id (on the CPU, in eval mode), its tokenizer and its folder."""
    pretrained = load_pretrained(value, key)
    tokenizer = folder_tokenizer(pretrained, key)
    model = GPT(pretrained.config)
    model.load_state_dict(pretrained.state)
    return model.eval(), tokenizer, pretrained.directory


def with_pretrained_shape(cfg: Config, pretrained: Pretrained, dataset_meta: dict) -> Config:
    """The run's config for fine-tuning the weights in train.init_from.

    The architecture and shape are the folder's; model.block_size may shorten its context (a learned
    position table is cropped); model.dropout and the attention pattern are the run's own.
    """
    source, folder = cfg.train.init_from, pretrained.config
    if dataset_meta["tokenizer"] != "gpt2":
        raise UserError(
            f"train.init_from={source!r} holds a model that reads GPT-2 BPE tokens, but "
            f"data.dataset={cfg.data.dataset!r} was prepared with the {dataset_meta['tokenizer']!r} tokenizer "
            f"(use a GPT-2 BPE dataset: the bundled 'shakespeare', or python data/prepare.py --tokenizer gpt2)"
        )
    if cfg.model.block_size > folder.block_size:
        raise UserError(
            f"model.block_size={cfg.model.block_size} is longer than the {folder.block_size} positions of the "
            f"model in train.init_from={source!r} (use at most {folder.block_size})"
        )
    default = GPTConfig()
    for key in KEPT_SWITCHES:
        run, theirs = getattr(cfg.model, key), getattr(folder, key)
        if run != getattr(default, key) and run != theirs:
            raise UserError(
                f"train.init_from={source!r} holds a {pretrained.family.model_type} model with model.{key}="
                f"{json.dumps(theirs)}, but the run sets model.{key}={json.dumps(run)} (fine-tuning keeps the "
                f"folder's architecture: set model.{key}={json.dumps(theirs)} or leave it out)"
            )
    shape = {name: getattr(folder, name) for name in (*FOLDER_SHAPE, *KEPT_SWITCHES)}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **shape))


def crop_positions(state: dict[str, torch.Tensor], block_size: int) -> dict[str, torch.Tensor]:
    """The weights with a learned position table cut to the first block_size positions."""
    if "transformer.wpe.weight" not in state:
        return state
    return state | {"transformer.wpe.weight": state["transformer.wpe.weight"][:block_size]}


def export_model(model: GPT, tokenizer: Tokenizer, directory: Path) -> Family:
    """Write the Hugging Face folder of the family that computes model: config.json,
    model.safetensors (the weights in their dtype), tokenizer.json and tokenizer_config.json, which
    transformers' AutoModelForCausalLM and AutoTokenizer load. Returns the family."""
    try:
        family = family_for(model.config)
    except ValueError as e:
        raise UserError(f"--export cannot write this model: {e}") from None
    check_writable_dir(directory, "--export")
    held = _model_files(directory)
    if held:
        raise UserError(
            f"--export={str(directory)!r} already holds a model ({', '.join(held)}), which the export would "
            f"replace: export into a new or empty directory"
        )
    make_dir(directory)
    config = hf_config(model.config, family, tokenizer.eot_token)
    config["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    tensors = tensors_to_hf(model.state_dict(), model.config, family)
    with atomic_open(directory / SAFETENSORS_NAME) as f:
        write_safetensors(tensors, f, metadata={"format": "pt"})
    files = {
        TOKENIZER_NAME: tokenizer_json(tokenizer),
        "tokenizer_config.json": json.dumps(tokenizer_config(tokenizer), indent=2) + "\n",
        "config.json": json.dumps(config, indent=2) + "\n",  # last: a folder with a config.json is complete
    }
    for name, text in files.items():
        with atomic_open(directory / name) as f:
            f.write(text.encode("utf-8"))
    return family


def _model_files(directory: Path) -> list[str]:
    """The files of a Hugging Face model in directory: its config, weights and tokenizer."""
    if not directory.is_dir():
        return []
    weights = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
    names = ("config.json", TOKENIZER_NAME)
    return sorted(p.name for p in directory.iterdir() if p.name in names or p.name.endswith(weights))
