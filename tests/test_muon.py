"""Muon's update (optim/muon.py): torch.optim.Muon's algorithm, orthogonalised in a chosen dtype
and batched over matrices of one shape, with torch's coefficients or ones fitted per iteration."""

import numpy as np
import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from optim.muon import Muon, _closest_quintic, _direct_form, _gram_form, fitted_coefficients, orthogonalise

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's, for every iteration
# two matrices of one shape (stepped as one batch), a tall one and a square one
SHAPES = [(8, 24), (8, 24), (24, 8), (16, 16)]


def stepped(optimizer_class, steps: int = 3, **kwargs) -> list[torch.Tensor]:
    """The matrices after `steps` steps on fixed gradients, from fixed starting weights."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    optimizer = optimizer_class(params, lr=0.05, weight_decay=0.1, **kwargs)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return [param.detach() for param in params]


def test_orthogonalising_in_bfloat16_steps_exactly_like_torchs_muon():
    """Same algorithm, same dtype. (Measured: bit for bit on this project's CPUs; the bound leaves
    room for a BLAS whose batched products round differently, and is 9x tighter than the
    difference float32 orthogonalisation makes.)"""
    ours = stepped(Muon, ns_dtype=torch.bfloat16)
    torchs = stepped(torch.optim.Muon)
    start = stepped(Muon, steps=0)
    for mine, theirs, before in zip(ours, torchs, start, strict=True):
        moved = (theirs - before).norm()
        assert moved > 0.1
        assert (mine - theirs).norm() < 1e-3 * moved


def test_float32_orthogonalisation_is_torchs_iteration_without_bfloat16_rounding():
    generator = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        update = torch.randn(shape, generator=generator)
        exact = orthogonalise(update[None].double(), [COEFFICIENTS] * 5, 1e-7)[0]
        ours = orthogonalise(update[None], [COEFFICIENTS] * 5, 1e-7)[0]
        torchs = _zeropower_via_newtonschulz(update, COEFFICIENTS, 5, 1e-7).float()
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), exact, rtol=0, atol=1e-5)
        assert 1e-5 < (torchs.double() - exact).abs().max() < 0.1  # bfloat16 rounding, not another iteration


@pytest.mark.parametrize("shape", [(6, 40), (40, 6)], ids=["wide", "tall"])
@pytest.mark.parametrize(
    "coefficients",
    [[COEFFICIENTS], [COEFFICIENTS] * 3, [COEFFICIENTS] * 5, fitted_coefficients(0.003, 3)],
    ids=["1-step", "3-steps", "5-steps", "3-fitted"],
)
def test_gram_form_gives_the_direct_iterations_result(shape, coefficients):
    """The cheaper form for long matrices iterates on the small Gram matrix, multiplying the long
    matrix only at the end: the same result as torch's iteration, up to float64 rounding, with one
    quintic throughout or another at each iteration."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, *shape, generator=generator, dtype=torch.float64)
    x = x / x.norm(dim=(-2, -1), keepdim=True)
    direct = _direct_form(x, coefficients)
    torch.testing.assert_close(_gram_form(x, coefficients), direct, rtol=0, atol=1e-12)
    assert (direct - x).abs().max() > 0.1  # the iteration did move the matrix


def test_only_long_float32_matrices_take_the_gram_form(monkeypatch):
    """The Gram form is chosen where it saves work (one side over 1.5x the other, 2 steps or more) and
    never in bfloat16, where torch's own iteration is kept as it is."""
    taken = []

    def gram_form(x, coefficients):
        taken.append(tuple(x.shape[-2:]))
        return x

    monkeypatch.setattr("optim.muon._gram_form", gram_form)
    cases = [
        ((8, 13), torch.float32),  # long enough: 13 > 1.5 * 8
        ((8, 12), torch.float32),  # 1.5x exactly: the same work either way, so the direct form
        ((12, 8), torch.float32),
        ((16, 16), torch.float32),
        ((8, 24), torch.bfloat16),
    ]
    for shape, dtype in cases:
        orthogonalise(torch.ones(1, *shape, dtype=dtype), [COEFFICIENTS] * 3, 1e-7)
    assert taken == [(8, 13)]


