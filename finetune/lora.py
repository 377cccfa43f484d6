"""LoRA: low-rank adapters trained beside a frozen model, injected from outside it.

`add_adapters(model, cfg.lora)` replaces the targeted linear layers of a GPT by LoRALinear
wrappers; the model's code does not know. A wrapper keeps the layer's own `weight` and `bias`
(frozen, under their old names) and adds, for each targeted projection, plain named tensors
`lora_A.<projection>` (rank, in) and `lora_B.<projection>` (rows, rank):

    y = x @ W.T + b + scale * x @ A.T @ B.T    with scale = alpha / rank

Our fused layers hold several projections one after the other (c_attn: q_proj, k_proj, v_proj;
SwiGLU's c_fc: gate_proj, up_proj): each targeted projection gets its own A and B over its own
rows, exactly the adapters PEFT puts on the separate layers of a Hugging Face model, so an
exported adapter (interop/peft.py) computes what ours computes. `merge_adapters` folds them into
the weights (W + scale * B @ A per projection) and gives back plain nn.Linear layers.

A LoRA run's checkpoint holds the adapters only, and `lora`: where the frozen weights came from, a
fingerprint of them (sha256 over the tensors' names, dtypes, shapes and bytes, in name order), so
that a base that changed since is refused rather than silently combined with adapters trained on
another, and the base's name as the run was given it, which an exported adapter records
(finetune/init_from.py reads the base again).
"""

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from errors import UserError
from model import GPT, GPTConfig
from trainer.config import LORA_TARGETS, LoraConfig

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


def expected_adapters(config: GPTConfig, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The adapters (on the meta device: names and shapes) that a LoRA run's checkpoint holds."""
    with torch.device("meta"):
        model = GPT(config)
        add_adapters(model, lora)
        return adapter_state(model.state_dict())
