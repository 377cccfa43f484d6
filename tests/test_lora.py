"""LoRA: adapters beside frozen weights, their checkpoints, merging, and the PEFT and merged exports."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from errors import ConfigError, UserError
from finetune.lora import LoRALinear, add_adapters, merge_adapters
from inference.load import model_from_checkpoint
from interop.peft import export_run_adapter
from interop.pretrained import check_export_folder, export_model
from tests.conftest import run_script, snapshot, tiny_config, tiny_model
from trainer.checkpoint import load_checkpoint
from trainer.config import LoraConfig, load_config
from trainer.loop import Trainer

ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
# a Qwen3-shaped tiny model: rotary positions, RMSNorm, QK-norm, SwiGLU, grouped-query attention, untied head
QWEN3 = dict(model__pos_emb="rope", model__norm="rmsnorm", model__qk_norm=True, model__mlp="swiglu",
             model__bias=False, model__n_kv_head=1, model__tie_embeddings=False)  # fmt: skip


def train_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir):
    """A tiny Qwen3-shaped run of a few steps, and the Hugging Face folder it exports to."""
    root = tmp_path_factory.mktemp("lora_base")
    Trainer(tiny_config(root / "run", data_dir, train__max_iters=4, train__eval_interval=4, **QWEN3)).fit()
    model, tokenizer = model_from_checkpoint(load_checkpoint(root / "run" / "ckpt.pt"), root / "run" / "ckpt.pt")
    export_model(model, tokenizer, root / "hf")
    return root


def lora_config(out, data_dir, init_from, **overrides):
    values = dict(train__max_iters=6, train__eval_interval=6, train__init_from=str(init_from), lora__rank=4,
                  lora__targets=ALL, optim__learning_rate=1e-2, optim__warmup_iters=0)  # fmt: skip
    return tiny_config(out, data_dir, **values | overrides)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, data_dir, base):
    """A LoRA run on the exported folder, trained for a few steps at a high rate: B is far from zero."""
    out = tmp_path_factory.mktemp("lora") / "run"
    Trainer(lora_config(out, data_dir, base / "hf")).fit()
    return out


def test_merged_weight_is_base_plus_scale_times_b_a():
    model = tiny_model()
    base = model.transformer.h[0].attn.c_proj.weight.detach().clone()
    add_adapters(model, LoraConfig(rank=2, alpha=6.0, targets="o_proj"))
    wrapper = model.transformer.h[0].attn.c_proj
    assert isinstance(wrapper, LoRALinear)
    torch.nn.init.normal_(wrapper.lora_B["o_proj"])
    a, b = wrapper.lora_A["o_proj"].detach().clone(), wrapper.lora_B["o_proj"].detach().clone()
    merge_adapters(model)
    merged = model.transformer.h[0].attn.c_proj
    assert type(merged) is torch.nn.Linear
    torch.testing.assert_close(merged.weight, base + 6.0 / 2 * b @ a, rtol=0, atol=1e-6)


def test_merged_logits_equal_adapters_applied_on_the_fly():
    torch.manual_seed(0)
    model = tiny_model(mlp="swiglu", n_kv_head=1, pos_emb="rope")
    add_adapters(model, LoraConfig(rank=3, targets="q_proj,v_proj,gate_proj,down_proj"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        on_the_fly, _ = model(x, x)
        merged, _ = merge_adapters(model)(x, x)
    torch.testing.assert_close(merged, on_the_fly, rtol=1e-5, atol=1e-5)


def test_a_fused_layer_gets_one_adapter_per_projection_and_others_unchanged():
    model = tiny_model(n_kv_head=1)
    add_adapters(model, LoraConfig(rank=2, targets="k_proj"))
    wrapper = model.transformer.h[0].attn.c_attn
    assert list(wrapper.lora_A) == ["k_proj"] and wrapper.lora_B["k_proj"].shape == (16, 2)
    torch.nn.init.normal_(wrapper.lora_B["k_proj"])
    delta = wrapper.delta_weight()
    assert delta[:32].abs().sum() == 0 and delta[48:].abs().sum() == 0 and delta[32:48].abs().sum() > 0


def test_lora_trains_only_the_adapters_and_checkpoints_them_with_the_base(lora_run, base):
    checkpoint = load_checkpoint(lora_run / "ckpt.pt")
    assert checkpoint["model"] and all(".lora_" in name for name in checkpoint["model"])
    assert checkpoint["lora"]["source"] == str((base / "hf").resolve())
    assert len(checkpoint["lora"]["fingerprint"]) == 64
    assert len(checkpoint["optimizer"]["state"]) == len(checkpoint["model"])
    assert any(t.abs().sum() > 0 for name, t in checkpoint["model"].items() if "lora_B" in name)


def test_lora_resumed_run_matches_an_uninterrupted_one(tmp_path, data_dir, base):
    common = dict(lora__dropout=0.1, model__dropout=0.1, train__max_iters=8, train__eval_interval=4, **QWEN3)
    Trainer(lora_config(tmp_path / "whole", data_dir, base / "run", **common)).fit()
    Trainer(lora_config(tmp_path / "split", data_dir, base / "run", **common | {"train__max_iters": 4})).fit()
    resumed = Trainer(lora_config(tmp_path / "split", data_dir, "resume", **common))
    assert resumed.step == 4
    resumed.fit()
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")


def resumed(run, tmp_path, *overrides):
    """The config that resumes a copy of run (in tmp_path) with overrides, as its config.toml reads."""
    copy = shutil.copytree(run, tmp_path / "run")
    return copy, load_config(str(copy / "config.toml"), ["--train.init_from=resume", *overrides])


@pytest.mark.parametrize(
    "override, message",
    [
        ("--lora.alpha=32", "lora.alpha=32.0 but the run in {run} was trained with 16.0, which a resumed run cannot"),
        ("--lora.rank=2", "lora.rank=2 but the run in {run} was trained with 4"),
        ("--lora.targets=q_proj", "lora.targets='q_proj' but the run in {run} was trained with"),
    ],
)
def test_a_lora_run_resumed_with_adapters_that_compute_otherwise_is_refused_naming_the_key(
    override, message, lora_run, tmp_path
):
    run, cfg = resumed(lora_run, tmp_path, override)
    before = snapshot(run)
    with pytest.raises(UserError, match=re.escape(message.format(run=run))):
        Trainer(cfg)
    assert snapshot(run) == before


def test_a_lora_run_resumes_with_another_dropout_or_base_dtype(lora_run, tmp_path):
    """Dropout and the frozen weights' dtype act only while training: what the checkpoint computes is the same."""
    _, cfg = resumed(lora_run, tmp_path, "--lora.dropout=0.1", "--model.dropout=0.1", "--lora.base_dtype=bfloat16",
                     "--train.dtype=bfloat16", "--train.max_iters=8")  # fmt: skip
    trainer = Trainer(cfg)
    assert trainer.step == 6 and trainer.cfg.lora.dropout == 0.1
    assert trainer.fit() is None


