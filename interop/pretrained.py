"""Hugging Face model folders for training and sampling: load one (or a hub id, through the
Hugging Face cache) to fine-tune or sample from, export a trained model to one. Which family a
model belongs to is interop/families.py's table; the files are read and written by interop/hf.py."""

import dataclasses
import json
import pickle
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import tokenizers
import torch

from data.conversations import end_of_turn, folder_template
from data.files import atomic_open, check_output_folder, is_hub_id, make_dir
from data.gguf_tokenizer import GGUF_SUFFIX
from data.tokenizer import GPT2Tokenizer, JsonTokenizer, Tokenizer
from errors import UserError
from interop.families import Family, family_for, hf_config, ignored_note, tensors_to_hf
from interop.hf import SAFETENSORS_NAME, load_dir, read_config, write_safetensors
from model import GPT, GPTConfig
from trainer.checkpoint import non_finite

TOKENIZER_NAME = "tokenizer.json"
GENERATION_CONFIG_NAME = "generation_config.json"  # a chat model's: where transformers' generate stops
# a PEFT adapter's config: transformers loads a folder holding it as its base model with the adapter applied
ADAPTER_CONFIG_NAME = "adapter_config.json"
# what --export writes (a model without a chat template: all but generation_config.json)
EXPORT_FILES = (SAFETENSORS_NAME, TOKENIZER_NAME, "tokenizer_config.json", GENERATION_CONFIG_NAME, "config.json")
# what a hub download fetches: the files this project reads (not other formats' weights)
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]


@dataclasses.dataclass
class Pretrained:
    """A model read from a Hugging Face folder or a GGUF file: its family, our config and state dict, the
    folder (or file), and a GGUF file's tokenizer (a folder's is read by folder_tokenizer)."""

    family: Family
    config: GPTConfig
    state: dict[str, torch.Tensor]
    directory: Path
    tokenizer: Tokenizer | None = None


def resolve_folder(value: str, key: str) -> Path:
    """The local folder of value: itself, or the Hugging Face cache's copy of a hub id (downloaded
    there when it is not cached yet)."""
    if Path(value).is_dir():
        return Path(value)
    if not is_hub_id(value):
        raise UserError(
            f"{key}={value!r} is not a directory (give a Hugging Face model folder, or a hub id owner/name)"
        )
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
    """The model in a Hugging Face folder or hub id, or in a GGUF file (a path ending in .gguf); any
    problem is a UserError naming key and file. The config.json keys it ignores, which no model code
    reads, are named in one line on stderr."""
    if Path(value).suffix == GGUF_SUFFIX:
        from interop.gguf_read import read_gguf  # llama.cpp's files: a folder needs none of it

        family, config, state, tokenizer = read_gguf(Path(value), key)
        return Pretrained(family, config, state, Path(value), tokenizer)
    directory = resolve_folder(value, key)
    try:
        family, config, state = load_dir(directory)
        note = ignored_note(read_config(directory), str(directory / "config.json"))
    except (ValueError, OSError, pickle.UnpicklingError, KeyError) as e:
        raise UserError(f"{key}={value!r} cannot be loaded: {e}") from None
    if note is not None:
        print(note, file=sys.stderr)
    return Pretrained(family, config, state, directory)


def folder_tokenizer(pretrained: Pretrained, key: str) -> Tokenizer:
    """The tokenizer of a folder: its tokenizer.json, or GPT-2's BPE for a GPT-2 folder without one, with
    the folder's chat template where it has one; a GGUF file's own."""
    if pretrained.tokenizer is not None:
        return _fitting(pretrained.tokenizer, pretrained, key, source=str(pretrained.directory))
    path = pretrained.directory / TOKENIZER_NAME
    if path.is_file():
        tokenizer = JsonTokenizer.from_file(path)
    elif pretrained.family.model_type == "gpt2":
        tokenizer = GPT2Tokenizer()
    else:
        raise UserError(
            f"{key}={str(pretrained.directory)!r} has no {TOKENIZER_NAME}: a {pretrained.family.model_type} "
            f"folder needs its tokenizer (copy it there from where the model came from)"
        )
    found = folder_template(pretrained.directory)  # an instruct model's own template: sample.py --chat, eval.py
    if found is not None:
        tokenizer.with_chat_template(*found)
    source = path if path.is_file() else "GPT-2's BPE, the tokenizer of a GPT-2 folder without tokenizer.json"
    return _fitting(tokenizer, pretrained, key, source)


def _fitting(tokenizer: Tokenizer, pretrained: Pretrained, key: str, source: str) -> Tokenizer:
    """The tokenizer, whose ids the model's embedding must all have rows for."""
    # a vocabulary may be padded beyond the tokenizer's ids (GPT-2's 50304 computes faster): those rows
    # are never sampled (sampling draws among the tokenizer's ids) nor trained towards (no text holds them)
    if tokenizer.vocab_size > pretrained.config.vocab_size:
        settings = pretrained.directory if pretrained.tokenizer is not None else pretrained.directory / "config.json"
        raise UserError(
            f"{key}={str(pretrained.directory)!r} holds a model of vocab_size={pretrained.config.vocab_size} "
            f"({settings}), fewer than the {tokenizer.vocab_size:,} tokens of its "
            f"tokenizer ({source}): the tokenizer does not belong to these weights (a vocabulary padded beyond "
            f"the tokenizer's, such as GPT-2's 50304, can be used)"
        )
    return tokenizer


