"""The optimizers (AdamW, Muon with AdamW) and the learning-rate schedules."""

import pytest
import torch

from errors import ConfigError, UserError
from optim.lr_schedule import lr_at
from optim.muon import fitted_coefficients
from optim.optimizer import CautiousAdamW, build_optimizer
from tests.conftest import tiny_config, tiny_model
from tests.test_trainer import read_metrics, train_losses
from trainer.config import OptimConfig, load_config
from trainer.loop import Trainer

CPU = torch.device("cpu")


def one_step(model, optimizer) -> dict[str, torch.Tensor]:
    """The weights before one optimizer step on a random batch (the model's are after it)."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=generator)
    _, loss = model.train()(idx, idx)
    loss.backward()
    optimizer.step()
    return before


def test_adamw_alone_is_the_default():
    optimizer = build_optimizer(tiny_model(), OptimConfig(), CPU)
    assert [type(o) for o in optimizer.optimizers] == [torch.optim.AdamW]


def owners(optimizer) -> dict[int, str]:
    """Which of Muon and AdamW holds each parameter (by id)."""
    muon, adamw = optimizer.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    return {id(p): name for name, o in (("muon", muon), ("adamw", adamw)) for g in o.param_groups for p in g["params"]}


MODERN = {"pos_emb": "rope", "norm": "rmsnorm", "qk_norm": True, "mlp": "swiglu", "n_kv_head": 1, "logit_softcap": 15.0}


@pytest.mark.parametrize("architecture", [{}, MODERN], ids=["gpt2", "modern"])
def test_muon_steps_the_block_matrices_and_adamw_every_other_parameter(architecture):
    model = tiny_model(**architecture)
    optimizer = build_optimizer(model, OptimConfig(optimizer="muon"), CPU)
    muon, adamw = optimizer.optimizers
    owner = owners(optimizer)
    names = dict(model.named_parameters())
    assert len(owner) == sum(len(g["params"]) for g in optimizer.param_groups) == len(names)  # each param once
    for name, param in names.items():
        meant = "muon" if name.startswith("transformer.h.") and param.dim() == 2 else "adamw"
        assert owner[id(param)] == meant, name
    assert owner[id(names["transformer.wte.weight"])] == "adamw"

    before = one_step(model, optimizer)
    for name, param in names.items():
        assert not torch.equal(param, before[name]), f"{name} did not move"
        state = (muon if owner[id(param)] == "muon" else adamw).state[param]
        assert ("momentum_buffer" if owner[id(param)] == "muon" else "exp_avg") in state, name


def test_muon_orthogonalises_with_the_coefficients_the_config_names(monkeypatch):
    used = []

    def recording(updates, coefficients, eps):
        used.append(tuple(coefficients))
        return updates

    monkeypatch.setattr("optim.muon.orthogonalise", recording)
    for smallest, expected in [(0.0, ((3.4445, -4.7750, 2.0315),) * 4), (0.003, fitted_coefficients(0.003, 4))]:
        used.clear()
        config = OptimConfig(optimizer="muon", muon_ns_steps=4, muon_ns_smallest=smallest)
        model = tiny_model()
        one_step(model, build_optimizer(model, config, CPU))
        assert used and all(coefficients == expected for coefficients in used)


def test_an_untied_output_head_is_stepped_by_adamw():
    model = tiny_model(tie_embeddings=False)
    owner = owners(build_optimizer(model, OptimConfig(optimizer="muon"), CPU))
    assert owner[id(model.lm_head.weight)] == owner[id(model.transformer.wte.weight)] == "adamw"


def test_each_optimizer_follows_the_schedule_scaled_to_its_peak():
    cfg = OptimConfig(optimizer="muon", learning_rate=1e-3, min_lr=1e-4, muon_lr=0.02)
    optimizer = build_optimizer(tiny_model(), cfg, CPU)
    optimizer.set_lr(5e-4)
    muon, adamw = optimizer.optimizers
    assert all(g["lr"] == pytest.approx(0.01) for g in muon.param_groups)
    assert all(g["lr"] == 5e-4 for g in adamw.param_groups)


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_to_min_lr():
    cfg = OptimConfig(
        schedule="wsd", learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, cooldown_frac=0.2
    )
    assert [lr_at(step, cfg) for step in range(10)] == pytest.approx([(s + 1) / 11 for s in range(10)])
    assert all(lr_at(step, cfg) == 1.0 for step in range(10, 88))  # stable until the last 22 steps
    decay = [lr_at(step, cfg) for step in range(88, 111)]
    assert decay == pytest.approx([1.0 - 0.9 * i / 22 for i in range(23)])  # a straight line down
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(10_000, cfg) == 0.1


@pytest.mark.parametrize(
    "override,message",
    [
        ("--optim.optimizer=sgd", r"^optim.optimizer='sgd' is not one of adamw, muon$"),
        ("--optim.schedule=linear", r"^optim.schedule='linear' is not one of cosine, wsd$"),
        ("--optim.cooldown_frac=0", r"^optim.cooldown_frac=0.0 must be in \(0, 1\]$"),
        ("--optim.muon_ns_steps=0", r"^optim.muon_ns_steps=0 must be between 1 and 99$"),
        (
            "--optim.muon_ns_smallest=1",
            r"^optim.muon_ns_smallest=1.0 must be 0 \(torch's coefficients\) or between 0 and 1$",
        ),
        ("--optim.muon_lr=-1", r"^optim.muon_lr=-1.0 must be positive$"),
        ("--optim.muon_beta2=1", r"^optim.muon_beta2=1.0 must be in \[0, 1\)$"),
    ],
)
def test_bad_optimizer_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_wsd_decay_that_would_start_inside_warmup_is_refused():
    overrides = ["--optim.schedule=wsd", "--optim.warmup_iters=100", "--optim.lr_decay_iters=200"]
    with pytest.raises(ConfigError, match=r"cooldown_frac=0.6 starts the decay at step 80 .* before warmup_iters=100"):
        load_config(None, [*overrides, "--optim.cooldown_frac=0.6"])


MUON_RUN = dict(optim__optimizer="muon", optim__schedule="wsd", train__max_iters=20, train__eval_interval=10)


@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"optim__muon_ns_steps": 3, "optim__muon_ns_smallest": 0.001},
        {"optim__muon_normuon": True, "optim__muon_beta2": 0.9},
        {"optim__cautious_weight_decay": True, "optim__muon_weight_decay": 0.5},
    ],
    ids=["torchs", "fitted-as-the-quickstart", "normuon", "cautious-weight-decay"],
)
def test_muon_run_trains_and_resumes_bit_exactly(tmp_path, data_dir, switches):
    """Both optimizers' states are in the checkpoint (NorMuon's running mean squares too): stopping
    at step 10 and resuming gives the very same losses as an uninterrupted run."""
    run = MUON_RUN | switches
    Trainer(tiny_config(tmp_path / "whole", data_dir, **run)).fit()
    Trainer(tiny_config(tmp_path / "split", data_dir, **run | {"train__max_iters": 10})).fit()
    checkpoint = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    states = checkpoint["optimizer"]["state"]
    assert "momentum_buffer" in states["transformer.h.0.attn.c_attn.weight"]
    assert "exp_avg" in states["transformer.wte.weight"] and "exp_avg" in states["transformer.h.0.ln_1.weight"]
    normuon = "neuron_second_moment" in states["transformer.h.0.attn.c_attn.weight"]
    assert normuon == run.get("optim__muon_normuon", False)
    resumed = Trainer(tiny_config(tmp_path / "split", data_dir, **run | {"train__init_from": "resume"}))
    resumed.fit()
    losses = train_losses(tmp_path / "whole")
    assert train_losses(tmp_path / "split") == losses
    evals = [r["val_loss"] for r in read_metrics(tmp_path / "whole") if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.3


def test_resume_with_another_optimizer_is_a_clear_error(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    with pytest.raises(UserError, match=r"optim.optimizer='muon' but the run in .* was trained with 'adamw'"):
        Trainer(tiny_config(run_dir, data_dir, train__init_from="resume", optim__optimizer="muon"))


def test_cautious_weight_decay_builds_cautious_optimizers_and_leaves_the_default_alone():
    model = tiny_model()
    muon, adamw = build_optimizer(model, OptimConfig(optimizer="muon", cautious_weight_decay=True), CPU)
    assert muon.cautious and type(adamw) is CautiousAdamW and adamw.defaults["fused"]
    muon, adamw = build_optimizer(model, OptimConfig(optimizer="muon"), CPU)
    assert not muon.cautious and muon.normuon_beta2 is None and type(adamw) is torch.optim.AdamW
    muon, _ = build_optimizer(model, OptimConfig(optimizer="muon", muon_normuon=True, muon_beta2=0.8), CPU)
    assert muon.normuon_beta2 == 0.8


def test_cautious_adamw_decays_only_where_its_update_has_the_weights_sign():
    """AdamW's first update is g / |g| (eps aside): +1 or -1. Weights 1, -1, 1, -1 with gradients
    1, -1, -1, 1: the first two are decayed (1 - 0.1 * 0.5 = 0.95 of themselves) and stepped,
    the last two only stepped. A second gradient of the other sign, too small to turn the first
    moment, keeps the same mask: it reads the update, not the gradient, so each weight then follows
    torch's AdamW with (first two) or without (last two) weight decay."""
    weights, grads = torch.tensor([[1.0, -1.0, 1.0, -1.0]]), torch.tensor([[1.0, -1.0, -1.0, 1.0]])

    def run(optimizer_class, weight_decay: float, steps: int) -> torch.Tensor:
        param = torch.nn.Parameter(weights.clone())
        optimizer = optimizer_class([param], lr=0.1, weight_decay=weight_decay, fused=True)
        for grad in [grads, -0.01 * grads][:steps]:
            param.grad = grad.clone()
            optimizer.step()
        return param.detach()

    one_step = torch.tensor([[0.95 - 0.1, -0.95 + 0.1, 1 + 0.1, -1 - 0.1]])
    torch.testing.assert_close(run(CautiousAdamW, 0.5, 1), one_step)
    cautious = run(CautiousAdamW, 0.5, 2)
    torch.testing.assert_close(cautious[:, :2], run(torch.optim.AdamW, 0.5, 2)[:, :2], rtol=0, atol=1e-7)
    torch.testing.assert_close(cautious[:, 2:], run(torch.optim.AdamW, 0.0, 2)[:, 2:], rtol=0, atol=1e-7)
