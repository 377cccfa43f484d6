import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

import trainer.metrics as metrics_module
import trainer.runtime as runtime_module
from errors import UserError
from model import GPTConfig
from optim.lr_schedule import lr_at
from optim.optimizer import build_optimizer
from tests.conftest import FixedBatches, fixed_tokens, tiny_config, tiny_model
from trainer.config import Config, LoraConfig, OptimConfig, config_to_dict, load_config
from trainer.loop import Trainer
from trainer.metrics import SlowdownWatch, Throughput, flops_per_token, peak_flops, read_records, total_peak_flops
from trainer.run_dir import unresumable_changes


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_lr_warms_up_linearly_then_decays_by_cosine_to_min_lr():
    cfg = OptimConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110)
    warmup = [lr_at(step, cfg) for step in range(10)]
    assert warmup == pytest.approx([(s + 1) / 11 for s in range(10)])
    assert lr_at(10, cfg) == pytest.approx(1.0)  # peak at the end of warmup
    assert lr_at(60, cfg) == pytest.approx(0.55)  # halfway through the decay: the midpoint
    decay = [lr_at(step, cfg) for step in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert lr_at(110, cfg) == pytest.approx(0.1) and lr_at(10_000, cfg) == 0.1


def test_weight_decay_applies_to_matrices_only():
    model = tiny_model()
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() == 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_train_threads_sets_the_cpu_threads_of_torch(tmp_path, data_dir):
    before = torch.get_num_threads()
    try:
        Trainer(tiny_config(tmp_path / "run", data_dir, train__threads=before + 1))
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def test_mfu_peak_table_matches_gpu_names():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA A10") == 125e12
    assert peak_flops("Some Future GPU") is None


def test_throughput_reports_tokens_per_second_and_mfu(monkeypatch):
    clock = iter([100.0, 102.0, 103.0, 104.0])
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: next(clock))
    throughput = Throughput(lambda step: 1000 * step, flops_per_token=6e6, peak_flops=1e12, step=10)  # clock at 100
    assert throughput.measure(20) == pytest.approx({"tokens_per_sec": 5000.0, "mfu": 0.03})  # 10 steps in 2 s
    assert Throughput(lambda step: 1000 * step, 6e6, None, step=0).measure(4) == {"tokens_per_sec": 4000.0}  # 1 s


def test_logged_mfu_is_model_flops_times_tokens_per_second_over_the_device_peak(tmp_path, data_dir, monkeypatch):
    # a CPU has no entry in the peak table: give this one a fake GPU's, as a GPU run would find its own
    monkeypatch.setattr(metrics_module, "PEAK_FLOPS", (("Fake GPU", 2e9),))
    monkeypatch.setattr(metrics_module, "gpu_peak_flops", lambda device: peak_flops("Fake GPU"))
    run_dir = tmp_path / "run"
    trainer = Trainer(tiny_config(run_dir, data_dir, train__max_iters=5))
    trainer.fit()
    model_flops = flops_per_token(trainer.cfg.model, trainer.model.num_params())
    steps = [r for r in read_metrics(run_dir) if "loss" in r]
    assert len(steps) == 5
    for record in steps:
        assert record["mfu"] == pytest.approx(model_flops * record["tokens_per_sec"] / 2e9)


def test_peak_of_a_run_is_that_of_all_its_processes_gpus(monkeypatch):
    """tokens_per_step counts every process's tokens, so MFU divides by every process's GPU."""
    monkeypatch.setattr(metrics_module, "gpu_peak_flops", lambda device: 1e12)
    assert total_peak_flops(torch.device("cpu"), 4) == 4e12
    monkeypatch.setattr(metrics_module, "gpu_peak_flops", lambda device: None)
    assert total_peak_flops(torch.device("cpu"), 4) is None


def test_flops_per_token_counts_weights_and_attention():
    model = tiny_model()
    cfg = model.config
    n = model.num_params()
    assert flops_per_token(cfg, n) == 6 * n + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


def test_flops_per_token_counts_attention_over_the_width_of_the_heads():
    cfg = tiny_model().config  # 2 heads of 16
    n = 1000
    attention = flops_per_token(cfg, n) - 6 * n
    assert flops_per_token(dataclasses.replace(cfg, head_dim=32), n) - 6 * n == 2 * attention
    assert flops_per_token(dataclasses.replace(cfg, head_dim=8), n) - 6 * n == attention / 2


