"""Linear layers with their weights reordered once for oneDNN: faster inference on a CPU.

Decoding one token multiplies one row per sequence by every weight matrix, so a step's time is set by
how fast the products stream the weights from memory, not by arithmetic. On a CPU, nn.Linear hands
the product to the BLAS library PyTorch was built with, which for so few rows can fall far short of
the memory bandwidth. oneDNN, given each weight reordered once into its own blocked layout, comes
much closer (docs/benchmarks.md measures both on one machine). Inductor prepacks weights in the same
spirit when it freezes a model for CPU inference; this module does it without compiling.

`pack_linears(model)` swaps every nn.Linear of a model for a PackedLinear holding the reordered
weight; the model's code and forward pass stay as they are. The result is for inference only: its
parameters are frozen, and a reordered weight is an opaque oneDNN tensor, so a packed layer refuses
to be moved, cast or saved (pack a model last, after moving and casting it, and save it before).
"""

import platform

import torch
import torch.nn as nn


def packing_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the linear layers of a model on this device, in this dtype, are not packed; None when
    they can be."""
    if device.type != "cpu":
        return f"packing is for CPUs, the model is on {device.type}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # measured on x86-64 only; elsewhere PyTorch's own CPU products may well be as fast
        return f"packing is for x86-64 CPUs, this one is {platform.machine()}"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this PyTorch build has no oneDNN linear products"
    supported = {
        torch.float32: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }
    if not supported.get(dtype, False):
        return f"oneDNN has no {str(dtype).removeprefix('torch.')} products on this CPU"
    return None


class PackedLinear(nn.Module):
    """y = x @ W.T + b, as the nn.Linear it was made from computes it, with W reordered for oneDNN."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.register_state_dict_pre_hook(_refuse_to_save)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            # oneDNN's product has no backward: gradients would silently stop here
            raise RuntimeError("PackedLinear is for inference only: call it under torch.no_grad()")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _apply(self, fn, recurse=True):
        # .to(), .float(), .cuda() and the like all come here
        raise RuntimeError("a packed linear layer cannot be moved or cast: pack the model after moving and casting it")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _refuse_to_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    raise RuntimeError(f"{prefix or 'the model'}: a packed model has no state_dict (save the model before packing it)")


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear in model, in place, for a PackedLinear, and freeze the model for
    inference (eval mode, no parameter needs gradients). Returns the model.

    A weight shared by two modules (GPT-2's output layer and token embedding) is packed as a copy
    for the linear layer while the embedding keeps the original: for GPT-2 124M in float32 that is
    154 MB more memory."""
    weight = next(model.parameters())
    reason = packing_unavailable(weight.device, weight.dtype)
    if reason is not None:
        raise ValueError(f"cannot pack the linear layers: {reason}")
    model.eval().requires_grad_(False)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in linears:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, PackedLinear(linear))
    return model


def prepare_products(model: nn.Module, device: torch.device, dtype: torch.dtype, compile: bool) -> str:
    """On an x86-64 CPU, pack the linear layers for oneDNN, which makes decoding 2 to 3 times faster
    in float32, unless the model is to be compiled. Returns how the matrix products run, for the
    start-up line of sample.py and serve.py."""
    if compile:
        return "nn.Linear products (torch.compile cannot trace packed layers)"
    reason = packing_unavailable(device, dtype)
    if reason is not None:
        return f"nn.Linear products ({reason})"
    pack_linears(model)
    return "linear layers packed for oneDNN"
