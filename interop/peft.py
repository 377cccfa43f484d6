"""LoRA adapters out to PEFT: sample.py --export-adapter writes a LoRA run's adapters as a PEFT folder
(adapter_config.json and adapter_model.safetensors) for the Hugging Face model of its base, which
peft.PeftModel.from_pretrained loads (docs/finetuning.md)."""

import json
from pathlib import Path

from data.files import atomic_open, make_dir
from errors import UserError
from finetune.init_from import base_weights
from finetune.lora import LAYERS, projections
from interop.families import family_for
from interop.hf import write_safetensors
from interop.pretrained import ADAPTER_CONFIG_NAME, check_export_folder
from trainer.checkpoint import load_checkpoint, run_checkpoint
from trainer.config import config_from_dict

ADAPTER_FILES = ("adapter_model.safetensors", ADAPTER_CONFIG_NAME)  # what --export-adapter writes


def export_adapter(checkpoint: dict, path: Path, directory: Path) -> str:
    """Write the adapters of a LoRA checkpoint as a PEFT folder (adapter_config.json and
    adapter_model.safetensors) for the Hugging Face model of its base, which
    peft.PeftModel.from_pretrained loads. Returns the family's model_type."""
    if "lora" not in checkpoint:
        raise UserError(
            f"--export-adapter: {path} holds a full fine-tune or a model trained from scratch, not LoRA adapters "
            f"(train with lora.rank above 0, or write the whole model with --export DIR)"
        )
    check_export_folder(directory, "--export-adapter", ADAPTER_FILES)  # not a model's folder: it would load both
    cfg = config_from_dict(checkpoint["config"], source=str(path))
    base_weights(checkpoint["lora"], cfg.model, str(path))  # the adapters fit the base the folder will name
    try:
        family = family_for(cfg.model)
    except ValueError as e:
        raise UserError(f"--export-adapter cannot write this model: {e}") from None
    tensors, modules = {}, set()
    for weight in family.weights:
        layer = weight.ours.removeprefix("transformer.h.{i}.").removesuffix(".weight")
        if layer not in LAYERS or weight.convert not in ("same", "fused_qkv", "fused_gate_up"):
            if layer in LAYERS and weight.ours.endswith(".weight"):
                raise UserError(
                    f"--export-adapter writes adapters for separate projection layers; a {family.model_type} "
                    f"model stores {layer} as one {weight.convert} layer (write the merged model with --export DIR)"
                )
            continue
        # the conversions taken split rows only: an adapter maps projection by projection
        for i in range(cfg.model.n_layer):
            ours = f"transformer.h.{i}.{layer}"
            parts = projections(cfg.model, layer)
            for (name, _), theirs in zip(parts, weight.theirs, strict=True):
                if f"{ours}.lora_A.{name}" not in checkpoint["model"]:
                    continue
                module = theirs.format(i=i).removesuffix(".weight")
                modules.add(module.rpartition(".")[2])
                tensors[f"base_model.model.{module}.lora_A.weight"] = checkpoint["model"][f"{ours}.lora_A.{name}"]
                tensors[f"base_model.model.{module}.lora_B.weight"] = checkpoint["model"][f"{ours}.lora_B.{name}"]
    lora = cfg.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        # the base as the run was given it (a checkpoint without "name" holds its absolute path only)
        "base_model_name_or_path": checkpoint["lora"].get("name", checkpoint["lora"]["source"]),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
    }
    make_dir(directory)
    with atomic_open(directory / ADAPTER_FILES[0]) as f:
        write_safetensors(tensors, f, metadata={"format": "pt"})
    with atomic_open(directory / ADAPTER_FILES[1]) as f:  # last: a folder with its config is complete
        f.write((json.dumps(config, indent=2) + "\n").encode("utf-8"))
    return family.model_type


def export_run_adapter(source: str | Path, directory: Path) -> str:
    """sample.py --export-adapter: write the adapters of the run in source (a run directory or its
    ckpt.pt) to directory; returns the line that says what was written."""

    path = run_checkpoint(str(source))
    if path is None:
        raise UserError(
            f"--export-adapter: {source} is not a run directory or checkpoint of this trainer (a model folder "
            f"holds no adapters: give the LoRA run with --out-dir)"
        )
    model_type = export_adapter(load_checkpoint(path), path, directory)
    return f"wrote the LoRA adapters of {path} for a {model_type} model to {directory}"
