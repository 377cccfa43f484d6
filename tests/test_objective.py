"""Training with each attention pattern: no position learns a token it can see, the loss goes down,
and prefix-LM's random prefixes resume exactly."""

import json

import pytest
import torch

from errors import UserError
from tests.conftest import tiny_config, tiny_model
from trainer.loop import Trainer
from trainer.objective import Objective

VOCAB = 50
T = 16
START = 20  # token values are START + the position they come from, so a target names its source


def visible(model, B: int, prefix: torch.Tensor | None) -> torch.Tensor:
    """(B, T, T) which positions each position sees, from the model's own mask."""
    idx = torch.zeros(B, T, dtype=torch.long)
    slots = torch.arange(T)
    mask = model.attention_mask(idx, slots[None], slots, None, None, prefix)
    return torch.ones(B, T, T, dtype=torch.bool).tril() if mask is None else mask[:, 0]


@pytest.mark.parametrize(
    "pattern",
    [{}, {"attn_window": 3}, {"attn_prefix_lm": True}, {"attn_block": 4}],
    ids=["causal", "window", "prefix", "block"],
)
def test_no_position_is_trained_on_a_target_it_can_see(pattern):
    model = tiny_model(VOCAB, T, **pattern)
    x = (START + torch.arange(T)).expand(8, T)
    x, targets, prefix = Objective(model.config, seed=0)(x, x + 1)
    sees = visible(model, x.size(0), prefix)
    trained = 0
    for b in range(x.size(0)):
        for t in range(T):
            if targets[b, t] < 0:
                continue
            source = targets[b, t].item() - START
            assert source > t  # a later token
            assert source >= T or not sees[b, t, source], (b, t, source)
            trained += 1
    B = x.size(0)
    if pattern.get("attn_block"):
        assert trained == B * (T - 4 + 1)  # every position whose target is in the window
    elif pattern.get("attn_prefix_lm"):
        assert trained == sum(T - (p - 1) for p in prefix.tolist())  # all but the prefix's own targets
        assert len(set(prefix.tolist())) > 1  # drawn per row
    else:
        assert trained == B * T


def test_block_causal_positions_learn_the_same_place_in_the_next_block():
    model = tiny_model(VOCAB, T, attn_block=4)
    x = (START + torch.arange(T))[None]
    _, targets, _ = Objective(model.config, seed=0)(x, x + 1)
    assert targets[0].tolist() == [START + t + 4 for t in range(T - 3)] + [-1] * 3


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        {"model__attn_window": 8},
        {"model__attn_window": 8, "model__attn_sinks": 2},
        {"model__attn_prefix_lm": True},
        {"model__attn_block": 4},
        {"model__attn_documents": True, "data__dataset": "shakespeare"},
        {"model__attn_documents": True, "model__attn_document_positions": True, "data__dataset": "shakespeare"},
    ],
    ids=["window", "window+sinks", "prefix-lm", "block", "documents", "documents+positions"],
)
def test_a_short_run_with_each_pattern_lowers_the_loss(overrides, tmp_path, data_dir, bpe_data_dir):
    run_dir = tmp_path / "run"
    data = bpe_data_dir if overrides.get("data__dataset") == "shakespeare" else data_dir
    short = {"train__max_iters": 20, "train__eval_interval": 20, "train__eval_iters": 1}
    cfg = tiny_config(run_dir, data, optim__learning_rate=3e-3, **short, **overrides)
    trainer = Trainer(cfg)
    trainer.fit()
    evals = [r for r in read_metrics(run_dir) if "val_loss" in r]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.3
    if "model__attn_documents" in overrides:
        assert trainer.cfg.model.eot_token == 50256  # from the dataset's tokenizer


@pytest.mark.slow
def test_prefix_lm_run_resumes_to_the_same_losses(tmp_path, data_dir):
    def losses(run_dir):
        return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}

    def config(run_dir, **overrides):
        return tiny_config(run_dir, data_dir, model__attn_prefix_lm=True, train__eval_iters=1, **overrides)

    straight = tmp_path / "straight"
    Trainer(config(straight)).fit()
    stopped = tmp_path / "stopped"
    Trainer(config(stopped, train__max_iters=10)).fit()
    Trainer(config(stopped, train__init_from="resume")).fit()
    assert losses(stopped) == losses(straight)


def test_document_masking_on_a_tokenizer_without_end_of_text_is_refused(tmp_path, data_dir):
    with pytest.raises(UserError, match="model.attn_documents=true needs documents separated by an end-of-text"):
        Trainer(tiny_config(tmp_path / "run", data_dir, model__attn_documents=True))
