"""Sequence-length and batch-size schedules: each step trains at its stage's shape, evaluation at the
full one, the learning rate follows the batch size, tokens are counted step by step, and a run
stopped anywhere, across a stage boundary too, resumes bit for bit."""

import json
import signal

import pytest

from errors import ConfigError
from optim.lr_schedule import lr_at
from plot import Run
from tests.conftest import tiny_config
from trainer.config import Config, build_config, idle_keys
from trainer.loop import Trainer
from trainer.schedules import batch_shape_at, lr_factor_at, tokens_before, tokens_per_step_at

# 12 steps: rows of 16 tokens until step 3, micro-batches of 2 until step 6, then 4 x 32
SCHEDULES = dict(train__block_size_schedule="16:0.25", train__batch_size_schedule="2:0.5", train__max_iters=12)


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def scheduled(**train) -> Config:
    values = {"model": {"block_size": 64}, "data": {"batch_size": 12}, "train": {"max_iters": 10} | train}
    return build_config(values)


def test_each_stage_holds_its_fraction_of_the_steps_then_the_configured_size_follows():
    cfg = scheduled(block_size_schedule="16:0.2,32:0.5", batch_size_schedule="8:0.5")
    shapes = [batch_shape_at(step, cfg) for step in range(10)]
    assert shapes == [(8, 16)] * 2 + [(8, 32)] * 3 + [(12, 64)] * 5
    assert (
        tokens_before(10, cfg)
        == sum(tokens_per_step_at(step, cfg) for step in range(10))
        == 2 * 128 + 3 * 256 + 5 * 768
    )
    assert lr_factor_at(0, cfg) == (8 / 12) ** 0.6 and lr_factor_at(9, cfg) == 1.0


def test_a_stage_ends_where_its_fraction_as_written_says_not_where_float_rounding_puts_it():
    cfg = build_config({"model": {"block_size": 64}, "train": {"max_iters": 25, "block_size_schedule": "16:0.28"}})
    assert [batch_shape_at(step, cfg)[1] for step in (6, 7)] == [16, 64]  # 0.28 * 25 = 7.000000000000001 in floats


def test_without_a_schedule_every_step_has_the_full_shape_and_the_learning_rate_as_it_was():
    cfg = scheduled()
    assert {batch_shape_at(step, cfg) for step in range(10)} == {(12, 64)}
    assert {lr_factor_at(step, cfg) for step in range(10)} == {1.0}  # exactly: lr * 1.0 is lr bit for bit
    assert tokens_before(7, cfg) == 7 * 12 * 64


@pytest.mark.parametrize(
    "text", ["32:0.3,64", "32:1", "32:0", "0:0.5", "32:0.6,16:0.4", "32", "x:0.5", "32:nan", "32:0.3,"]
)
def test_a_schedule_that_is_not_stages_of_rising_fractions_is_refused_in_one_line(text):
    with pytest.raises(ConfigError, match=r"train\.block_size_schedule=.* is not a list of SIZE:UNTIL stages.*e\.g\."):
        scheduled(block_size_schedule=text)


@pytest.mark.parametrize(
    "model,text,message",
    [
        ({}, "128:0.5", r"rows of 128 tokens: each stage's length must lie in 1 \.\. model\.block_size=64"),
        ({"attn_block": 8}, "8:0.5", r"rows of 8 tokens: each stage's length must lie in model\.attn_block=8 \+ 1"),
    ],
)
def test_rows_longer_than_the_model_or_too_short_for_its_blocks_are_refused(model, text, message):
    values = {"model": {"block_size": 64} | model, "train": {"block_size_schedule": text}}
    with pytest.raises(ConfigError, match=message):
        build_config(values)


def test_the_batch_size_lr_power_is_named_in_the_note_without_a_batch_size_schedule():
    assert "train.batch_size_lr_power=0.5 (only with train.batch_size_schedule)" in idle_keys(
        scheduled(batch_size_lr_power=0.5)
    )
    assert idle_keys(scheduled(batch_size_lr_power=0.5, batch_size_schedule="8:0.5")) is None
    with pytest.raises(ConfigError, match=r"train\.batch_size_lr_power=1\.5 is outside the accepted range 0 \.\. 1"):
        scheduled(batch_size_lr_power=1.5)


def test_a_run_trains_each_step_at_its_shape_and_rate_and_counts_its_tokens(tmp_path, data_dir):
    cfg = tiny_config(tmp_path / "run", data_dir, train__gradient_accumulation_steps=2, **SCHEDULES)
    trainer = Trainer(cfg)
    forward, shapes = trainer.forward, []
    trainer.forward = lambda x, *a, **k: (
        shapes.append((trainer.model.training, trainer.step, *x.shape)) or forward(x, *a, **k)
    )
    trainer.fit()
    trained = [(step, B, T) for training, step, B, T in shapes if training]
    expected = [(step, *batch_shape_at(step, trainer.cfg)) for step in range(12) for _ in range(2)]
    assert trained == expected and {B * T for _, B, T in trained} == {32, 64, 128}
    assert {(B, T) for training, _, B, T in shapes if not training} == {(4, 32)}  # evaluation: full rows
    steps = [r for r in metrics(tmp_path / "run") if "loss" in r]
    assert [r["tokens"] for r in steps] == [sum(2 * B * T for s, B, T in trained[::2] if s < r["step"]) for r in steps]
    assert steps[-1]["tokens"] == 3 * 2 * 2 * 16 + 3 * 2 * 2 * 32 + 6 * 2 * 4 * 32
    assert [r["lr"] for r in steps] == [
        lr_at(r["step"] - 1, trainer.cfg.optim) * lr_factor_at(r["step"] - 1, cfg) for r in steps
    ]
    assert steps[0]["lr"] < lr_at(0, trainer.cfg.optim)  # a batch of 2, not 4: (1/2) ** 0.6 of the rate
    run = Run.read(str(tmp_path / "run"))
    assert run.curve("loss", "tokens")[0] == [r["tokens"] for r in steps]  # plot.py's x axis agrees


@pytest.mark.parametrize("stop_at", [2, 3, 5])  # inside the first stage, at the first boundary, before the second
def test_a_run_stopped_around_a_schedule_boundary_resumes_bit_for_bit(tmp_path, data_dir, stop_at):
    run = dict(train__gradient_accumulation_steps=2, train__eval_interval=4, model__dropout=0.1, **SCHEDULES)
    Trainer(tiny_config(tmp_path / "whole", data_dir, **run)).fit()
    trainer = Trainer(tiny_config(tmp_path / "split", data_dir, **run))
    train_step = trainer.train_step

    def stop_after(lr):
        loss = train_step(lr)
        if trainer.step == stop_at - 1:  # the step just taken becomes stop_at
            signal.raise_signal(signal.SIGTERM)
        return loss

    trainer.train_step = stop_after
    assert trainer.fit() == signal.SIGTERM
    assert Trainer(tiny_config(tmp_path / "split", data_dir, **run, train__init_from="resume")).fit() is None

    def losses(run_dir):
        return [(r["step"], r["loss"], r["lr"], r["tokens"]) for r in metrics(run_dir) if "loss" in r]

    assert losses(tmp_path / "split") == losses(tmp_path / "whole")