def test_an_adapter_scale_that_throws_the_weights_away_is_refused(tmp_path, data_dir):
    """alpha / rank multiplies every step of the adapters: at alpha=1e30 their gradients' squares overflow
    float32, each step of B is zero and nothing trains; at any alpha / rank * learning_rate above 1 a
    step moves the model as no learning rate this trainer accepts would."""
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "lora.alpha=1e+30 is outside the accepted range (0, 400] for lora.rank=4 and optim.learning_rate=0.01"
        ),
    ):
        lora_config(tmp_path / "run", data_dir, "models/base", lora__alpha=1e30)
    with pytest.raises(ConfigError, match=re.escape("(0, 200] for lora.rank=4 and optim.muon_lr=0.02")):
        lora_config(tmp_path / "run", data_dir, "models/base", lora__alpha=201.0, optim__optimizer="muon")
    assert lora_config(tmp_path / "run", data_dir, "models/base", lora__alpha=400.0).lora.alpha == 400.0


def test_a_changed_base_is_refused(tmp_path, data_dir, base):
    import shutil

    shutil.copytree(base / "hf", tmp_path / "hf")
    Trainer(lora_config(tmp_path / "run", data_dir, tmp_path / "hf", train__max_iters=2)).fit()
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="has changed since the adapters"):
        model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), tmp_path / "run" / "ckpt.pt")


