"""Data-parallel training under torchrun: which process this is, the process group, the model
wrapped for DDP or FSDP2, and the few collectives the trainer needs.

`torchrun --nproc_per_node=N train.py ...` starts N processes and tells each one its place through
RANK, LOCAL_RANK and WORLD_SIZE in the environment. That is torchrun's launch protocol and the only
environment the trainer reads; how to train (ddp or fsdp) is the config's train.parallelism. A plain
`python train.py` is a world of one with no process group, and every collective here is then the
identity.
"""

import contextlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from errors import UserError
from trainer.runtime import resolve_device


@dataclass(frozen=True)
class World:
    rank: int = 0  # this process among all processes
    local_rank: int = 0  # this process among those on its machine: its GPU index
    size: int = 1  # processes in the run
    launched: bool = False  # started by torchrun (then there is a process group, even for one process)
    local_size: int = 1  # processes of the run on this machine, which share its cores

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, writes files and talks to wandb."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "World":
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return cls()
        return cls(
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            size=int(os.environ["WORLD_SIZE"]),
            launched=True,
            local_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        )

    def device(self, name: str) -> torch.device:
        """The device of this process: under torchrun, "auto" and "cuda" mean this process's own GPU."""
        if not self.launched:
            return resolve_device(name)
        if name in ("auto", "cuda") and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        if name in ("auto", "cpu"):
            return torch.device("cpu")
        if name.startswith("cuda:") and self.size > 1:
            raise UserError(
                f"train.device={name!r} names one GPU, but torchrun started {self.size} processes "
                f"(use auto or cuda: each process takes the GPU of its LOCAL_RANK)"
            )
        device = resolve_device(name)
        if device.type == "mps":
            raise UserError("train.device='mps' cannot train under torchrun (no process-group backend for MPS)")
        return device

    def start(self, device: torch.device) -> None:
        """Join the process group: NCCL between GPUs, gloo between CPU processes."""
        if not self.launched or dist.is_initialized():
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")

    def stop(self) -> None:
        if self.launched and dist.is_initialized():
            dist.destroy_process_group()

    def exit(self, status: int) -> NoReturn:
        """End the process with this exit status once its work is done and its files are closed;
        call it while the model is still referenced.

        A torchrun process skips Python's own teardown, where gloo's worker threads break it in two
        ways. Such a thread may still be releasing the tensors of a finished collective, which needs
        the interpreter lock. (1) Freeing the last reference to a DDP model destroys the process group,
        which joins those threads while holding that lock: the process hangs. (2) With FSDP the
        process group outlives destroy_process_group, and a thread that wants the lock while the
        interpreter shuts down aborts the process ("terminate called without an active exception").
        Either happens after all the work is done, and torchrun reports it as a failure.
        """
        if not self.launched:
            sys.exit(status)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)

    def barrier(self) -> None:
        if self.launched:
            dist.barrier()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a tensor over all processes (a copy; the input is left alone)."""
        return self.sum(value) / self.size

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of a tensor over all processes (a copy; the input is left alone)."""
        if not self.launched:
            return value
        total = value.detach().clone()
        dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        return total

    def max(self, values: list[float], device: torch.device) -> list[float]:
        """The elementwise maximum of a few numbers over all processes: one all-reduce, and on CUDA a
        host sync to read it."""
        if not self.launched:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def gather(self, obj: object) -> list:
        """One picklable object from each process, in rank order, on every process."""
        if not self.launched:
            return [obj]
        gathered = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered


def fsdp_mixed_precision(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """In bfloat16, FSDP gathers the weights and computes in bfloat16 (half the traffic of float32)
    and reduces the gradients in float32; otherwise weights and gradients stay in their own dtype."""
    if dtype == torch.bfloat16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


# full, unsharded tensors on the CPU: the same checkpoint whatever the run's parallelism
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class ParallelModel:
    """The model as the training step sees it: as is in one process, wrapped in DDP or sharded
    with FSDP2 under torchrun. Checkpoints always hold the full, unwrapped state."""

    def __init__(self, model: nn.Module, parallelism: str, world: World, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.mode = parallelism if world.launched else "single"
        if self.mode == "ddp":
            # the gradients are views of DDP's all-reduce buckets: no second copy of them, and no copying
            # back and forth around each all-reduce
            device_ids = [device.index] if device.type == "cuda" else None
            self.module = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        elif self.mode == "fsdp":
            # Each block is its own unit (gathered just before it runs, freed after); the root unit
            # holds the embeddings, the tied head and the final norm.
            policy = fsdp_mixed_precision(dtype)
            for block in model.transformer.h:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            self.module = model
        else:
            self.module = model

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Gradients are averaged across processes only when enabled: on the last micro-batch of an
        optimizer step, so accumulation costs one all-reduce per step, not one per micro-batch."""
        if self.mode == "ddp" and not enabled:
            return self.module.no_sync()
        if self.mode == "fsdp":
            self.module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def state_dicts(self, optimizers: Iterable[torch.optim.Optimizer]) -> tuple[dict, dict]:
        """Full model and optimizer state on the CPU, keyed by parameter name (the states of
        several optimizers merge into one dict, as each owns its own parameters). With FSDP this
        gathers the shards, so every process must call it."""
        model_state = get_model_state_dict(self.model, options=FULL_STATE)
        optimizer_state = get_optimizer_state_dict(self.model, tuple(optimizers), options=FULL_STATE)
        return model_state, optimizer_state

    def load_state_dicts(
        self, optimizers: Iterable[torch.optim.Optimizer], model_state: dict, optimizer_state: dict
    ) -> None:
        # not strict: a LoRA checkpoint holds the adapters only (the names were checked against the model's)
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(self.model, tuple(optimizers), optimizer_state, options=options)
