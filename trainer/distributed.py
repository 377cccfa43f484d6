"""Data-parallel training under torchrun: which process this is, the process group, the model
wrapped for DDP or FSDP2, and the few collectives the trainer needs.

`torchrun --nproc_per_node=N train.py ...` starts N processes and tells each one its place through
RANK, LOCAL_RANK and WORLD_SIZE in the environment (LOCAL_WORLD_SIZE: the processes on its machine;
MASTER_ADDR and MASTER_PORT: where they meet). That is torchrun's launch protocol, on one machine or
several, and the only environment the trainer reads, here alone; how to train (ddp or fsdp) is the
config's train.parallelism. A plain `python train.py` is a world of one with no process group, and
every collective here is then the identity. A launch whose variables do not fit together, or whose
processes do not all arrive, is refused in one line.
"""

import contextlib
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
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
from torch.distributed.constants import default_pg_timeout
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from errors import UserError
from trainer.runtime import resolve_device

# torchrun sets all three in every process it starts; a plain `python train.py` sees none of them
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
JOINED_KEY = "train.py/joined"  # in the store where the processes meet: how many have arrived
JOIN_POLL_SECONDS = 0.05  # how often a process that has arrived counts the others


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

    @property
    def nodes(self) -> int:
        """The machines the run spans (torchrun starts the same number of processes on each)."""
        return max(self.size // self.local_size, 1)

    @classmethod
    def from_env(cls) -> "World":
        """This process's place in the run, from torchrun's variables; a world of one without them.
        Variables that do not fit together (some missing, a rank beyond the world) are refused."""
        present = [name for name in LAUNCH_VARIABLES if name in os.environ]
        if not present:
            return cls()
        if len(present) < len(LAUNCH_VARIABLES):
            missing = [name for name in LAUNCH_VARIABLES if name not in os.environ]
            given = " and ".join(f"{name}={os.environ[name]}" for name in present)
            raise UserError(
                f"{given} {'is' if len(present) == 1 else 'are'} set but {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE in every "
                f"process it starts (start train.py with torchrun, set all three, or unset them all to train in one "
                f"process)"
            )
        size = _launch_number("WORLD_SIZE", 1)
        rank = _launch_number("RANK", 0)
        if rank >= size:
            raise UserError(f"RANK={rank} is not below WORLD_SIZE={size}: the ranks of a run are 0 .. {size - 1}")
        local_size = _launch_number("LOCAL_WORLD_SIZE", 1) if "LOCAL_WORLD_SIZE" in os.environ else 1
        if local_size > size:
            raise UserError(
                f"LOCAL_WORLD_SIZE={local_size} is above WORLD_SIZE={size}: a machine cannot run more of the run's "
                f"processes than the run has"
            )
        local_rank = _launch_number("LOCAL_RANK", 0)
        if "LOCAL_WORLD_SIZE" in os.environ and local_rank >= local_size:
            raise UserError(
                f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_size}: the local ranks on a machine "
                f"are 0 .. {local_size - 1}"
            )
        return cls(rank=rank, local_rank=local_rank, size=size, launched=True, local_size=local_size)

    def device(self, name: str) -> torch.device:
        """The device of this process: under torchrun, "auto" and "cuda" mean this process's own GPU."""
        if not self.launched:
            return resolve_device(name)
        if name in ("auto", "cuda") and torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            if self.local_rank >= gpus:
                raise UserError(
                    f"LOCAL_RANK={self.local_rank} but this machine has {gpus} CUDA GPU(s), 0 .. {gpus - 1}: each "
                    f"process takes the GPU of its LOCAL_RANK, so start at most {gpus} per machine "
                    f"(torchrun --nproc_per_node={gpus})"
                )
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

    def start(self, device: torch.device, join_timeout: float) -> None:
        """Join the process group: NCCL between GPUs, gloo between CPU processes. The processes first
        meet at MASTER_ADDR:MASTER_PORT, waiting at most join_timeout seconds for all WORLD_SIZE of them."""
        if not self.launched or dist.is_initialized():
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = self._join(join_timeout)
        if device.type == "cuda":
            dist.init_process_group("nccl", store=store, rank=self.rank, world_size=self.size, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.size)

    def _join(self, join_timeout: float) -> dist.Store:
        """The store where the processes meet (torchrun's, or rank 0's when the variables were set by
        hand), once every process has reached it. torch's own wait there is the process group's
        timeout (10 minutes with NCCL, 30 with gloo), and a process that never comes (a node that failed
        before it joined, a WORLD_SIZE larger than the processes started) would hold the others that
        long; a wait past join_timeout ends with one line instead."""
        address = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise UserError(
                    f"{name} is not set: the processes of a run meet at MASTER_ADDR:MASTER_PORT, which torchrun sets "
                    f"(started by hand, set both to an address and a free port of rank 0's machine)"
                )
        _launch_number("MASTER_PORT", 0)
        deadline = time.monotonic() + join_timeout
        try:
            store, _, _ = next(dist.rendezvous("env://", self.rank, self.size, timeout=timedelta(seconds=join_timeout)))
            joined = store.add(JOINED_KEY, 1)
            while joined < self.size and time.monotonic() < deadline:
                time.sleep(JOIN_POLL_SECONDS)
                joined = store.add(JOINED_KEY, 0)
            # a store kept from an earlier attempt of a restarted launch counts more than the world: the wait is torch's
            reason = None if joined >= self.size else f"{joined} arrived"
        except dist.DistError as e:  # the store could not be reached or made, or went away
            reason = f"torch: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        if reason is not None:
            raise UserError(
                f"the run's {self.size} processes did not all join within train.join_timeout={join_timeout:g} s (this "
                f"is rank {self.rank}, meeting at MASTER_ADDR:MASTER_PORT={address}; {reason}): check that every node "
                f"was started with the same --nnodes and --nproc_per_node, that none failed before joining (its own "
                f"output says why), and that each can reach that address (a firewall, or GLOO_SOCKET_IFNAME or "
                f"NCCL_SOCKET_IFNAME naming the wrong network interface)"
            )
        store.set_timeout(default_pg_timeout)  # from here on, torch's own timeout for the process group's use
        return store

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


def _launch_number(name: str, lowest: int) -> int:
    """A whole number from torchrun's variables, at least `lowest`."""
    text = os.environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lowest or (name == "MASTER_PORT" and value > 65535):
        accepted = "a port number, 0 .. 65535" if name == "MASTER_PORT" else f"a whole number, {lowest} or more"
        raise UserError(f"{name}={text!r} is not {accepted}: torchrun sets it for each process it starts")
    return value


def exit_process(status: int) -> NoReturn:
    """World.exit for an entry point's error path, where the World may not have been read: a process
    that torchrun started (or that has some of its variables, a launch refused before any process group)
    skips Python's teardown as World.exit does."""
    World(launched=any(name in os.environ for name in LAUNCH_VARIABLES)).exit(status)


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
