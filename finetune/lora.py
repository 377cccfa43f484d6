"""LoRA: low-rank adapters trained beside a frozen model, injected from outside it.

`add_adapters(model, cfg.lora)` replaces the targeted linear layers of a GPT by LoRALinear
wrappers; the model's code does not know. A wrapper keeps the layer's own `weight` and `bias`
(frozen, under their old names) and adds, for each targeted projection, plain named tensors
`lora_A.<projection>` (rank, in) and `lora_B.<projection>` (rows, rank):

    y = x @ W.T + b + scale * x @ A.T @ B.T    with scale = alpha / rank

Our fused layers hold several projections one after the other (c_attn: q_proj, k_proj, v_proj;
SwiGLU's c_fc: gate_proj, up_proj): each targeted projection gets its own A and B over its own
rows, exactly the adapters PEFT puts on the separate layers of a Hugging Face model, so an
exported adapter computes what ours computes. `merge_adapters` folds them into the weights
(W + scale * B @ A per projection) and gives back plain nn.Linear layers.

A LoRA run's checkpoint holds the adapters only, and `lora`: where the frozen weights came from and
a fingerprint of them (sha256 over the tensors' names, dtypes, shapes and bytes, in name order), so
a base that changed since is refused rather than silently combined with adapters trained on another,
and the base's name as the run was given it, which an exported adapter records.
"""

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from data.files import atomic_open, make_dir
from data.tokenizer import tokenizer_from_meta
from errors import UserError
from interop.families import family_for
from interop.hf import write_safetensors
from interop.pretrained import (
    ADAPTER_CONFIG_NAME,
    check_export_folder,
    crop_positions,
    grow_vocabulary,
    load_pretrained,
    run_checkpoint,
)
from model import GPT, GPTConfig
from trainer.config import LORA_TARGETS, LoraConfig, config_from_dict

ADAPTER_FILES = ("adapter_model.safetensors", ADAPTER_CONFIG_NAME)  # what --export-adapter writes
# our linear layers in each block and the projections they hold, in row order
LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def projections(config: GPTConfig, layer: str) -> list[tuple[str, int]]:
    """(name, rows) of each projection that one of our linear layers holds, in order."""
    attention = config.n_head * config.head_size
    kv = config.kv_heads * config.head_size
    return {
        "attn.c_attn": [("q_proj", attention), ("k_proj", kv), ("v_proj", kv)],
        "attn.c_proj": [("o_proj", config.n_embd)],
        "mlp.c_fc": [("gate_proj", config.mlp_hidden), ("up_proj", config.mlp_hidden)]
        if config.mlp == "swiglu"
        else [("up_proj", config.mlp_hidden)],
        "mlp.c_proj": [("down_proj", config.n_embd)],
    }[layer]


