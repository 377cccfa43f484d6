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
  matrices);
- optionally with coefficients of its own for each iteration (`fitted_coefficients`), where torch
  uses one quintic for every iteration.

Two further rules, each off unless asked for (`normuon_beta2`, `cautious`), change the step itself;
see `_normalise_neurons` and `decay_cautiously_`.

A step of torch's Muon, per matrix W with gradient G and momentum buffer B:
    B <- momentum * B + (1 - momentum) * G
    U <- (1 - momentum) * G + momentum * B  (Nesterov; B alone without)
    O <- Newton-Schulz(U): U with its singular values pushed towards 1
    W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O
"""

import functools
import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

Quintic = tuple[float, float, float]
_GRAM_STEPS = 5  # iterations the Gram form runs before it starts again from X itself (see _gram_form)


def orthogonalise(updates: Tensor, coefficients: Sequence[Quintic], eps: float) -> Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon, over a batch of matrices
    (n, rows, cols), in updates' dtype: X <- a X + (b A + c A^2) X with A = X X^T, starting from
    each matrix divided by its Frobenius norm (so every singular value is at most 1). One iteration
    per (a, b, c) in coefficients.

    In float32 or wider, a matrix much wider than tall (or taller than wide) takes the Gram form of
    the same iteration, which gives the same iterates with fewer multiply-adds (`_gram_form`). The
    direct form stays for bfloat16, where the Gram matrix's rounding would show, and for FSDP2's
    sharded matrices (DTensor), whose sharding rules it is tested with."""
    x = updates / updates.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    if x.dtype.itemsize < 4 or isinstance(x, DTensor):
        return _direct_form(x, coefficients)
    small, large = sorted(x.shape[-2:])
    for start in range(0, len(coefficients), _GRAM_STEPS):  # the Gram form restarts from X (see _gram_form)
        run = coefficients[start : start + _GRAM_STEPS]
        # multiply-adds over small^2: per step X X^T, A^2 and (..) X for the direct form; two long
        # products and 4 * steps - 3 small cubes for the Gram form
        cheaper = 2 * large + (4 * len(run) - 3) * small < len(run) * (2 * large + small)
        x = _gram_form(x, run) if cheaper else _direct_form(x, run)
    return x


def _direct_form(x: Tensor, coefficients: Sequence[Quintic]) -> Tensor:
    """torch's iteration, on the wide orientation (rows <= cols), where X X^T is the smaller product."""
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for a, b, c in coefficients:
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _gram_form(x: Tensor, coefficients: Sequence[Quintic]) -> Tensor:
    """Newton-Schulz on the Gram matrix. For a wide X (rows < cols), a step is X <- p(A) X with
    p(A) = a I + b A + c A^2 and A = X X^T. So X_k = P X_0 where P is the product of the steps' p's,
    and the next A is p A p (p is symmetric: a polynomial of a symmetric matrix). Only A, p and P,
    all rows x rows, are iterated; X_0 is multiplied once at the end. A tall X is the mirror image
    (A = X^T X, X_k = X_0 P).

    The Gram form must not run long: `orthogonalise` starts it again from X_k (a fresh X X^T) every
    _GRAM_STEPS iterations. An eigenvalue s^2 of A goes to s^2 p(s^2)^2 in a step, the square of what
    happens to the singular value s, and stays as bounded; but rounding leaves A's zero eigenvalues
    (a gradient of lower rank than its small side, as of a batch of few tokens) at about -1e-7 |A| in
    float32, and a negative eigenvalue grows by a^2 or more each step, without bound: 12 a step for
    torch's quintic (a = 3.4445), 71 for the first fitted one. With torch's quintic A overflowed to
    NaN from the 12th step; within 5 steps such an error stays under 0.05 |A| (at most four updates
    of A, times at most 71 * 18^3), and a fresh X X^T has no negative eigenvalue to start from."""
    wide = x.size(-2) <= x.size(-1)
    gram = x @ x.mT if wide else x.mT @ x
    product = None
    for step, (a, b, c) in enumerate(coefficients):
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        if product is None:
            product = poly
        else:
            product = poly @ product if wide else product @ poly
        if step + 1 < len(coefficients):
            gram = poly @ gram @ poly
    return product @ x if wide else x @ product


_HEADROOM = 1.01  # fitted_coefficients: every iteration but the last evaluates its quintic at x / 1.01