def test_orthogonalised_update_has_singular_values_near_one():
    """What the iteration is for: the update keeps the gradient's singular directions and evens out
    their sizes (this quintic leaves them between about 0.5 and 1.5, not exactly 1)."""
    generator = torch.Generator().manual_seed(2)
    update = torch.randn(32, 8, generator=generator) @ torch.diag(torch.logspace(-1, 1, 8))
    singular = torch.linalg.svdvals(orthogonalise(update[None], [COEFFICIENTS] * 5, 1e-7)[0])
    assert singular.min() > 0.5 and singular.max() < 1.5
    assert torch.linalg.svdvals(update).max() / torch.linalg.svdvals(update).min() > 50


@pytest.mark.parametrize("low,high", [(1e-4, 1.0), (0.003, 1.0), (0.35, 1.65), (0.9, 1.1)])
def test_fitted_quintic_is_the_closest_to_one_in_the_worst_case(low, high):
    """Chebyshev's criterion: an odd quintic (three coefficients) is the minimax fit to 1 over an
    interval exactly when its error reaches its largest size at four points, alternately above and
    below. Checked on a dense grid, not with the fit's own points."""
    (a, b, c), error = _closest_quintic(low, high)
    x = np.linspace(low, high, 200_001)
    miss = 1 - (a * x + b * x**3 + c * x**5)
    assert abs(miss).max() == pytest.approx(error, rel=1e-6)
    extremes = np.flatnonzero(abs(miss) > error * (1 - 1e-6))
    signs = [np.sign(miss[i]) for i in extremes]
    changes = [i for i in range(1, len(signs)) if signs[i] != signs[i - 1]]
    assert len(changes) == 3  # four alternating extremes


def test_fitted_iterations_lift_small_singular_values_torchs_leave_behind():
    """What fitting each iteration buys: after three iterations every singular value from
    `smallest` of the norm up sits in the band the fit promises, about [0.35, 1.65] for 0.003, where
    torch's quintic has lifted the smallest only to about 0.12."""
    generator = torch.Generator().manual_seed(4)
    u, _ = torch.linalg.qr(torch.randn(48, 16, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator, dtype=torch.float64))
    spread = torch.logspace(0, -2.3, 16, dtype=torch.float64)  # 1 down to 0.005
    update = (u * spread) @ v.T
    normalised = spread / spread.norm()
    assert normalised.min() > 0.003 and normalised.max() < 0.9  # inside the fitted interval [0.003, 1]
    fitted = torch.linalg.svdvals(orthogonalise(update[None], fitted_coefficients(0.003, 3), 1e-7)[0])
    torchs = torch.linalg.svdvals(orthogonalise(update[None], [COEFFICIENTS] * 3, 1e-7)[0])
    assert fitted.min() > 0.34 and fitted.max() < 1.66
    assert torchs.min() < 0.3


@pytest.mark.parametrize("steps", [5, 8, 20])
def test_fitted_iterations_stay_bounded_in_bfloat16(steps):
    """bfloat16's rounding can push a singular value just past the interval a quintic was fitted
    over, where the first quintics climb steeply, and the next iterations amplify the excess:
    without the fit's 1% of headroom, five iterations left one at 1.35 where float64 gives 1.11."""
    update = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    coefficients = fitted_coefficients(0.001, steps)
    exact = torch.linalg.svdvals(orthogonalise(update[None].double(), coefficients, 1e-7)[0])
    rounded = torch.linalg.svdvals(orthogonalise(update[None].bfloat16(), coefficients, 1e-7)[0].double())
    assert 0.87 < exact.min() and exact.max() < 1.13  # from 5 iterations on, within 13% of 1
    assert 0.85 < rounded.min() and rounded.max() < 1.15
    assert (rounded - exact).abs().max() < 0.05


