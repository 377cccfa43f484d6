"""Choosing the device and the numeric precision, and what fits in its memory, shared by training and sampling."""

import contextlib
import ctypes
import math
import os
import time
from pathlib import Path

import torch

from errors import UserError
from trainer.config import DEVICE_PATTERN, DEVICES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TORCH_THREADS = torch.get_num_threads()  # torch's own default: one per physical core
IDLE_SAMPLE_SECONDS = 0.3  # how long train.threads = 0 watches the cores before choosing
FREE_CORE = 0.75  # the idle share of a core (on average over those usable) that makes it worth a thread


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


def set_threads(threads: int, key: str, processes: int = 1) -> str | None:
    """Give torch's CPU operators `threads` threads, or with 0 one per free core (auto_threads, for
    each of `processes` processes); returns what 0 chose and why (None otherwise), for a start-up line.
    key: the option or config key that asked, as the line names it."""
    if threads:
        torch.set_num_threads(threads)
        return None
    threads, why = auto_threads(processes)
    torch.set_num_threads(threads)
    return f"{threads} CPU thread(s), chosen by {key}=0 from {why}"


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep the memory of freed tensors for the next ones: by default it maps
    each tensor over a size threshold afresh and hands the top of its heap back to the system, so
    every CPU training step faults the same pages in again (a million page faults in 300 steps of
    configs/shakespeare_char_speedrun_quickstart.toml; keeping the memory took 6.6 s off its 49 s
    run, docs/benchmarks-history.md). The process then holds on to its peak memory until it exits.
    Returns False where the C library has no such mallopt (not glibc): nothing changes there."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):  # TypeError: Windows has no process-wide CDLL(None)
        return False
    trim_threshold, mmap_threshold = -1, -3  # glibc's malloc.h parameter numbers
    return bool(mallopt(mmap_threshold, 32 * 2**20)) and bool(mallopt(trim_threshold, 2**30))


def auto_threads(processes: int = 1) -> tuple[int, str]:
    """The CPU threads train.threads = 0 gives each of `processes` processes on this machine, and why.

    A torch operator splits its work among the threads and waits for the last one: when other work
    takes one of the cores, the thread there is descheduled and every operator waits for it. On a
    2-core machine kept busy by other work, one thread ran the quickstart 6.6x to 9.5x faster than
    two (docs/benchmarks.md); on an idle one, two were 1.6x faster. So: one thread per core that is
    free, counted from the cores this process may use (its CPU affinity, a container's CPU quota,
    at most torch's default of one per physical core) and how idle they were over
    IDLE_SAMPLE_SECONDS at start (a core counts once FREE_CORE of one is idle), shared out among
    the run's processes on the machine, and never fewer than one."""
    usable = usable_cores()
    idle = idle_cores()
    free = usable if idle is None else min(usable, math.floor(idle + 1 - FREE_CORE))
    threads = max(1, free // processes)
    measured = "idleness unknown" if idle is None else f"{idle:.1f} idle"
    return threads, f"{usable} usable core(s), {measured}" + (f", {processes} processes" if processes > 1 else "")


def usable_cores() -> int:
    """The cores this process may run on: its affinity (Linux), within a cgroup CPU quota, at most
    torch's default (physical cores: a second hyperthread of a core adds little to a matrix multiply)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()  # cgroup v2: "max 100000" or "200000 100000"
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no quota: not Linux, or cgroup v1
    return max(1, min(cores, TORCH_THREADS))


def idle_cores(seconds: float = IDLE_SAMPLE_SECONDS) -> float | None:
    """How many of this process's cores' worth of time went idle over `seconds` (from /proc/stat,
    per core of its affinity); elsewhere the cores less the load average; None where neither is known."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    before = _cpu_times(cpus)
    if before is None:
        try:
            return max(0.0, (os.cpu_count() or 1) - os.getloadavg()[0])
        except (AttributeError, OSError):
            return None
    time.sleep(seconds)
    after = _cpu_times(cpus) or before
    idle = 0.0
    for cpu, (idle_after, total_after) in after.items():
        idle_before, total_before = before.get(cpu, (idle_after, total_after))
        if total_after > total_before:
            idle += (idle_after - idle_before) / (total_after - total_before)
    return idle


def _cpu_times(cpus: set[int] | None) -> dict[int, tuple[int, int]] | None:
    """Each core's (idle, total) time in clock ticks from /proc/stat, for the cores in cpus; None
    where there is no /proc/stat. Idle includes iowait; the total, the first eight fields (guest time
    is already inside user)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and (cpus is None or int(name[3:]) in cpus):
            ticks = [int(field) for field in fields[:8]]
            times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return times