def test_flops_per_token_counts_only_the_keys_a_sliding_window_shows():
    cfg = tiny_model(block_size=32).config
    n = 1000
    causal = flops_per_token(cfg, n)
    windowed = flops_per_token(dataclasses.replace(cfg, attn_window=8, attn_sinks=2), n)
    assert causal - windowed == 12 * cfg.n_layer * (32 - 10) * cfg.n_embd
    documents = dataclasses.replace(cfg, attn_documents=True, eot_token=0)
    assert flops_per_token(documents, n) == causal  # their saving depends on the data: counted as causal


def test_training_lowers_the_loss_and_records_the_run(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=30, optim__learning_rate=3e-3)).fit()
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all({"lr", "tokens_per_sec"} <= r.keys() and r["tokens_per_sec"] > 0 for r in steps)
    assert [r["step"] for r in evals] == [0, 10, 20, 30]
    assert evals[0]["val_loss"] == pytest.approx(math.log(65), abs=0.15)  # untrained: about ln(vocab)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    assert all(r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in evals)
    assert all(r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2)) for r in evals)  # 1 byte per character
    saved = load_config(str(run_dir / "config.toml"), [])
    assert saved.model.vocab_size == 65 and saved.train.max_iters == 30
    checkpoint = torch.load(run_dir / "ckpt.pt", weights_only=True)
    assert checkpoint["step"] == 30 and checkpoint["config"]["model"]["vocab_size"] == 65


def test_a_shortened_run_decays_to_min_lr_at_its_last_step(tmp_path, data_dir):
    """With optim.lr_decay_iters unset, --train.max_iters alone sets the decay's end: the run takes
    the rates of a decay ending at its last step, and its config.toml and checkpoint say so."""
    run_dir = tmp_path / "run"
    trainer = Trainer(tiny_config(run_dir, data_dir, optim__lr_decay_iters=0, train__max_iters=12))
    trainer.fit()
    decay_at_12 = tiny_config(tmp_path / "unused", data_dir, optim__lr_decay_iters=12, train__max_iters=12).optim
    logged = {r["step"]: r["lr"] for r in read_metrics(run_dir) if "lr" in r}
    assert logged == {step + 1: lr_at(step, decay_at_12) for step in range(12)}  # a record's lr took it to its step
    assert lr_at(12, trainer.cfg.optim) == trainer.cfg.optim.min_lr
    assert load_config(str(run_dir / "config.toml"), []).optim.lr_decay_iters == 12
    assert torch.load(run_dir / "ckpt.pt", weights_only=True)["config"]["optim"]["lr_decay_iters"] == 12


def test_a_run_shorter_than_its_intervals_logs_evaluates_and_saves_its_last_step(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=3, train__log_interval=10, train__eval_interval=10)).fit()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records if "loss" in r] == [3]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 3]
    assert torch.load(run_dir / "ckpt.pt", weights_only=True)["step"] == 3


