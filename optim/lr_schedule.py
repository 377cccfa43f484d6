"""The learning-rate schedule: a linear warmup from 0, then a cosine decay to optim.min_lr at
optim.lr_decay_iters, or warmup-stable-decay (the peak rate, then a straight line down over the last
optim.cooldown_frac of the steps). A pure function of the step, so a resumed run follows it exactly."""

import math

from trainer.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warmup over warmup_iters steps, then optim.schedule's decay to min_lr at
    lr_decay_iters, then min_lr.

    A pure function of the step rather than a torch scheduler object: nothing to save in a
    checkpoint, and a resumed run gets exactly the same rates."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    coeff = DECAYS[cfg.schedule](step, cfg)  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


def _cosine(step: int, cfg: OptimConfig) -> float:
    """Half a cosine from the end of warmup to lr_decay_iters."""
    progress = (step - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)  # 0 -> 1
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _warmup_stable_decay(step: int, cfg: OptimConfig) -> float:
    """The peak rate until the last cooldown_frac of lr_decay_iters, then a straight line down."""
    decay_start = cfg.wsd_decay_start
    if step < decay_start:
        return 1.0
    return 1.0 - (step - decay_start) / (cfg.lr_decay_iters - decay_start)


DECAYS = {"cosine": _cosine, "wsd": _warmup_stable_decay}  # keys: the values of optim.schedule