def test_merged_export_loads_in_transformers_with_the_same_logits(lora_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours, tokenizer = model_from_checkpoint(load_checkpoint(lora_run / "ckpt.pt"), lora_run / "ckpt.pt")
    export_model(ours, tokenizer, tmp_path / "merged")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    x = torch.randint(0, tokenizer.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, ours(x, x)[0], rtol=1e-4, atol=1e-4)


def test_peft_loads_the_exported_adapter_onto_the_base_with_our_logits(lora_run, base, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    export_run_adapter(lora_run, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base / "hf")
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    ours, tokenizer = model_from_checkpoint(load_checkpoint(lora_run / "ckpt.pt"), lora_run / "ckpt.pt")
    x = torch.randint(0, tokenizer.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with theirs.disable_adapter():
            unadapted = theirs(x).logits
        adapted = theirs(x).logits
    assert not torch.allclose(adapted, unadapted, atol=1e-3)  # the adapters change the logits
    torch.testing.assert_close(adapted, ours(x, x)[0], rtol=1e-4, atol=1e-4)


def test_sample_py_samples_and_exports_a_lora_run(lora_run, tmp_path):
    sampled = run_script("sample.py", "--out-dir", str(lora_run), "--prompt", "RO", "--max-new-tokens", "5",
                         "--device", "cpu")  # fmt: skip
    assert sampled.returncode == 0 and sampled.stdout.startswith("RO"), sampled.stderr
    exported = run_script("sample.py", "--out-dir", str(lora_run), "--export-adapter", str(tmp_path / "adapter"))
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_a_bfloat16_base_keeps_float32_adapters_and_trains(tmp_path, data_dir, base):
    """lora.base_dtype=bfloat16 halves the frozen weights' memory; the adapters, the only trained
    tensors, stay float32 (here on the CPU, whose autocast computes in bfloat16 as a GPU's does)."""
    trainer = Trainer(lora_config(tmp_path / "run", data_dir, base / "run", lora__base_dtype="bfloat16",
                                  train__dtype="bfloat16"))  # fmt: skip
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen if p.dim() == 2)
    assert trained and all(p.dtype == torch.float32 for p in trained)
    before = [p.detach().clone() for p in trained]
    assert trainer.fit() is None
    assert any(not torch.equal(b, p) for b, p in zip(before, trained, strict=True))
    assert all(torch.isfinite(p).all() for p in trained)


def test_an_exported_adapter_names_its_base_as_given_and_loads_in_peft_where_both_have_moved(
    base, data_dir, tmp_path, monkeypatch
):
    """adapter_config.json records the base as train.init_from gave it (here a relative path), not as an
    absolute path of the machine it was made on: the adapter and its base, moved together, still load."""
    peft = pytest.importorskip("peft")
    project = tmp_path / "project"
    shutil.copytree(base / "hf", project / "models" / "base")
    monkeypatch.chdir(project)
    Trainer(lora_config(Path("out/lora"), data_dir, "models/base")).fit()
    export_run_adapter("out/lora", Path("adapter"))
    assert json.loads(Path("adapter/adapter_config.json").read_text())["base_model_name_or_path"] == "models/base"
    ours, tokenizer = model_from_checkpoint(load_checkpoint(Path("out/lora/ckpt.pt")), Path("out/lora/ckpt.pt"))
    x = torch.randint(0, tokenizer.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(x, x)[0]
    project.rename(tmp_path / "elsewhere")
    monkeypatch.chdir(tmp_path / "elsewhere")
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained("adapter").eval()  # the base read from the config
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, expected, rtol=1e-4, atol=1e-4)


def test_export_adapter_refuses_a_model_folder_and_leaves_it_as_it_was(lora_run, base, tmp_path):
    """An adapter_config.json beside a model's weights makes transformers load that folder as the model
    with the adapter applied, while this trainer loads the model alone."""
    folder = shutil.copytree(base / "hf", tmp_path / "hf")
    before = snapshot(folder)
    with pytest.raises(UserError, match=re.escape(f"--export-adapter={str(folder)!r} already holds config.json")):
        export_run_adapter(lora_run, folder)
    assert snapshot(folder) == before


def test_export_refuses_a_folder_holding_an_adapter(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match="already holds adapter_config.json"):
        check_export_folder(tmp_path / "adapter")