def test_a_run_without_the_evaluation_at_start_evaluates_only_at_its_intervals_and_resumes_so(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    steps = dict(train__max_iters=4, train__eval_interval=2, train__eval_at_start=False)
    Trainer(tiny_config(run_dir, data_dir, **steps)).fit()
    assert [r["step"] for r in read_metrics(run_dir) if "val_loss" in r] == [2, 4]
    Trainer(tiny_config(run_dir, data_dir, **steps | dict(train__max_iters=6, train__init_from="resume"))).fit()
    assert [r["step"] for r in read_metrics(run_dir) if "val_loss" in r] == [2, 4, 6]


def test_bits_per_byte_divide_the_loss_by_the_bytes_per_token_of_each_split(tmp_path, bpe_data_dir):
    run_dir = tmp_path / "run"
    overrides = {"data__dataset": "shakespeare", "train__max_iters": 1, "train__eval_iters": 1}
    Trainer(tiny_config(run_dir, bpe_data_dir, **overrides)).fit()
    meta = json.loads((bpe_data_dir / "shakespeare" / "meta.json").read_text())
    evaluation = [r for r in read_metrics(run_dir) if "val_loss" in r][-1]
    for split in ("train", "val"):
        bits_per_token = evaluation[f"{split}_loss"] / math.log(2)
        tokens_per_byte = meta[f"{split}_tokens"] / meta[f"{split}_bytes"]  # about 0.3 for GPT-2 on English
        assert evaluation[f"{split}_bpb"] == pytest.approx(bits_per_token * tokens_per_byte)


def test_gradient_accumulation_equals_one_large_batch(tmp_path, data_dir):
    """Two micro-batches of b sequences give the loss and the gradients of one batch of 2b."""
    x, y = fixed_tokens(8, 32, 65)
    results = []
    for accumulation, batch_size in ((2, 4), (1, 8)):
        trainer = Trainer(
            tiny_config(
                tmp_path / f"run{accumulation}",
                data_dir,
                data__batch_size=batch_size,
                train__gradient_accumulation_steps=accumulation,
                train__grad_clip=0.0,
            )  # fmt: skip
        )
        trainer.batches = FixedBatches(x, y, batch_size)
        grads = []  # the gradients the optimizer is handed, after clipping
        model = trainer.model
        trainer.optimizer.step = lambda grads=grads, model=model: grads.extend(
            p.grad.clone() for p in model.parameters()
        )
        loss = trainer.train_step(lr=1e-3)
        results.append((loss, grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=1e-6)
    assert len(grads_a) == len(grads_b) > 0
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_resumed_run_matches_an_uninterrupted_one(tmp_path, data_dir):
    """Stopping at step 10 and resuming gives the very same losses afterwards, dropout included."""
    common = dict(model__dropout=0.1, train__max_iters=20, train__eval_interval=10)
    Trainer(tiny_config(tmp_path / "whole", data_dir, **common)).fit()
    Trainer(tiny_config(tmp_path / "split", data_dir, **common | {"train__max_iters": 10})).fit()
    resumed = Trainer(tiny_config(tmp_path / "split", data_dir, **common | {"train__init_from": "resume"}))
    assert resumed.step == 10
    resumed.fit()
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")
    assert [r["step"] for r in read_metrics(tmp_path / "split") if "val_loss" in r] == [0, 10, 20]


def test_resume_drops_metrics_logged_after_the_checkpoint(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    with open(run_dir / "metrics.jsonl", "a") as f:  # as if the run died at step 12, after its checkpoint
        f.write(json.dumps({"step": 11, "loss": 9.0}) + "\n" + json.dumps({"step": 12, "loss": 9.0}) + "\n")
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=12, train__init_from="resume")).fit()
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 13)) and 9.0 not in losses.values()


def test_resume_survives_a_half_written_metrics_line(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "lo')  # killed mid-write
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=12, train__init_from="resume")).fit()
    assert sorted(train_losses(run_dir)) == list(range(1, 13))


def test_existing_run_directory_is_not_overwritten(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    with pytest.raises(
        UserError, match=r"already holds a run \(ckpt.pt\) of this model; continue it with python train.py "
    ):
        Trainer(tiny_config(run_dir, data_dir, train__max_iters=10))
    (run_dir / "ckpt.pt").unlink()  # as if the run had died before its first checkpoint
    with pytest.raises(UserError, match="holds the metrics.jsonl of a run that wrote no checkpoint"):
        Trainer(tiny_config(run_dir, data_dir, train__max_iters=10))
    before.pop("ckpt.pt")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_a_new_run_of_another_model_is_pointed_to_another_directory_not_to_resume(tmp_path, data_dir):
    """Resuming cannot work for a changed model: the refusal says so and names what works."""
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    with pytest.raises(UserError) as error:
        Trainer(tiny_config(run_dir, data_dir, train__max_iters=10, model__n_layer=3))
    message = str(error.value)
    assert "that this config cannot resume (model.n_layer=3 but the run in" in message
    assert message.endswith("train it in another directory (--train.out_dir=out/NAME)")
    assert "init_from=resume" not in message


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, data_dir):
    with pytest.raises(UserError, match=r"init_from='resume' but there is no checkpoint at .*ckpt.pt"):
        Trainer(tiny_config(tmp_path / "empty", data_dir, train__init_from="resume"))


