"""The optimizers (AdamW alone, or Muon for the blocks' weight matrices with AdamW for the rest); the
rate they step at is optim/lr_schedule.py's."""

from collections.abc import Iterator

import torch
import torch.nn as nn

from optim.muon import Muon, decay_cautiously_
from trainer.config import OptimConfig


class Optimizers:
    """The run's torch optimizers, stepped together; each owns its own parameters.

    Each optimizer follows the one schedule, scaled to its own peak rate: its rate is
    lr_scale * lr_at(step), where lr_scale is its peak over optim.learning_rate. The scales live
    here, not in the param groups, so a resumed run takes them from its config, not from the
    checkpoint. Duck-types the parts of torch.optim.Optimizer that GradScaler uses (param_groups,
    step); torch.distributed.checkpoint takes the optimizers themselves (`optimizers`)."""

    def __init__(self, parts: list[tuple[torch.optim.Optimizer, float]]):
        self.parts = parts  # (optimizer, lr_scale)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [optimizer for optimizer, _ in self.parts]

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def set_lr(self, lr: float) -> None:
        for optimizer, lr_scale in self.parts:
            for group in optimizer.param_groups:
                group["lr"] = lr * lr_scale

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> Optimizers:
    """optim.optimizer="adamw": AdamW for every parameter. "muon": Muon for the 2-D weight matrices
    inside the transformer blocks (model.transformer.h), AdamW for the rest (embeddings, output
    head, norms, biases): Muon orthogonalises an update as a whole matrix, which suits the hidden
    linear maps but not a lookup table or a vector.

    AdamW puts weight decay on 2-D+ parameters (Linear weights, embeddings) only: biases and norm
    gains only shift or scale and gain nothing from being pulled toward zero. With
    optim.cautious_weight_decay, both optimizers decay a weight only where its update has its sign
    (`decay_cautiously_`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    parts = []
    if cfg.optimizer == "muon":
        hidden = {id(p) for p in model.transformer.h.parameters() if p.dim() == 2}
        matrices = [p for p in params if id(p) in hidden]
        params = [p for p in params if id(p) not in hidden]
        muon = Muon(
            matrices,
            # torch's Muon iterates in bfloat16, which most CPUs multiply far slower than float32
            ns_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
            lr=cfg.muon_lr,
            weight_decay=cfg.muon_weight_decay,
            momentum=cfg.muon_momentum,
            ns_steps=cfg.muon_ns_steps,
            ns_smallest=cfg.muon_ns_smallest,
            normuon_beta2=cfg.muon_beta2 if cfg.muon_normuon else None,
            cautious=cfg.cautious_weight_decay,
        )
        parts.append((muon, cfg.muon_lr / cfg.learning_rate))
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    adamw = (CautiousAdamW if cfg.cautious_weight_decay else torch.optim.AdamW)(
        groups,
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        # one kernel for the whole update instead of several per tensor (on a CPU, 3-4x faster
        # for the quickstart's 27 small tensors: docs/benchmarks-history.md)
        fused=device.type in ("cuda", "cpu"),
    )
    parts.append((adamw, 1.0))
    return Optimizers(parts)


class CautiousAdamW(torch.optim.AdamW):
    """AdamW with cautious weight decay (`decay_cautiously_`): each group's weight_decay is applied
    here, where the update has the weight's sign, and torch's (fused) step runs with none. Decay
    comes first, as in torch's AdamW, whose update does not read the weight.

    AdamW's update is its new first moment divided by a positive denominator, so it has that
    moment's sign: exp_avg moved towards the gradient by 1 - beta1 (the gradient's own sign at the
    first step, where exp_avg starts from 0). The mask is known before the step, and the param
    groups keep their weight_decay, so a checkpoint reads like plain AdamW's."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "the trainer computes its gradients before stepping"
        decays = [group["weight_decay"] for group in self.param_groups]
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["weight_decay"] or not params:
                continue
            beta1 = group["betas"][0]
            moments = []
            for p in params:
                state = self.state.get(p, {})
                moments.append(state["exp_avg"].lerp(p.grad, 1 - beta1) if "exp_avg" in state else p.grad)
            decay_cautiously_(params, moments, group["lr"] * group["weight_decay"])
            group["weight_decay"] = 0.0
        super().step()
        for group, decay in zip(self.param_groups, decays, strict=True):
            group["weight_decay"] = decay