def model_from_pretrained(value: str, key: str) -> tuple[GPT, Tokenizer, Path]:
    """The model in a folder or hub id (on the CPU, in eval mode), its tokenizer and its folder."""
    pretrained = load_pretrained(value, key)
    tokenizer = folder_tokenizer(pretrained, key)
    model = GPT(pretrained.config)
    model.load_state_dict(pretrained.state)
    return model.eval(), tokenizer, pretrained.directory


def export_model(model: GPT, tokenizer: Tokenizer, directory: Path) -> Family:
    """Write the Hugging Face folder of the family that computes model: config.json,
    model.safetensors (the weights in their dtype), tokenizer.json and tokenizer_config.json (with the
    chat template and its named tokens, where the tokenizer has one, and then generation_config.json:
    where generate stops), which transformers' AutoModelForCausalLM and AutoTokenizer load. Returns the
    family. A chat model trained with model.attn_documents is written as the plain causal model, with a
    note saying so (exported_config). Weights that are
    not all finite numbers are refused before anything is written: import would refuse the folder.
    The folder is new, or holds none of those files and no other model: nothing there is replaced or
    removed."""
    config = exported_config(model.config, tokenizer)
    try:
        family = family_for(config)
    except ValueError as e:
        raise UserError(f"--export cannot write this model: {e}") from None
    problem = non_finite(model.state_dict())
    if problem is not None:
        raise UserError(f"--export cannot write this model: its weight {problem} (export one from before it diverged)")
    special = special_tokens(tokenizer)
    check_export_folder(directory)
    make_dir(directory)
    hf = hf_config(config, family, special.bos, special.eos)
    hf["torch_dtype"] = str(model.lm_head.weight.dtype).removeprefix("torch.")
    tensors = tensors_to_hf(model.state_dict(), config, family)
    with atomic_open(directory / SAFETENSORS_NAME) as f:
        write_safetensors(tensors, f, metadata={"format": "pt"})
    files = {
        TOKENIZER_NAME: tokenizer.to_json(),
        "tokenizer_config.json": json.dumps(tokenizer_config(tokenizer, special), indent=2) + "\n",
    }
    if tokenizer.chat_template is not None:
        files[GENERATION_CONFIG_NAME] = json.dumps(generation_config(tokenizer, config.block_size), indent=2) + "\n"
    files["config.json"] = json.dumps(hf, indent=2) + "\n"  # last: a folder with a config.json is complete
    for name, text in files.items():
        with atomic_open(directory / name) as f:
            f.write(text.encode("utf-8"))
    note_plain_causal(model.config, tokenizer)
    return family


def check_export_folder(directory: Path, key: str = "--export", writes: Iterable[str] = EXPORT_FILES) -> None:
    """Refuse, before the model is even loaded, an export folder (named by the option key) that holds any
    file the export writes, or another model's or adapter's files, which ours would be mixed with: a
    model folder that gains an adapter_config.json loads in transformers as that model with the adapter."""
    check_output_folder(directory, key, [*writes, *_model_files(directory)])


def plain_causal_chat_model(config: GPTConfig, tokenizer: Tokenizer) -> bool:
    """Whether a model trained with model.attn_documents is exported (--export, --export-gguf) as the plain
    causal model: a chat model's documents are its conversations, a chat program sends one conversation,
    and over one document the two compute the same (docs/chat.md)."""
    return config.attn_documents and not config.attn_document_positions and tokenizer.chat_template is not None


def exported_config(config: GPTConfig, tokenizer: Tokenizer) -> GPTConfig:
    """The config a model is exported as: a chat model's documents dropped (plain_causal_chat_model)."""
    if plain_causal_chat_model(config, tokenizer):
        return dataclasses.replace(config, attn_documents=False)
    return config


def note_plain_causal(config: GPTConfig, tokenizer: Tokenizer) -> None:
    """Say on stderr, in one line, what an export that wrote a chat model as the plain causal model
    (plain_causal_chat_model) assumes; nothing for any other model."""
    if plain_causal_chat_model(config, tokenizer):
        separator = tokenizer.decode([config.eot_token])
        print(
            f"note: model.attn_documents=true is written as the plain causal model, which computes the same over "
            f"one document: a prompt of one conversation, as chat programs send, is read as in training; one "
            f"holding {separator} is read whole, where sample.py reads only its last document",
            file=sys.stderr,
        )