def test_resume_with_a_different_model_is_a_clear_error(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    with pytest.raises(UserError, match=r"model.n_layer=3 but the run in .* was trained with 2"):
        Trainer(tiny_config(run_dir, data_dir, train__init_from="resume", model__n_layer=3))


# the keys of [model] and [lora] that act only while training: a resume may change them
TRAINING_ONLY = {"model.dropout", "lora.dropout", "lora.base_dtype"}


def another_value(value):
    """A value of the same type as value, and not equal to it."""
    if isinstance(value, bool):
        return not value
    return value + ",other" if isinstance(value, str) else value + 1


# every key of the sections whose values define what a checkpoint's weights compute
WEIGHT_KEYS = [
    f"{name}.{f.name}" for name, cls in (("model", GPTConfig), ("lora", LoraConfig)) for f in dataclasses.fields(cls)
]


@pytest.mark.parametrize("key", WEIGHT_KEYS)
def test_a_resume_that_changes_what_the_weights_compute_is_refused_naming_the_key(key):
    """Every key of the sections that define what a checkpoint computes (the model, its adapters) is
    refused with another value on resume, a key added later included, but for the training-only ones."""
    saved = config_to_dict(Config())
    requested = config_to_dict(Config())
    section, name = key.split(".")
    requested[section][name] = another_value(saved[section][name])
    changes = unresumable_changes(requested, saved, Path("out/run"))
    if key in TRAINING_ONLY:
        assert changes == []
    else:
        assert len(changes) == 1 and changes[0].startswith(f"{key}=") and "but the run in out/run" in changes[0]


def test_vocab_size_smaller_than_the_dataset_is_a_clear_error(tmp_path, data_dir):
    with pytest.raises(UserError, match="model.vocab_size=50 is smaller than the dataset's vocabulary of 65"):
        Trainer(tiny_config(tmp_path / "run", data_dir, model__vocab_size=50))


def test_padded_vocabulary_is_allowed(tmp_path, data_dir):
    trainer = Trainer(tiny_config(tmp_path / "run", data_dir, model__vocab_size=128))
    assert trainer.model.lm_head.out_features == 128


def test_a_token_key_must_name_a_token_of_the_dataset_not_only_of_the_padded_model(tmp_path, data_dir):
    # id 0 of the character vocabulary is the newline: documents separated by newlines
    lines = Trainer(tiny_config(tmp_path / "a", data_dir, model__attn_documents=True, model__eot_token=0))
    assert lines.model.config.eot_token == 0
    # 100 fits the padded model's 128 rows, but no text of the dataset holds it: no document would ever start
    padded = tiny_config(
        tmp_path / "b", data_dir, model__vocab_size=128, model__attn_documents=True, model__eot_token=100
    )
    with pytest.raises(
        UserError, match=r"model.eot_token=100 is not a token of data.dataset='shakespeare_char', whose ids are 0 .. 64"
    ):
        Trainer(padded)
    assert not (tmp_path / "b").exists()


def test_the_run_names_its_idle_settings_and_an_unfinished_schedule_in_notes(tmp_path, data_dir, capsys):
    # tiny_config warms up over 2 steps: a 1-step run ends inside the warmup
    cfg = tiny_config(tmp_path / "run", data_dir, optim__muon_lr=0.05, optim__muon_ns_steps=3, train__max_iters=1)
    Trainer(cfg).fit()
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: these settings do nothing in this run: optim.muon_lr=0.05, optim.muon_ns_steps=3 "
        "(only with optim.optimizer='muon')",
        "note: the run ends at train.max_iters=1, inside its warmup of optim.warmup_iters=2 steps; a shorter "
        "optim.warmup_iters (0 for none) fits the whole schedule in the run",
    ]


def test_wandb_offline_logs_without_network(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10, wandb__enabled=True, wandb__mode="offline")).fit()
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 1
    assert any(offline_runs[0].glob("*.wandb"))