@functools.cache
def fitted_coefficients(smallest: float, steps: int) -> tuple[Quintic, ...]:
    """Coefficients for `steps` iterations, each fitted to the singular values it receives, where torch
    uses one quintic throughout. After the Frobenius normalisation the singular values lie in (0, 1];
    the fit aims at those in [smallest, 1]. The first iteration's quintic is the odd quintic closest to
    1 over [smallest, 1] in the worst case (the minimax fit); it maps that interval into
    [1 - e, 1 + e], roughly the interval the second iteration's quintic is fitted over, and so on:
    the greedy construction of the "Polar Express" method (Amsel et al., 2025). Early iterations,
    fitted over a wide interval, lift small singular values far faster than torch's quintic (slope
    about 8 at 0, against 3.4), at the price of a looser band after few iterations: for
    smallest = 0.001 (the quickstart's), three iterations take [0.001, 1] into [0.14, 1.86], where
    torch's three take it to [0.04, 1.2].

    As in that method, every iteration but the last evaluates its quintic at x / 1.01. A fitted
    quintic climbs steeply just past its interval's top (the first one's slope there is 26), so a
    singular value that rounding pushed past it would grow from one iteration to the next; the 1%
    of headroom keeps bfloat16's rounding inside the fitted intervals."""
    low, high = smallest, 1.0
    fitted = []
    for step in range(steps):
        if high - low < 1e-2:  # as good as converged: the fits' limit, p(1) = 1 and p'(1) = p''(1) = 0
            fitted.append((15 / 8, -10 / 8, 3 / 8))
            continue
        (a, b, c), error = _closest_quintic(low, high)
        if step + 1 < steps:
            a, b, c = a / _HEADROOM, b / _HEADROOM**3, c / _HEADROOM**5
        fitted.append((a, b, c))
        # p rises through its lowest value at `low` (there 1 - e, less after the headroom) and peaks
        # at 1 + e
        low, high = a * low + b * low**3 + c * low**5, 1 + error
    return tuple(fitted)


