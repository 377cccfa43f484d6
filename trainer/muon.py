"""Muon: torch.optim.Muon's update, with the Newton-Schulz orthogonalisation run in a dtype of our
choosing and over every matrix of one shape at once.

torch.optim.Muon always orthogonalises in bfloat16, one matrix at a time. That is the right call on
a GPU, but most CPUs have no fast bfloat16 matrix product: on the quickstart's 2-core CPU a
bfloat16 iteration took 25x as long as the same products in float32 (docs/benchmarks.md), which
made a Muon step 12x slower than an AdamW one. So this class keeps torch's algorithm, defaults,
hyperparameter checks and state layout (a "momentum_buffer" per matrix, so checkpoints read the
same), and only changes how the orthogonalisation is computed:

- in `ns_dtype` (the trainer passes bfloat16 on CUDA, float32 elsewhere);
- batched: the matrices of one shape are stacked and iterated together, one batched product per
  term instead of one small product per matrix;
- in float32, for a long matrix (one side over 1.5x the other, not sharded), on its small Gram
  matrix: the same iterates with fewer multiply-adds (25% to 44% fewer for the quickstart's long
  matrices).

A step of torch's Muon, per matrix W with gradient G and momentum buffer B:
    B <- momentum * B + (1 - momentum) * G
    U <- (1 - momentum) * G + momentum * B  (Nesterov; B alone without)
    O <- Newton-Schulz(U): U with its singular values pushed towards 1
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O
"""

import math
from collections import defaultdict

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def orthogonalise(updates: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon, over a batch of matrices
    (n, rows, cols), in updates' dtype: X <- a X + (b A + c A^2) X with A = X X^T, starting from
    each matrix divided by its Frobenius norm (so every singular value is at most 1).

    In float32 or wider, a matrix much wider than tall (or taller than wide) takes the Gram form of
    the same iteration, which gives the same iterates with fewer multiply-adds (`_gram_form`). The
    direct form stays for bfloat16, where the Gram matrix's rounding would show, and for FSDP2's
    sharded matrices (DTensor), whose sharding rules it is tested with."""
    x = updates / updates.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    small, large = sorted(x.shape[-2:])
    # multiply-adds over small^2: per step X X^T, A^2 and (..) X for the direct form; two long
    # products and 4 * steps - 3 small cubes for the Gram form
    cheaper = 2 * large + (4 * steps - 3) * small < steps * (2 * large + small)
    if cheaper and x.dtype.itemsize >= 4 and not isinstance(x, DTensor):
        return _gram_form(x, coefficients, steps)
    return _direct_form(x, coefficients, steps)


def _direct_form(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """torch's iteration, on the wide orientation (rows <= cols), where X X^T is the smaller product."""
    a, b, c = coefficients
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _gram_form(x: Tensor, coefficients: tuple[float, float, float], steps: int) -> Tensor:
    """Newton-Schulz on the Gram matrix. For a wide X (rows < cols), a step is X <- p(A) X with
    p(A) = a I + b A + c A^2 and A = X X^T. So X_k = P X_0 where P is the product of the steps' p's,
    and the next A is p A p (p is symmetric: a polynomial of a symmetric matrix). Only A, p and P,
    all rows x rows, are iterated; X_0 is multiplied once at the end. A tall X is the mirror image
    (A = X^T X, X_k = X_0 P)."""
    a, b, c = coefficients
    wide = x.size(-2) <= x.size(-1)
    gram = x @ x.mT if wide else x.mT @ x
    product = None
    for step in range(steps):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        if product is None:
            product = poly
        else:
            product = poly @ product if wide else product @ poly
        if step + 1 < steps:
            gram = poly @ gram @ poly
    return product @ x if wide else x @ product


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisation runs in ns_dtype, batched over same-shaped matrices
    (see the module's docstring). Only adjust_lr_fn=None ("original" scaling) is supported."""

    def __init__(self, params, *, ns_dtype: torch.dtype = torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        if any(group["adjust_lr_fn"] not in (None, "original") for group in self.param_groups):
            raise ValueError("this Muon scales the rate the original way only (adjust_lr_fn=None)")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape = defaultdict(list)
            for param in group["params"]:
                if param.grad is not None:
                    by_shape[param.shape].append(param)
            for shape, params in by_shape.items():
                self._step_same_shape(group, shape, params)
        return loss

    def _step_same_shape(self, group: dict, shape: torch.Size, params: list[Tensor]) -> None:
        momentum, lr = group["momentum"], group["lr"]
        grads = [param.grad for param in params]
        buffers = []
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
        stacked = torch.stack(updates).to(self.ns_dtype)
        orthogonal = orthogonalise(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        scaled_lr = lr * math.sqrt(max(1, shape[0] / shape[1]))
        torch._foreach_add_(params, list(orthogonal.to(params[0].dtype).unbind(0)), alpha=-scaled_lr)
