"""Choosing the device and the numeric precision, and what fits in its memory, shared by training and sampling."""

import contextlib
import os

import torch

from errors import UserError
from trainer.config import DEVICE_PATTERN, DEVICES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """The torch device for a config value: auto, cpu, cuda, cuda:N or mps, checked against this machine."""
    match = DEVICE_PATTERN.fullmatch(name)
    if match is None:
        raise UserError(f"{key}={name!r} is not one of {DEVICES}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"{key}={name!r} but this machine has no usable CUDA GPU (use auto or cpu)")
        count = torch.cuda.device_count()
        index = match.group(1)
        if index is not None and int(index) >= count:
            raise UserError(f"{key}={name!r} but this machine has {count} CUDA GPU(s) (use cuda:0 .. cuda:{count - 1})")
        return torch.device("cuda") if index is None else torch.device("cuda", int(index))
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{key}={name!r} but MPS is not available here (use auto or cpu)")
    return torch.device(name)


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


def memory_bytes(device: torch.device) -> int | None:
    """The memory a model on this device can use at most: a GPU's free memory, else the machine's
    physical memory (MPS shares it); None where the system does not say (Windows)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_in_memory(needed: int, device: torch.device, what: str, fix: str) -> None:
    """Refuse, before allocating anything, what needs more bytes than the device has: a clear
    error instead of the allocator's, or an hour of swapping."""
    available = memory_bytes(device)
    if available is not None and needed > available:
        raise UserError(
            f"{what} need at least {format_bytes(needed)}, more than the {format_bytes(available)} "
            f"{f'free on {device}' if device.type == 'cuda' else 'of memory on this machine'} ({fix})"
        )


def format_bytes(n: float) -> str:
    """1.5 GB, 12.0 TB, ... (decimal units, as disk and memory makers count)."""
    units = ("B", "kB", "MB", "GB", "TB", "PB")
    unit = 0
    while n >= 1000 and unit < len(units) - 1:
        n /= 1000
        unit += 1
    return f"{n:,.1f} {units[unit]}"


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