def _closest_quintic(low: float, high: float) -> tuple[Quintic, float]:
    """The odd quintic p(x) = a x + b x^3 + c x^5 with the least max |1 - p(x)| over [low, high], and
    that max, by Remez exchange: the best p makes 1 - p reach +e and -e alternately at four points,
    the interval's ends and p's two turning points inside it."""
    points = low + (high - low) * np.array([0.0, 0.25, 0.75, 1.0])
    signs = np.array([1.0, -1.0, 1.0, -1.0])
    for _ in range(100):
        a, b, c, error = np.linalg.solve(np.column_stack([points, points**3, points**5, signs]), np.ones(4))
        # p'(x) = a + 3b x^2 + 5c x^4: its zeros are a quadratic's in x^2
        turns = np.sqrt(np.clip(np.sort(np.roots([5 * c, 3 * b, a]).real), low**2, high**2))
        exchanged = np.array([low, *turns, high])
        if np.allclose(exchanged, points, rtol=0, atol=1e-7 * (high - low)):
            return (float(a), float(b), float(c)), float(abs(error))
        points = exchanged
    raise ArithmeticError(f"the minimax quintic over [{low}, {high}] did not converge")


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisation runs in ns_dtype, batched over same-shaped matrices
    (see the module's docstring). ns_smallest: 0 for torch's ns_coefficients at every iteration, or
    the smallest singular value that `fitted_coefficients` fits each iteration's coefficients to.
    normuon_beta2: None, or NorMuon's decay rate of the running mean of squares per neuron
    (`_normalise_neurons`). cautious: decay a weight only where the update has its sign
    (`decay_cautiously_`). Only adjust_lr_fn=None ("original" scaling) is supported."""

    def __init__(
        self,
        params,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        ns_smallest: float = 0.0,
        normuon_beta2: float | None = None,
        cautious: bool = False,
        **kwargs,
    ):
        super().__init__(params, **kwargs)
        if any(group["adjust_lr_fn"] not in (None, "original") for group in self.param_groups):
            raise ValueError("this Muon scales the rate the original way only (adjust_lr_fn=None)")
        if not 0 <= ns_smallest < 1:
            raise ValueError(f"ns_smallest={ns_smallest} must be 0 (torch's coefficients) or between 0 and 1")
        if normuon_beta2 is not None and not 0 <= normuon_beta2 < 1:
            raise ValueError(f"normuon_beta2={normuon_beta2} must be in [0, 1)")
        self.ns_dtype = ns_dtype
        self.ns_smallest = ns_smallest
        self.normuon_beta2 = normuon_beta2
        self.cautious = cautious

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
            if self.ns_smallest:
                coefficients = fitted_coefficients(self.ns_smallest, group["ns_steps"])
            else:
                coefficients = (group["ns_coefficients"],) * group["ns_steps"]
            for shape, params in by_shape.items():
                self._step_same_shape(group, shape, params, coefficients)
        return loss

    def _step_same_shape(
        self, group: dict, shape: torch.Size, params: list[Tensor], coefficients: Sequence[Quintic]
    ) -> None:
        momentum, lr = group["momentum"], group["lr"]
        grads = [param.grad for param in params]
        buffers = []
        for param in params:
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])
        torch._foreach_lerp_(buffers, grads, 1 - momentum)
        # one lerp per tensor, as torch.optim.Muon does: torch 2.11 has no rule for the out-of-place
        # _foreach_lerp on FSDP's sharded tensors (DTensor), only for the in-place one above
        updates = [g.lerp(b, momentum) for g, b in zip(grads, buffers, strict=True)] if group["nesterov"] else buffers
        stacked = torch.stack(updates).to(self.ns_dtype)
        orthogonal = orthogonalise(stacked, coefficients, group["eps"]).to(params[0].dtype)
        if self.normuon_beta2 is not None:
            orthogonal = self._normalise_neurons(params, orthogonal)
        steps = list(orthogonal.unbind(0))
        if group["weight_decay"] and self.cautious:
            decay_cautiously_(params, steps, lr * group["weight_decay"])
        elif group["weight_decay"]:
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        scaled_lr = lr * math.sqrt(max(1, shape[0] / shape[1]))
        torch._foreach_add_(params, steps, alpha=-scaled_lr)

    def _normalise_neurons(self, params: list[Tensor], orthogonal: Tensor) -> Tensor:
        """NorMuon (Li et al., 2025, "NorMuon: Making Muon more efficient and scalable"): each neuron's
        slice of the orthogonalised updates (n, rows, cols) divided by the root of a running mean
        (decay rate normuon_beta2) of its mean square, then every matrix rescaled to the Frobenius
        norm it had, so the learning rate keeps its meaning and only the shares between neurons move.

        The neurons lie along the long side: one statistic per row of a tall or square matrix, per
        column of a wide one, each averaging over the short side. Along the short side an
        orthogonalised matrix's vectors all have length about 1 (U V^T has orthonormal rows when
        wide, columns when tall), so there is nothing to even out; the other way their lengths differ.
        (In the MLP these are its hidden units: the rows of c_fc, the columns of c_proj.) The
        running mean needs no bias correction: every entry of a matrix carries the same factor
        1 - beta2^t, which the rescaling cancels. A wide matrix sharded by rows (FSDP2) averages its
        columns across the shards: the DTensor's mean reduces over all of them."""
        across = -1 if orthogonal.size(-2) >= orthogonal.size(-1) else -2  # the short side
        mean_squares = orthogonal.square().mean(dim=across, keepdim=True)  # (n, rows, 1) or (n, 1, cols)
        moments = []
        for param, mean_square in zip(params, mean_squares.unbind(0), strict=True):
            state = self.state[param]
            if "neuron_second_moment" not in state:
                state["neuron_second_moment"] = torch.zeros_like(mean_square)
            moments.append(state["neuron_second_moment"])
        torch._foreach_lerp_(moments, list(mean_squares.unbind(0)), 1 - self.normuon_beta2)
        inverse_rms = torch.stack(moments).clamp(min=1e-10).rsqrt()  # shaped as mean_squares
        # the norms before and after, from the neurons' mean squares alone (each times the short side,
        # a factor that cancels): two passes over the matrices in all, not four
        before = mean_squares.sum(dim=(-2, -1), keepdim=True)
        after = (mean_squares * inverse_rms.square()).sum(dim=(-2, -1), keepdim=True)
        return orthogonal * (inverse_rms * (before / after.clamp(min=1e-20)).sqrt())


def decay_cautiously_(params: list[Tensor], updates: list[Tensor], decay: float) -> None:
    """Cautious weight decay (Chen et al., 2025, "Cautious Weight Decay"): W <- W * (1 - decay) only
    where the update (the step is W - lr * update) has W's sign or is 0, so decay and update both
    pull that weight towards 0; elsewhere the update moves it away from 0, and decay would fight what
    it learns. Multiplying the rest by exactly 1 leaves them bit for bit as they were."""
    for param, update in zip(params, updates, strict=True):
        param.mul_(torch.where(update * param >= 0, 1 - decay, 1.0))