class SpecialTokens(NamedTuple):
    """The ids of a tokenizer's special tokens as an export writes them (None: it has no such token),
    and whether its encoder adds bos before a text (and eos after it)."""

    bos: int | None
    eos: int | None
    eot: int | None  # the token that ends a reply (a chat model's)
    pad: int | None
    add_bos: bool
    add_eos: bool


def special_tokens(tokenizer: Tokenizer) -> SpecialTokens:
    """The special tokens of tokenizer, the model folder's own where it came from one: bos, eos and pad
    are the tokens its tokenizer_config.json names (a run's dataset metadata keeps them with the chat
    template); a bos not named is the token its tokenizer.json adds before a text (Llama 3's
    <|begin_of_text|>), else the end-of-text token, which is also an eos not named (GPT-2's is both);
    eot is the token that ends a reply, where it has a chat template. add_bos and add_eos: whether its
    tokenizer.json's post-processor adds them, as transformers' tokenizer then does. A named token that
    is none of the tokenizer's is refused by name."""
    names = tokenizer.template_variables
    named = {
        role: _token_id(tokenizer, role, names[f"{role}_token"])
        for role in ("bos", "eos", "pad")
        if f"{role}_token" in names
    }
    before, after = _added_around_text(tokenizer)
    bos = named.get("bos", before[0] if before else tokenizer.eot_token)
    eos = named.get("eos", tokenizer.eot_token)
    stops = end_of_turn(tokenizer) if tokenizer.chat_template is not None else []
    add_bos, add_eos = bos is not None and before[:1] == [bos], eos is not None and after[-1:] == [eos]
    return SpecialTokens(bos, eos, stops[0] if stops else None, named.get("pad"), add_bos, add_eos)


def _token_id(tokenizer: Tokenizer, role: str, token: str) -> int:
    """The id of the token that tokenizer_config.json names by its text as role_token (bos_token, ...)."""
    token_id = tokenizer.specials.get(token)
    if token_id is None and isinstance(tokenizer, JsonTokenizer):
        token_id = tokenizer.tokenizer.token_to_id(token)
    if token_id is None:
        raise UserError(
            f"{getattr(tokenizer, 'source', tokenizer.name)} has no token {token!r}, which tokenizer_config.json "
            f"names as its {role}_token (add the token to the tokenizer, or name one it has)"
        )
    return token_id


def _added_around_text(tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The ids a tokenizer.json's post-processor puts before a text and after it (Llama 3's: <|begin_of_text|>
    before); none for the other tokenizers, which add nothing. Seen on the text of its first ordinary token."""
    if not isinstance(tokenizer, JsonTokenizer):
        return [], []
    encoder = tokenizers.Tokenizer.from_str(tokenizer.text)
    encoder.no_truncation()
    encoder.no_padding()
    ordinary = min(set(range(tokenizer.vocab_size)) - set(tokenizer.specials.values()), default=None)
    text = "" if ordinary is None else tokenizer.decode([ordinary])
    plain = encoder.encode(text, add_special_tokens=False).ids
    added = encoder.encode(text, add_special_tokens=True).ids
    for start in range(len(added) - len(plain) + 1):
        if added[start : start + len(plain)] == plain:
            return added[:start], added[start + len(plain) :]
    return [], []  # post-processors add tokens around a text and leave its own ids: not reached


def tokenizer_config(tokenizer: Tokenizer, special: SpecialTokens) -> dict:
    """tokenizer_config.json: the plain fast tokenizer over tokenizer.json, which adds no token of its
    own (but those its post-processor adds) and leaves decoded spaces as they are, so that decoding gives
    exactly what sample.py prints; its bos, eos and pad are the special tokens' (special_tokens)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for role in ("bos", "eos", "pad"):
        token_id = getattr(special, role)
        if token_id is not None:
            config[f"{role}_token"] = tokenizer.decode([token_id])
    if tokenizer.chat_template is not None:
        # the template and the named tokens it is rendered with (its eos_token is where a reply ends), so
        # that apply_chat_template gives the ids sample.py --chat feeds the model
        config |= {"chat_template": tokenizer.chat_template, **tokenizer.template_variables}
    return config


def generation_config(tokenizer: Tokenizer, block_size: int) -> dict:
    """generation_config.json of a chat model: transformers' generate stops at the end of a turn (and at
    the end-of-text token), where sample.py --chat stops, or where the model's context ends."""
    stops = end_of_turn(tokenizer)
    if tokenizer.eot_token is not None and tokenizer.eot_token not in stops:
        stops.append(tokenizer.eot_token)
    return {"eos_token_id": stops, "pad_token_id": stops[0], "max_length": block_size}


def _model_files(directory: Path) -> list[str]:
    """The files of a Hugging Face model or PEFT adapter in directory: its config, weights and tokenizer."""
    if not directory.is_dir():
        return []
    weights = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
    names = ("config.json", TOKENIZER_NAME, ADAPTER_CONFIG_NAME)
    return sorted(p.name for p in directory.iterdir() if p.name in names or p.name.endswith(weights))
