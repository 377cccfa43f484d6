"""Run by tests/test_rl.py under torchrun: one [rl] step of the tiny chat model under DDP or FSDP2 on the fixed
answers of test_rl.fixed_sampled, each process training its own share of the questions (rank 0 the
first, rank 1 the other two), one micro-batch each. Rank 0 saves the step's loss, its number of answer
tokens over both processes, the gradients the optimizer was handed, the held-out figures of the
starting model, each process having answered its share of the held-out questions, and how many
questions each process asked for them."""

import sys
from pathlib import Path

import torch

from data.conversations import end_of_turn
from rl.policy_gradient import HeldOut
from tests.conftest import capture_gradients
from tests.test_rl import fixed_sampled, held_out, rl_config
from trainer.loop import Trainer


def main(root: str, out_path: str, parallelism: str, heldout: str) -> None:
    options = dict(rl__questions=2, train__gradient_accumulation_steps=2, train__parallelism=parallelism)
    cfg = rl_config(Path(out_path).parent / "run-ddp", Path(root), **options, **held_out(Path(heldout)))
    trainer = Trainer(cfg)
    world = trainer.world
    (questions,) = [tasks for tasks in trainer.tasks if isinstance(tasks, HeldOut)]
    ask, asked = questions.questions.ask, []
    questions.questions.ask = lambda model, tokenizer, picked, *args: (
        asked.append(len(picked)) or ask(model, tokenizer, picked, *args)
    )
    held_out_figures, _ = questions.score(trainer.model, None)
    asked_by_each = world.sum(torch.tensor([float(asked[0] * (rank == world.rank)) for rank in range(2)]))
    rows = slice(0, 1) if world.rank == 0 else slice(1, 3)
    sampled = fixed_sampled(trainer.tokenizer.vocab_size, end_of_turn(trainer.tokenizer)[0], rows)
    trainer.objective._sample = lambda step, stop: sampled
    gradients = capture_gradients(trainer)
    loss = world.mean(trainer.train_step(lr=0.0))
    if world.is_main:
        saved = {"loss": loss, "trained_tokens": int(trainer.trained_tokens), "gradients": gradients}
        torch.save(saved | {"held_out": held_out_figures, "held_out_asked": asked_by_each.int().tolist()}, out_path)
    world.stop()
    world.exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
