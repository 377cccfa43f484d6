"""Run by tests/test_distributed.py under torchrun: one optimizer step of a tiny model with the
given parallelism, optimizer and dtype on fixed data, each process taking its own rows. Rank 0
saves the full gradients the optimizer was handed (and, with DDP, how many buffers they live in),
the full weights after the step, whether the processes' own data samplers drew different batches,
the dtype of the first layer norm's output (what the blocks compute in), and the full optimizer
state, both as gathered after the step and as gathered again after loading it back (the way a
resumed run restores it).

optimizer: a name in RECIPES, the optim keys it sets."""

import sys
from pathlib import Path

import torch

from tests.conftest import FixedBatches, capture_gradients, fixed_tokens, tiny_config
from trainer.loop import Trainer

RECIPES = {
    "adamw": {"optim__optimizer": "adamw"},
    "muon": {"optim__optimizer": "muon"},
    # NorMuon averages a wide matrix's columns over the rows that FSDP shares out among the processes;
    # cautious decay compares each shard's weights with its share of the update. A weight whose update
    # is within rounding of 0 may be decayed in one run and not the other: a small decay keeps such
    # flips inside the comparison's tolerance, while a mask laid over the wrong shard would not be
    "normuon+cautious": {
        "optim__optimizer": "muon",
        "optim__muon_normuon": True,
        "optim__cautious_weight_decay": True,
        "optim__muon_weight_decay": 0.05,
    },
}


def main(parallelism: str, data_dir: str, out_path: str, optimizer: str = "adamw", dtype: str = "float32") -> None:
    batch_size, accumulation = 2, 4  # 2 sequences per micro-batch, 4 micro-batches per step over all processes
    cfg = tiny_config(
        Path(out_path).parent / f"run-{parallelism}",
        Path(data_dir),
        data__batch_size=batch_size,
        train__gradient_accumulation_steps=accumulation,
        train__parallelism=parallelism,
        train__dtype=dtype,
        **RECIPES[optimizer],
    )
    trainer = Trainer(cfg)
    world = trainer.world
    first_batches = world.gather(trainer.batches.next_batch()[0])
    # the 8 rows of one optimizer step; each process takes the micro-batches of its rank
    x, y = fixed_tokens(batch_size * accumulation, cfg.model.block_size, trainer.cfg.model.vocab_size)
    rows = slice(world.rank * len(x) // world.size, (world.rank + 1) * len(x) // world.size)
    trainer.batches = FixedBatches(x[rows], y[rows], batch_size)
    gradients = capture_gradients(trainer)
    buffers = []  # with DDP: how many buffers the gradients the optimizer is handed live in
    if parallelism == "ddp":
        step = trainer.optimizer.step
        trainer.optimizer.step = lambda: buffers.append(gradient_buffers(trainer.model)) or step()
    norm_dtypes = []
    trainer.model.transformer.h[0].ln_1.register_forward_hook(lambda *args: norm_dtypes.append(str(args[2].dtype)))
    trainer.train_step(lr=1e-3)
    model_state, optimizer_state = trainer.parallel.state_dicts(trainer.optimizer)  # FSDP gathers: all call it
    # as a resumed run, every process loads the whole state that rank 0 gathered
    saved_model, saved_optimizer = world.gather((model_state, optimizer_state))[0]
    trainer.parallel.load_state_dicts(trainer.optimizer, saved_model, saved_optimizer)
    _, reloaded_state = trainer.parallel.state_dicts(trainer.optimizer)
    if world.is_main:
        torch.save(
            {
                "model": model_state,
                "gradients": gradients,
                "world_size": world.size,
                "ranks_drew_different_batches": not torch.equal(first_batches[0], first_batches[1]),
                "norm_output_dtypes": norm_dtypes,
                "gradient_buffers": buffers,
                "gradients_count": len(gradients),
                "optimizer": optimizer_state["state"],
                "reloaded_optimizer": reloaded_state["state"],
            },
            out_path,
        )
    world.stop()
    world.exit(0)


def gradient_buffers(model: torch.nn.Module) -> int:
    """The number of distinct storages that the parameters' gradients are views of."""
    return len({param.grad.untyped_storage().data_ptr() for param in model.parameters() if param.grad is not None})


if __name__ == "__main__":
    main(*sys.argv[1:])
