"""AdamW with weight decay on matrices only, and the learning-rate schedule."""

import math

import torch
import torch.nn as nn

from trainer.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on 2-D+ parameters (Linear weights, embeddings); none on biases and LayerNorm
    gains, which only shift or scale and gain nothing from being pulled toward zero."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        fused=device.type == "cuda",  # one kernel for the whole update instead of several per tensor
    )


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warmup over warmup_iters steps, cosine decay to min_lr at lr_decay_iters, then min_lr.

    A pure function of the step rather than a torch scheduler object: nothing to save in a
    checkpoint, and a resumed run gets exactly the same rates."""
    if step < cfg.warmup_iters:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)  # 0 -> 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 -> 0
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)