class LoRALinear(nn.Module):
    """A frozen linear layer plus a low-rank adapter on each of the projections in `targeted`."""

    def __init__(self, linear: nn.Linear, parts: list[tuple[str, int]], targeted: list[str], rank: int, alpha: float,
                 dropout: float):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.parts = parts
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)
        device = linear.weight.device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, rows in parts:
            if name in targeted:
                a = torch.empty(rank, self.in_features, device=device)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's and nn.Linear's initialisation
                self.lora_A[name] = nn.Parameter(a)
                # B starts at zero: the adapted model starts as the base model
                self.lora_B[name] = nn.Parameter(torch.zeros(rows, rank, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        h = self.dropout(x)
        deltas = [
            F.linear(F.linear(h, self.lora_A[name]), self.lora_B[name])
            if name in self.lora_A
            else h.new_zeros(*h.shape[:-1], rows)
            for name, rows in self.parts
        ]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
        return y + (delta * self.scale).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A of each projection (zeros for those without an adapter), stacked as the weight's rows."""
        blocks = [
            self.lora_B[name] @ self.lora_A[name]
            if name in self.lora_A
            else torch.zeros(rows, self.in_features, device=self.weight.device)
            for name, rows in self.parts
        ]
        return torch.cat(blocks) * self.scale

    def extra_repr(self) -> str:
        rank = next(iter(self.lora_A.values())).size(0)
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, rank={rank}, adapted={list(self.lora_A)}"


def add_adapters(model: GPT, lora: LoraConfig) -> None:
    """Freeze model and wrap its targeted linear layers, in place; only the adapters need gradients.
    A target the model has no layer for, or a rank above an adapted projection's width, is refused."""
    config = model.config
    present = {name for layer in LAYERS for name, _ in projections(config, layer)}
    missing = [name for name in lora.target_list if name not in present]
    if missing:
        raise UserError(
            f"lora.targets={lora.targets!r}: this model ({config.mlp} MLP) has no {missing[0]} layer "
            f"(its projections are {', '.join(name for name in LORA_TARGETS if name in present)})"
        )
    model.requires_grad_(False)
    for i, block in enumerate(model.transformer.h):
        for layer in LAYERS:
            parts = projections(config, layer)
            targeted = [name for name, _ in parts if name in lora.target_list]
            if not targeted:
                continue
            linear = block.get_submodule(layer)
            for name, rows in parts:
                width = min(rows, linear.in_features)
                if name in targeted and lora.rank > width:
                    raise UserError(
                        f"lora.rank={lora.rank} is above the width of {name} ({rows} x {linear.in_features} in "
                        f"block {i}): a rank-{lora.rank} adapter would be no smaller than the layer (use 1 .. {width})"
                    )
            parent, _, child = layer.rpartition(".")
            wrapper = LoRALinear(linear, parts, targeted, lora.rank, lora.alpha, lora.dropout)
            setattr(block.get_submodule(parent), child, wrapper)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a state dict: what a LoRA checkpoint holds."""
    return {name: tensor for name, tensor in state.items() if is_adapter(name)}


def merge_adapters(model: GPT) -> GPT:
    """Fold every adapter into its layer's weight (W + scale * B @ A, computed in float32, stored in
    W's dtype) and put a plain nn.Linear back in its place. Returns the model."""
    wrappers = [(name, module) for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    for name, wrapper in wrappers:
        linear = nn.Linear(wrapper.in_features, wrapper.out_features, bias=wrapper.bias is not None,
                           device="meta")  # fmt: skip
        with torch.no_grad():
            merged = wrapper.weight.float() + wrapper.delta_weight().float()
        linear.weight = nn.Parameter(merged.to(wrapper.weight.dtype), requires_grad=False)
        if wrapper.bias is not None:
            linear.bias = wrapper.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
    return model


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_record(source: str, state: dict[str, torch.Tensor]) -> dict:
    """What a LoRA checkpoint says of its base: where it came from (a local path made absolute, so a
    run resumed or sampled from elsewhere finds it), its fingerprint, and its name as train.init_from
    gave it (a hub id, or a path as typed), which an exported adapter names: an absolute path would
    hold only on the machine it was made on."""
    where = str(Path(source).resolve()) if Path(source).exists() else source
    return {"source": where, "fingerprint": fingerprint(state), "name": source}


def base_weights(record: dict, config: GPTConfig, adapters: str) -> dict[str, torch.Tensor]:
    """The frozen weights a LoRA checkpoint was trained on, read again from record["source"] and
    shaped as at the start of its run (a vocabulary grown for chat, positions cropped); refused if
    their fingerprint is not the recorded one. adapters: the file that holds the adapters."""
    from trainer.checkpoint import load_checkpoint  # checkpoint.py reads LoRA runs through this module

    source = record["source"]
    checkpoint_path = run_checkpoint(source)
    if checkpoint_path is not None:
        checkpoint = load_checkpoint(checkpoint_path)
        raw, known = checkpoint["model"], tokenizer_from_meta(checkpoint["dataset"]).vocab_size
    else:
        raw = load_pretrained(source, key=f"the base model of {adapters}").state
        known = config.vocab_size
    found = fingerprint(raw)
    if found != record["fingerprint"]:
        raise UserError(
            f"the base model {source} has changed since the adapters in {adapters} were trained on it "
            f"(fingerprint {found[:12]}, trained on {record['fingerprint'][:12]}): put the original back, "
            f"or train new adapters on this one"
        )
    return crop_positions(grow_vocabulary(raw, known, config.vocab_size), config.block_size)


def check_base(source: str, checkpoint: dict, vocab_size: int) -> None:
    """A LoRA run cannot adapt another LoRA run's checkpoint, which holds adapters only; nor a run
    whose vocabulary lacks tokens of the dataset (vocab_size ids): the rows grown for them (a chat
    template's tokens) would stay frozen, all equal to the mean row, so the model could never tell
    them apart, nor end a reply."""
    if "lora" in checkpoint:
        raise UserError(
            f"train.init_from={source!r} is a LoRA run, whose checkpoint holds adapters only: export it merged "
            f"(python sample.py --out-dir {source} --export DIR) and fine-tune that folder"
        )
    known = tokenizer_from_meta(checkpoint["dataset"]).vocab_size
    if vocab_size > known:
        raise UserError(
            f"lora.rank is set, but the dataset has {vocab_size - known} token(s) that train.init_from={source!r} "
            f"has no embedding for (a chat template's): frozen, their rows would all be alike. Fine-tune the run on "
            f"this dataset without LoRA first (lora.rank=0), or adapt a model whose vocabulary holds them"
        )


def lora_model(checkpoint: dict, path: Path, config: GPTConfig, lora: LoraConfig) -> GPT:
    """The model of a LoRA checkpoint: its base read again, its adapters merged in."""
    model = GPT(config)
    model.load_state_dict(base_weights(checkpoint["lora"], config, str(path)))
    add_adapters(model, lora)
    model.load_state_dict(checkpoint["model"], strict=False)  # the adapters; their names were checked
    return merge_adapters(model)


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
    from trainer.checkpoint import load_checkpoint

    path = run_checkpoint(str(source))
    if path is None:
        raise UserError(
            f"--export-adapter: {source} is not a run directory or checkpoint of this trainer (a model folder "
            f"holds no adapters: give the LoRA run with --out-dir)"
        )
    model_type = export_adapter(load_checkpoint(path), path, directory)
    return f"wrote the LoRA adapters of {path} for a {model_type} model to {directory}"