@pytest.mark.parametrize(
    "line,problem",
    [
        ('{"step": 2, "loss": null}', "loss=None is not a number"),
        ('{"step": 2, "loss": "3.9"}', "loss='3.9' is not a number"),
        ('{"step": 2, "time": [1, 2]}', "time=[1, 2] is not a number"),
        ('{"loss": 3.9}', "it has no step"),
        ('{"step": true, "loss": 3.9}', "step=True is not a whole number of 0 or more"),
        ('{"step": 2.0, "loss": 3.9}', "step=2.0 is not a whole number of 0 or more"),
        ('{"step": -2, "loss": 3.9}', "step=-2 is not a whole number of 0 or more"),
    ],
    ids=["null", "string", "list", "no-step", "boolean-step", "float-step", "negative-step"],
)
def test_a_record_with_a_value_that_is_not_a_number_is_refused_naming_it(tmp_path, line, problem):
    """One definition of a record for resuming, plot.py and bench/ (a null loss drew a gap, a string one
    a categorical axis, a string val_loss a traceback)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"step": 1, "loss": 4.0}}\n{line}\n{{"step": 3, "loss": 3.8}}\n')
    with pytest.raises(
        UserError, match=rf"metrics.jsonl line 2 is not a record of this trainer \({re.escape(problem)}\)"
    ):
        read_records(path)


def test_resumed_log_drops_a_torn_last_line_but_refuses_a_damaged_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.9}\n{"step": 3, "lo')
    assert [step for _, step in read_records(path)] == [1, 2]
    path.write_text('{"step": 1, "loss": 4.0}\n["not", "a", "record"]\n{"step": 3, "loss": 3.8}\n')
    with pytest.raises(UserError, match="metrics.jsonl line 2 is not a record of this trainer"):
        read_records(path)


@pytest.mark.parametrize(
    "usable, idle, processes, threads",
    [
        (2, 2.0, 1, 2),  # an idle machine: a thread per core
        (2, 1.8, 1, 2),  # a little background work still leaves both cores
        (2, 1.7, 1, 1),  # more than a quarter of a core taken: one thread
        (2, 0.9, 1, 1),  # one other busy process
        (2, 0.0, 1, 1),  # a machine kept busy: never fewer than one
        (8, 6.0, 2, 3),  # two processes of a run share the free cores
        (2, None, 1, 2),  # nothing known about the load: every usable core
    ],
)
def test_threads_zero_gives_one_thread_per_free_core(monkeypatch, usable, idle, processes, threads):
    monkeypatch.setattr(runtime_module, "usable_cores", lambda: usable)
    monkeypatch.setattr(runtime_module, "idle_cores", lambda: idle)
    assert runtime_module.auto_threads(processes)[0] == threads


def test_threads_zero_sets_the_chosen_count_and_says_why(tmp_path, data_dir, monkeypatch, capsys):
    before = torch.get_num_threads()
    monkeypatch.setattr(runtime_module, "auto_threads", lambda processes: (1, "2 usable core(s), 0.3 idle"))
    try:
        Trainer(tiny_config(tmp_path / "run", data_dir, train__threads=0, train__max_iters=1)).fit()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert "1 CPU thread(s), chosen by train.threads=0 from 2 usable core(s), 0.3 idle" in capsys.readouterr().out


def test_idle_cores_are_measured_on_this_machine():
    """Where /proc/stat exists (Linux), the measure is a number of cores between none and all."""
    idle = runtime_module.idle_cores(0.05)
    assert idle is None or 0 <= idle <= os.cpu_count()
    assert 1 <= runtime_module.usable_cores() <= os.cpu_count()


def test_slowdown_watch_speaks_once_after_several_slow_intervals():
    watch = SlowdownWatch()
    rates = [100.0, 3000.0, 3200.0, 900.0, 900.0, 3100.0, 900.0, 900.0, 900.0, 900.0, 100.0]
    said = [watch.update(rate) for rate in rates]
    # the first interval (start-up) is not counted; one slow pair between fast ones is a hiccup
    assert said == [None] * 8 + [3200.0, None, None]


def test_a_run_that_slows_down_far_below_its_earlier_rate_says_so_once(tmp_path, data_dir, monkeypatch, capsys):
    rates = iter([1000.0, 3600.0, 3600.0] + [700.0] * 100)
    monkeypatch.setattr(Throughput, "measure", lambda self, step: {"tokens_per_sec": next(rates)})
    Trainer(tiny_config(tmp_path / "run", data_dir, train__max_iters=12)).fit()
    out = capsys.readouterr().out + capsys.readouterr().err
    notes = [line for line in out.splitlines() if "note: training runs at" in line]
    assert len(notes) == 1, out
    assert "700 tokens/s, under a third of the 3,600" in notes[0] and "--train.threads=1" in notes[0]
