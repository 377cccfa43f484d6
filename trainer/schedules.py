"""Sequence-length and batch-size schedules: the shape of each step's micro-batches, and the factor
on the learning rate that goes with its batch size.

modded-nanogpt's speedrun trains on shorter sequences and smaller batches early in the run, when
the model learns common patterns that a small batch already shows clearly, and grows both later:
its batch of 8 (x 2048 x 8 tokens) becomes 16, then 24, with the learning rate multiplied by
(16/8)^0.6 and (24/8)^0.6 (record 46, "batch size schedule"), and its training rows grow from 896
to 2048 tokens. Here:

    train.block_size_schedule = "32:0.3"   # rows of 32 tokens for the first 30% of steps, then model.block_size
    train.batch_size_schedule = "8:0.5"    # 8 sequences per micro-batch for half the run, then data.batch_size

and a step of b sequences runs at (b / data.batch_size) ** train.batch_size_lr_power times the
learning-rate schedule's rate: optim.learning_rate is the rate tuned for data.batch_size, the size
the run ends at. Every function here is a pure function of the step and the config, like lr_at: a
resumed run draws the same shapes, and so the same batches, as an unbroken one. Evaluation always
reads rows of the full model.block_size.
"""

import math
from fractions import Fraction
from itertools import pairwise

from trainer.config import Config


def stage_ends(stages: list[tuple[int, float]], max_iters: int) -> list[int]:
    """The first step after each stage: stage i holds the steps below until_i * max_iters, the
    fraction taken as written (0.28 of 25 steps is 7, where the float product is 7.000000000000001)."""
    return [math.ceil(Fraction(repr(until)) * max_iters) for _, until in stages]


def size_at(step: int, stages: list[tuple[int, float]], final: int, max_iters: int) -> int:
    """The size a schedule gives the step: its stage's, or final after the last stage."""
    for (size, _), end in zip(stages, stage_ends(stages, max_iters), strict=True):
        if step < end:
            return size
    return final


def batch_shape_at(step: int, cfg: Config) -> tuple[int, int]:
    """(sequences per micro-batch, tokens per sequence) of the step's training micro-batches."""
    train = cfg.train
    return (
        size_at(step, train.batch_size_stages, cfg.data.batch_size, train.max_iters),
        size_at(step, train.block_size_stages, cfg.model.block_size, train.max_iters),
    )


def lr_factor_at(step: int, cfg: Config) -> float:
    """What the step's learning rate is multiplied by for its batch size: 1 at data.batch_size."""
    batch_size, _ = batch_shape_at(step, cfg)
    return (batch_size / cfg.data.batch_size) ** cfg.train.batch_size_lr_power


def tokens_per_step_at(step: int, cfg: Config) -> int:
    """The tokens of the step's global batch: every micro-batch of every process."""
    batch_size, block_size = batch_shape_at(step, cfg)
    return batch_size * block_size * cfg.train.gradient_accumulation_steps


def tokens_before(step: int, cfg: Config) -> int:
    """The tokens the run's steps 0 .. step - 1 trained on, over all processes."""
    train = cfg.train
    ends = stage_ends(train.block_size_stages, train.max_iters) + stage_ends(train.batch_size_stages, train.max_iters)
    edges = sorted({0, step, *(end for end in ends if end < step)})
    return sum((end - start) * tokens_per_step_at(start, cfg) for start, end in pairwise(edges))


def describe(cfg: Config) -> str | None:
    """One line of the shapes the run trains at, step range by step range; None without a schedule."""
    train = cfg.train
    if not train.block_size_stages and not train.batch_size_stages:
        return None
    ends = stage_ends(train.block_size_stages, train.max_iters) + stage_ends(train.batch_size_stages, train.max_iters)
    edges = sorted({0, train.max_iters, *(end for end in ends if end < train.max_iters)})
    parts = []
    for start, end in pairwise(edges):
        batch_size, block_size = batch_shape_at(start, cfg)
        lr = f" at {lr_factor_at(start, cfg):.3g}x the LR" if train.batch_size_stages else ""
        parts.append(f"steps {start:,}-{end - 1:,}: {batch_size} x {block_size} tokens{lr}")
    return "micro-batches by schedule: " + "; ".join(parts)
