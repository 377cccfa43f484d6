"""Architecture switches (pos_emb, norm, qk_norm, mlp, n_kv_head, head_dim, tie_embeddings, logit_softcap):
each trains, stays causal, decodes through the cache as the full forward pass does, and is refused
where GPT-2 is required."""

import math
import re

import pytest
import torch

from data.tokenizer import GPT2Tokenizer
from errors import ConfigError, UserError
from finetune.init_from import with_pretrained_shape
from interop.families import FAMILY_BY_TYPE
from interop.pretrained import Pretrained, export_model
from model import GPT, GPTConfig
from tests.conftest import tiny_model
from tests.test_kv_cache import decode_with_cache
from trainer.config import build_config, load_config

VOCAB = 50
BLOCK = 32
VARIANTS = {
    "rmsnorm": {"norm": "rmsnorm"},
    "relu2": {"mlp": "relu2"},
    "swiglu": {"mlp": "swiglu"},
    "untied": {"tie_embeddings": False},
    "softcap": {"logit_softcap": 15.0},
    "rope": {"pos_emb": "rope"},
    "qk_norm": {"qk_norm": True},
    "gqa": {"n_kv_head": 1},
    "wide_heads": {"head_dim": 24},  # heads of 24 where n_embd / n_head is 16 (32 / 2 in tiny_model)
    "narrow_heads": {"head_dim": 6},
    "all": {
        "pos_emb": "rope",
        "norm": "rmsnorm",
        "qk_norm": True,
        "mlp": "swiglu",
        "n_kv_head": 1,
        "head_dim": 10,
        "tie_embeddings": False,
        "logit_softcap": 15.0,
        "bias": False,
    },
}


def randomised(variant: dict) -> GPT:
    """A tiny model of the variant whose zero-initialised head is made random, so that every
    logit depends on the input (a zero head would hide causality and cache mistakes)."""
    model = tiny_model(VOCAB, BLOCK, **variant)
    if not model.config.tie_embeddings:
        torch.nn.init.normal_(model.lm_head.weight, std=0.02, generator=torch.Generator().manual_seed(2))
    return model


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_variant_learns_a_batch(variant):
    learns_a_batch(tiny_model(VOCAB, BLOCK, **variant))


def learns_a_batch(model: GPT) -> None:
    """15 AdamW steps on one batch lower the model's loss on it by more than 1."""
    model.train()
    idx = torch.randint(0, VOCAB, (4, BLOCK), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_variant_is_causal(variant):
    model = randomised(variant)
    idx = torch.randint(0, VOCAB, (2, BLOCK), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 11:] = (idx[:, 11:] + 1) % VOCAB
    logits, _ = model(idx)
    changed_logits, _ = model(changed)
    assert torch.equal(logits[:, :11], changed_logits[:, :11])
    assert not torch.allclose(logits[:, 11:], changed_logits[:, 11:])


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_variant_decodes_through_the_cache_as_the_full_forward_pass(variant):
    model = randomised(variant)
    idx = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(1))
    full, _ = model(idx)
    for static in (False, True):
        cached = decode_with_cache(model, idx, prompt_len=7, static=static)
        assert (cached - full).abs().max().item() < 1e-5


def test_swiglu_has_about_the_parameters_of_the_gelu_mlp():
    gelu = tiny_model(VOCAB, BLOCK).num_params()
    swiglu = tiny_model(VOCAB, BLOCK, mlp="swiglu").num_params()
    assert swiglu != gelu and abs(swiglu - gelu) / gelu < 0.01


def test_rmsnorm_has_gains_and_no_biases():
    model = tiny_model(VOCAB, BLOCK, norm="rmsnorm")
    norms = {name for name in model.state_dict() if ".ln_" in name or "ln_f" in name}
    assert norms == {"transformer.ln_f.weight"} | {f"transformer.h.{i}.ln_{j}.weight" for i in (0, 1) for j in (1, 2)}


