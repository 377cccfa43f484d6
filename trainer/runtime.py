"""Choosing the device and the numeric precision, shared by training and sampling."""

import contextlib

import torch

from errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """The torch device for a config value: auto, cpu, cuda, cuda:N or mps."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{key}={name!r} but this machine has no usable CUDA GPU (use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(
                f"{key}={name!r} but this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                f"(use cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{key}={name!r} but MPS is not available here (use auto or cpu)")
    return device


def resolve_dtype(name: str, device: torch.device, key: str = "train.dtype") -> torch.dtype:
    """The compute dtype: auto is bfloat16 on CUDA GPUs of compute capability 8.0 or newer,
    float16 on older ones, float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            # native bfloat16 arrived with Ampere (compute capability 8.0); older GPUs only emulate it
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
        return torch.float32
    if name == "float16" and device.type != "cuda":
        raise UserError(f"{key}='float16' needs a CUDA device, not {device.type} (use bfloat16 or float32)")
    return DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; float32 runs as is."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def enable_tf32() -> None:
    """Let float32 matrix multiplies use TF32 tensor cores on Ampere and newer GPUs (10-bit mantissa
    inputs, float32 accumulation): much faster, and what mixed-precision training tolerates anyway."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