@pytest.mark.parametrize(
    "smallest,dtype",
    [(0.0, torch.float32), (0.0, torch.bfloat16), (0.1, torch.float32), (1e-3, torch.float32), (1e-9, torch.float32)],
    ids=["torchs-float32", "torchs-bfloat16", "fitted-0.1", "fitted-0.001", "fitted-1e-9"],
)
def test_every_accepted_number_of_iterations_stays_finite_and_bounded(smallest, dtype):
    """optim.muon_ns_steps accepts 1 to 99. A gradient of lower rank than its small side (here 2 of 8)
    gives the Gram form's A zero eigenvalues, which rounding made slightly negative and every step
    then multiplied by 12 or more: torch's quintic turned to NaN from 12 iterations on. Every count
    stays finite, wide, tall and square, with every singular value at most 1.2 (torch's quintic,
    whose largest value on [0, 1.26] is 1.2023) or about 2 (a few fitted iterations: the band
    [1 - e, 1 + e] of a wide fit)."""
    generator = torch.Generator().manual_seed(7)
    bound = 1.21 if smallest == 0 else 2.1
    for shape in [(8, 40), (40, 8), (16, 16)]:
        low_rank = torch.randn(2, shape[0], 2, generator=generator) @ torch.randn(2, 2, shape[1], generator=generator)
        updates = torch.cat([low_rank, torch.randn(1, *shape, generator=generator), torch.zeros(1, *shape)]).to(dtype)
        steps = range(1, 100)
        coefficients = [fitted_coefficients(smallest, n) if smallest else [COEFFICIENTS] * n for n in steps]
        results = torch.stack([orthogonalise(updates, c, 1e-7) for c in coefficients]).double()  # (99, 4, rows, cols)
        largest = torch.linalg.matrix_norm(results, ord=2).amax(dim=1)  # (99,)
        assert largest.isfinite().all(), (
            shape,
            [n for n, value in zip(steps, largest, strict=True) if not value.isfinite()],
        )
        assert largest.max() < bound, (shape, largest)


def test_muon_orthogonalises_with_the_fitted_coefficients_when_asked():
    params = [torch.nn.Parameter(torch.zeros(8, 24)), torch.nn.Parameter(torch.zeros(8, 24))]
    grads = torch.randn(2, 8, 24, generator=torch.Generator().manual_seed(5))
    expected = {}
    for smallest, coefficients in [(0.0, [COEFFICIENTS] * 3), (0.01, fitted_coefficients(0.01, 3))]:
        for param, grad in zip(params, grads, strict=True):
            param.data.zero_()
            param.grad = grad.clone()
        optimizer = Muon(params, lr=0.1, momentum=0.5, ns_steps=3, ns_dtype=torch.float64, ns_smallest=smallest)
        optimizer.step()
        nesterov = (1 - 0.5) * grads + 0.5 * ((1 - 0.5) * grads)  # the first step's momentum is (1 - m) G
        expected[smallest] = -0.1 * orthogonalise(nesterov.double(), coefficients, 1e-7)
        torch.testing.assert_close(torch.stack([p.detach() for p in params]).double(), expected[smallest])
    assert (expected[0.0] - expected[0.01]).abs().max() > 0.01


def test_muon_state_is_laid_out_as_torchs():
    """Checkpoints hold one momentum buffer per matrix, under torch's name: a state saved by one
    loads into the other."""
    params = [torch.nn.Parameter(torch.ones(4, 6))]
    ours = Muon(params, ns_dtype=torch.float32)
    params[0].grad = torch.full((4, 6), 0.5)
    ours.step()
    state = ours.state_dict()
    assert set(state["state"][0]) == {"momentum_buffer"}
    torch.optim.Muon(params).load_state_dict(state)


def test_muon_refuses_a_rate_scaling_it_does_not_implement():
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([torch.nn.Parameter(torch.ones(4, 6))], adjust_lr_fn="match_rms_adamw")