def test_untied_head_has_its_own_zero_weights_and_starts_uniform():
    model = tiny_model(VOCAB, BLOCK, tie_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.all(model.lm_head.weight == 0)
    idx = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    _, loss = model(idx, idx)
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=1e-6)
    tied = tiny_model(VOCAB, BLOCK)
    assert model.num_params(non_embedding=False) == tied.num_params(non_embedding=False) + VOCAB * 32


def test_softcap_bounds_the_logits():
    model = randomised({"logit_softcap": 2.0})
    with torch.no_grad():
        model.lm_head.weight.mul_(1000)
    logits, _ = model(torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1)))
    assert logits.abs().max().item() <= 2.0 and logits.abs().max().item() > 1.9


def test_defaults_build_gpt2s_modules():
    model = tiny_model(VOCAB, BLOCK)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.transformer.ln_f, torch.nn.LayerNorm) and isinstance(model.softcap, torch.nn.Identity)
    assert isinstance(model.transformer.h[0].mlp.act, torch.nn.GELU)
    assert model.transformer.h[0].mlp.act.approximate == "tanh"


@pytest.mark.parametrize(
    "norm,bias,kind",
    [
        ("layernorm", True, torch.nn.LayerNorm),
        ("layernorm", False, torch.nn.LayerNorm),
        ("rmsnorm", False, torch.nn.RMSNorm),
    ],
)
def test_qk_norm_is_the_blocks_normalisation_over_one_head(norm, bias, kind):
    attention = tiny_model(VOCAB, BLOCK, norm=norm, bias=bias, qk_norm=True).transformer.h[0].attn
    head_dim = 32 // 2
    for qk in (attention.q_norm, attention.k_norm):
        assert type(qk) is kind and tuple(qk.normalized_shape) == (head_dim,)
        assert (getattr(qk, "bias", None) is not None) == (kind is torch.nn.LayerNorm and bias)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_config_counts_the_parameters_of_each_variant(variant):
    config = GPTConfig(n_layer=3, n_head=2, n_embd=12, block_size=5, vocab_size=11, **variant)
    assert config.num_params() == GPT(config).num_params(non_embedding=False)


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.norm=batchnorm", r"^model.norm='batchnorm' is not one of layernorm, rmsnorm$"),
        ("--model.mlp=relu", r"^model.mlp='relu' is not one of gelu, relu2, swiglu$"),
        ("--model.logit_softcap=-1", r"^model.logit_softcap=-1.0 must be 0 \(off\) or a positive cap$"),
    ],
)
def test_bad_variant_values_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_export_refuses_a_variant_no_family_computes_naming_one_of_its_keys(variant, tmp_path):
    """Each variant on GPT-2's other switches (docs/models.md: the families compute them in other
    combinations, never with learned positions, LayerNorm and GELU)."""
    model = tiny_model(VOCAB, BLOCK, **variant)
    with pytest.raises(UserError, match=r"^--export cannot write this model: model\.") as error:
        export_model(model, GPT2Tokenizer(), tmp_path / "export")
    named = re.match(r"^--export cannot write this model: model\.(\w+)", str(error.value)).group(1)
    assert named in variant
    assert not (tmp_path / "export").exists()


def test_fine_tuning_refuses_a_run_that_sets_another_architecture_than_the_folder(tmp_path):
    cfg = build_config({"model": {"mlp": "swiglu"}, "train": {"init_from": str(tmp_path)}})
    gpt2 = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=1024, vocab_size=50257)
    folder = Pretrained(FAMILY_BY_TYPE["gpt2"], gpt2, {}, tmp_path)
    message = (
        r"holds a gpt2 model with model.mlp=\"gelu\", but the run sets model.mlp=\"swiglu\" "
        r".* set model.mlp=\"gelu\" or leave it out\)$"
    )
    with pytest.raises(UserError, match=message):
        with_pretrained_shape(cfg, folder, {"tokenizer": "gpt2"})