def plain_step(
    monkeypatch,
    grads: list[torch.Tensor],
    weights: torch.Tensor | None = None,
    lr: float = 1.0,
    weight_decay: float = 0.0,
    **kwargs,
) -> torch.Tensor:
    """The matrix after one Muon step per gradient with no momentum and the orthogonalisation left
    out (the update is the gradient itself), from `weights` (zeros if None)."""
    monkeypatch.setattr("optim.muon.orthogonalise", lambda updates, coefficients, eps: updates)
    param = torch.nn.Parameter(torch.zeros_like(grads[0]) if weights is None else weights.clone())
    optimizer = Muon([param], lr=lr, weight_decay=weight_decay, momentum=0.0, ns_dtype=torch.float32, **kwargs)
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def test_normuon_evens_out_the_rows_of_a_square_matrix_and_remembers_them(monkeypatch):
    """Rows (3, 4) and (0, 1) have mean squares 12.5 and 0.5; with beta2 = 0.5 the running means
    are 6.25 and 0.25, so the rows become (1.2, 1.6) and (0, 2), of norm sqrt(8), rescaled to the
    gradient's sqrt(26). Rows (0, 1) and (2, 0) next: mean squares 0.5 and 2, running means
    0.5 * 6.25 + 0.5 * 0.5 = 3.375 and 0.5 * 0.25 + 0.5 * 2 = 1.125."""
    first, second = torch.tensor([[3.0, 4.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    step1 = torch.tensor([[1.2, 1.6], [0.0, 2.0]]) * (26 / 8) ** 0.5
    torch.testing.assert_close(plain_step(monkeypatch, [first], normuon_beta2=0.5), -step1)
    evened = torch.tensor([[0.0, 1 / 3.375**0.5], [2 / 1.125**0.5, 0.0]])
    step2 = evened * (5 / (1 / 3.375 + 4 / 1.125)) ** 0.5
    torch.testing.assert_close(plain_step(monkeypatch, [first, second], normuon_beta2=0.5), -step1 - step2)


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
def test_normuon_evens_out_the_neurons_along_the_long_side(monkeypatch, tall):
    """A wide matrix's statistic is per column: columns (1, 1), (0, 0), (2, 2) come out as
    (a, a), (0, 0), (a, a), of the gradient's norm sqrt(10), so a = sqrt(10) / 2 (per row, the two
    equal rows would leave it as it was). Its transpose, tall, is evened out per row, and stepped
    sqrt(3 / 2) times as far, as Muon steps a tall matrix."""
    grad, a = torch.tensor([[1.0, 0.0, 2.0], [1.0, 0.0, 2.0]]), 10**0.5 / 2
    expected = torch.tensor([[a, 0.0, a], [a, 0.0, a]])
    if tall:
        grad, expected = grad.T, expected.T * 1.5**0.5
    torch.testing.assert_close(plain_step(monkeypatch, [grad], normuon_beta2=0.9), -expected)


def test_normuon_keeps_one_running_mean_square_per_neuron_in_the_state():
    params = [torch.nn.Parameter(torch.ones(4, 6)), torch.nn.Parameter(torch.ones(6, 4))]
    optimizer = Muon(params, ns_dtype=torch.float32, normuon_beta2=0.95)
    for param in params:
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(0))
    optimizer.step()
    state = optimizer.state_dict()["state"]
    assert [tuple(state[i]["neuron_second_moment"].shape) for i in (0, 1)] == [(1, 6), (6, 1)]
    assert set(state[0]) == {"momentum_buffer", "neuron_second_moment"}


def test_cautious_decay_leaves_the_weights_its_update_shrinks_undecayed(monkeypatch):
    """W - lr * update with lr 0.1 and decay 1: weights 1 and -2, whose updates 1 and 0 move them
    towards 0 or not at all, are decayed by 0.1 of themselves; -1 and 2, whose updates 1 and -1
    move them away from 0, are only stepped. Without the switch, every weight is decayed."""
    weights, grad = torch.tensor([[1.0, -1.0], [2.0, -2.0]]), torch.tensor([[1.0, 1.0], [-1.0, 0.0]])
    after = plain_step(monkeypatch, [grad], weights, lr=0.1, weight_decay=1.0, cautious=True)
    torch.testing.assert_close(after, torch.tensor([[0.9 - 0.1, -1.0 - 0.1], [2.0 + 0.1, -1.8]]))
    everywhere = plain_step(monkeypatch, [grad], weights, lr=0.1, weight_decay=1.0)
    torch.testing.assert_close(everywhere, 0.9 * weights - 0.1 * grad)
