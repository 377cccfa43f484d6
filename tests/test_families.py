"""The Hugging Face families of interop/families.py, checked against transformers itself on tiny
random models built with its own config classes (no download): import and export give the logits
of transformers within 1e-4 in float32 and its greedy tokens, export then import gives back the
same weights bit for bit, and every key or switch a family cannot compute is refused by name."""

import ast
import dataclasses
import inspect
import json

import pytest
import torch

from data.tokenizer import CharTokenizer, GPT2Tokenizer, JsonTokenizer, train_bpe
from errors import UserError
from interop.families import (
    CONVERSIONS,
    FAMILIES,
    FAMILY_BY_TYPE,
    ROPE_KEYS,
    config_from_hf,
    family_for,
    ignored_keys,
    markdown_tables,
    switches,
)
from interop.hf import load_dir
from interop.pretrained import export_model, model_from_pretrained
from model import GPT, generate
from model.rope import rope_frequencies
from tests.conftest import PROJECT_ROOT, run_script, tiny_config, tiny_model
from trainer.config import load_config
from trainer.loop import Trainer

transformers = pytest.importorskip("transformers")

VOCAB = 61
TOKENIZER = CharTokenizer("".join(chr(c) for c in range(ord("A"), ord("A") + VOCAB)))
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=48,
)  # fmt: skip
# each family with the switch combinations it computes, as transformers' own config classes
HF_MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, rms_norm_eps=1e-5)),
    "llama-gqa-tied-biased": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SIZES,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        )
    ),  # fmt: skip
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SIZES, head_dim=16, num_key_value_heads=4)
    ),
    "qwen3-gqa-tied": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SIZES, head_dim=16, num_key_value_heads=1, tie_word_embeddings=True)
    ),
    # heads wider than hidden_size / num_attention_heads = 16, as Qwen3-0.6B's (128 where 1024 / 16 = 64)
    "qwen3-wide-heads-gqa": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**SIZES, head_dim=32, num_key_value_heads=2, tie_word_embeddings=True)
    ),
    "llama-wide-heads": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, head_dim=32)),
    "llama-narrow-heads-gqa": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**SIZES, head_dim=8, num_key_value_heads=2)
    ),
    "stablelm-qk-norm-gqa": lambda: transformers.StableLmForCausalLM(
        transformers.StableLmConfig(
            **SIZES,
            num_key_value_heads=2,
            qk_layernorm=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        )
    ),  # fmt: skip
    "stablelm": lambda: transformers.StableLmForCausalLM(
        transformers.StableLmConfig(
            **SIZES,
            num_key_value_heads=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        )
    ),
    "mistral-window": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**SIZES, head_dim=16, num_key_value_heads=2, sliding_window=8)
    ),
    "qwen2-gqa-tied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SIZES, num_key_value_heads=2, tie_word_embeddings=True)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES, num_key_value_heads=4)),
    # Llama 3.1's stretched RoPE over a pretrained context of 32 positions: heads of 16 have one pair
    # kept, one blended and six divided
    "llama-llama3-rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **SIZES,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),  # fmt: skip
    # YaRN as Qwen2.5's model card sets it for a long context
    "qwen2-yarn-rope": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(
            **SIZES,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),  # fmt: skip
    "stablelm-qkv-bias": lambda: transformers.StableLmForCausalLM(
        transformers.StableLmConfig(
            **SIZES,
            num_key_value_heads=4,
            use_qkv_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        )
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        # GPT2Config's end-of-text id defaults to GPT-2's 50256, outside this vocabulary: a folder that
        # names a token it lacks is refused on import
        transformers.GPT2Config(
            n_layer=2, n_head=4, n_embd=64, n_positions=48, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
    ),
}
# our switch combinations, each with the family it exports to
OUR_MODELS = {
    "gpt2": ({}, "gpt2"),
    "gpt2-no-bias": ({"bias": False}, "gpt2"),
    "llama": ({"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}, "llama"),
    "llama-biased-untied-gqa": (
        {
            "pos_emb": "rope",
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "n_kv_head": 1,
            "tie_embeddings": False,
            "rope_base": 500.0,
        },
        "llama",
    ),
    "qwen3": ({"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "bias": False}, "qwen3"),
    "qwen3-wide-heads": (
        {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "bias": False, "head_dim": 32},
        "qwen3",
    ),
    "llama-narrow-heads-gqa": (
        {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "head_dim": 8, "n_kv_head": 1},
        "llama",
    ),
    "mistral-wide-heads": (
        {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "attn_window": 5, "head_dim": 24},
        "mistral",
    ),
    "qwen3-untied-gqa-eps": (
        {
            "pos_emb": "rope",
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "qk_norm": True,
            "bias": False,
            "n_kv_head": 1,
            "tie_embeddings": False,
            "norm_eps": 1e-6,
            "mlp_width": 40,
        },
        "qwen3",
    ),  # fmt: skip
    "qwen2": ({"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "qkv_bias": True}, "qwen2"),
    "qwen2-gqa-untied-yarn": (
        {
            "pos_emb": "rope",
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "bias": False,
            "qkv_bias": True,
            "n_kv_head": 1,
            "tie_embeddings": False,
            "rope_scaling": "yarn",
            "rope_factor": 4.0,
            "rope_original_context": 12,
        },
        "qwen2",
    ),  # fmt: skip
    "llama-llama3-rope": (
        {
            "pos_emb": "rope",
            "norm": "rmsnorm",
            "mlp": "swiglu",
            "bias": False,
            "n_kv_head": 1,
            "rope_scaling": "llama3",
            "rope_factor": 8.0,
            "rope_original_context": 32,
            "rope_base": 10000.0,
        },
        "llama",
    ),  # fmt: skip
    "stablelm-quickstart": (
        {"pos_emb": "rope", "norm": "layernorm", "mlp": "swiglu", "qk_norm": True, "bias": False, "n_kv_head": 1},
        "stablelm",
    ),
    "stablelm-untied": ({"pos_emb": "rope", "mlp": "swiglu", "bias": False, "tie_embeddings": False}, "stablelm"),
    "mistral-window": (
        {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "attn_window": 5},
        "mistral",
    ),
}


def trained_like(model: torch.nn.Module, seed: int, keep_zero: tuple[str, ...] = ()) -> torch.nn.Module:
    """Every weight moved off its initial value (norm gains off 1, biases off 0), as training would,
    so that a tensor mapped to the wrong place shows; names ending in keep_zero stay as they are."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(keep_zero):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


def hf_reference(key: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = HF_MODELS[key]()
    if key.startswith("stablelm"):
        # StableLM always has LayerNorm biases and a QK-norm per head; ours have no bias and one
        # QK-norm shared by the heads: the weights it can hold that ours compute too
        trained_like(model, 1, keep_zero=("layernorm.bias", "norm.bias"))
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, transformers.models.stablelm.modeling_stablelm.StableLmLayerNormPerHead):
                    for norm in module.norms[1:]:
                        norm.weight.copy_(module.norms[0].weight)
        return model.eval()
    return trained_like(model, 1)


def tokens(rows: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(2))


def assert_same_logits(ours: GPT, reference: torch.nn.Module) -> None:
    idx = tokens()
    with torch.no_grad():
        difference = (ours(idx)[0] - reference(idx).logits).abs().max().item()
    assert difference < 1e-4


def assert_same_greedy_tokens(ours: GPT, reference: torch.nn.Module, new_tokens: int = 20) -> None:
    prompt = tokens(1, 8)
    steps = generate(ours, prompt, new_tokens, temperature=0.0)
    ours_ids = [int(step[0]) for step in steps]
    with torch.no_grad():
        output = reference.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert ours_ids == output[0, prompt.size(1) :].tolist()


@pytest.mark.parametrize("key", HF_MODELS)
def test_imported_model_computes_what_transformers_computes(key, tmp_path):
    reference = hf_reference(key)
    reference.save_pretrained(tmp_path / "hf")
    family, config, state = load_dir(tmp_path / "hf")
    assert family.model_type == key.split("-")[0]
    ours = GPT(config).eval()
    ours.load_state_dict(state)
    assert_same_logits(ours, reference)
    assert_same_greedy_tokens(ours, reference)
    # and back: the export is the family's, holding the very tensors transformers wrote
    assert family_for(config) is family
    export_model(ours, TOKENIZER, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(reference)
    hf_state = reference.state_dict()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, hf_state[name]), name


@pytest.mark.parametrize("key", OUR_MODELS)
def test_exported_model_loads_in_transformers_and_computes_the_same(key, tmp_path):
    switches_, family = OUR_MODELS[key]
    model = trained_like(tiny_model(VOCAB, 48, **switches_), 3)
    assert export_model(model, TOKENIZER, tmp_path / "export").model_type == family
    reference, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(reference).__name__ == FAMILY_BY_TYPE[family].architecture
    reference.eval()
    assert_same_logits(model, reference)
    assert_same_greedy_tokens(model, reference)
    _, config, state = load_dir(tmp_path / "export")
    assert config == model.config
    for name, tensor in model.state_dict().items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


@pytest.mark.parametrize("head_dim", [0, 24], ids=["heads-n_embd-over-n_head", "wide-heads"])
@pytest.mark.parametrize("name", CONVERSIONS)
def test_each_tensor_conversion_round_trips_bit_for_bit(name, head_dim):
    config = tiny_model(VOCAB, 48, pos_emb="rope", mlp="swiglu", n_kv_head=1, mlp_width=40, head_dim=head_dim).config
    D = config.head_size
    sizes = {"fused_qkv": (config.n_head + 2) * D, "fused_gate_up": 2 * config.mlp_hidden}
    tensor = torch.randn(sizes.get(name, D), config.n_embd)
    if name == "per_head":
        tensor = torch.randn(D)
    conversion = CONVERSIONS[name]
    theirs = conversion.to_theirs(tensor, config, 3)
    assert torch.equal(conversion.to_ours(theirs, config), tensor)


@pytest.mark.parametrize("head_dim", [0, 24], ids=["heads-n_embd-over-n_head", "wide-heads"])
def test_fused_qkv_splits_into_queries_keys_values_in_that_order(head_dim):
    model = tiny_model(VOCAB, 48, n_kv_head=1, head_dim=head_dim)
    weight = model.transformer.h[0].attn.c_attn.weight
    q, k, v = CONVERSIONS["fused_qkv"].to_theirs(weight, model.config, 3)
    Q, kv = model.config.n_head * model.config.head_size, model.config.head_size  # 2 query heads, 1 key/value head
    assert torch.equal(q, weight[:Q]) and torch.equal(k, weight[Q : Q + kv]) and torch.equal(v, weight[Q + kv :])


def test_per_head_norms_that_differ_are_refused(tmp_path):
    reference = hf_reference("stablelm-qk-norm-gqa")
    with torch.no_grad():
        reference.model.layers[1].self_attn.k_layernorm.norms[1].weight.add_(1.0)
    reference.save_pretrained(tmp_path / "hf")
    with pytest.raises(
        UserError, match=r"k_layernorm.norms.0.weight cannot be read \(its heads have norm weights that differ"
    ):
        model_from_pretrained(str(tmp_path / "hf"), key="--init-from")


def test_stablelm_norm_biases_we_lack_are_refused_unless_zero(tmp_path):
    reference = trained_like(HF_MODELS["stablelm"](), 1)
    reference.save_pretrained(tmp_path / "hf")
    with pytest.raises(UserError, match="input_layernorm.bias is not zero, and this stablelm model has no biases"):
        model_from_pretrained(str(tmp_path / "hf"), key="--init-from")


EXPORT_REFUSALS = {
    "softcap": ({"logit_softcap": 15.0}, r"model.logit_softcap=15.0 is computed by no Hugging Face family .*only a model with model.logit_softcap=0.0 exports"),
    "relu2": ({"mlp": "relu2"}, r"model.mlp='relu2' is computed by no Hugging Face family .*one of gelu, swiglu"),
    "sinks": ({"attn_window": 8, "attn_sinks": 2}, r"model.attn_sinks=2 is computed by no Hugging Face family"),
    "prefix-lm": ({"attn_prefix_lm": True}, r"model.attn_prefix_lm=true is computed by no Hugging Face family"),
    "block-causal": ({"attn_block": 4}, r"model.attn_block=4 is computed by no Hugging Face family"),
    "documents": ({"attn_documents": True, "eot_token": 0}, r"model.attn_documents=true is computed by no"),
    "rmsnorm-with-learned-positions": ({"norm": "rmsnorm"}, r"model.norm='rmsnorm' with this model's other switches is computed by no Hugging Face family: the nearest, gpt2, needs model.norm='layernorm'$"),
    "gpt2-with-grouped-query": ({"n_kv_head": 1}, r"model.n_kv_head \(fewer key/value heads than query heads\) with this model's other switches is computed by no Hugging Face family: the nearest, gpt2, needs model.n_kv_head=0$"),
    "qk-norm-with-rmsnorm-and-bias": ({"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True}, r"model.qk_norm=true with this model's other switches .* the nearest, llama, needs model.qk_norm=false$"),
    "window-with-gpt2": ({"attn_window": 8}, r"model.attn_window=8 with .* the nearest, gpt2, needs model.attn_window=0$"),
    "gpt2-with-wide-heads": ({"head_dim": 32}, r"model.head_dim=32 with this model's other switches is computed by no Hugging Face family: the nearest, gpt2, needs model.head_dim=0 \(heads n_embd / n_head wide\)$"),
    "stablelm-with-narrow-heads": ({"pos_emb": "rope", "mlp": "swiglu", "bias": False, "head_dim": 8}, r"model.norm='layernorm' with .* the nearest, llama, needs model.norm='rmsnorm'$"),
}  # fmt: skip


@pytest.mark.parametrize("key", EXPORT_REFUSALS)
def test_a_model_no_family_computes_is_refused_naming_the_switch(key, tmp_path):
    switches_, message = EXPORT_REFUSALS[key]
    model = tiny_model(VOCAB, 48, **switches_)
    with pytest.raises(UserError, match=r"^--export cannot write this model: " + message):
        export_model(model, TOKENIZER, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_model_with_weights_that_are_not_numbers_is_not_exported(tmp_path):
    model = tiny_model(VOCAB, 48, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.weight[3, 4] = float("nan")
    message = r"^--export cannot write this model: its weight transformer.h.1.attn.c_proj.weight holds 1 NaN and 0"
    with pytest.raises(UserError, match=message):
        export_model(model, TOKENIZER, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def llama_config(config_class=transformers.LlamaConfig, **changes) -> dict:
    config = config_class(**SIZES).to_diff_dict()
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


IMPORT_REFUSALS = {
    "linear-rope": (llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 8.0}), r"sets rope_parameters.rope_type='linear'; this model computes only 'default' or 'llama3' or 'yarn'"),
    "old-rope-scaling": (llama_config(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "dynamic", "factor": 2.0}), r"sets rope_scaling.type='dynamic'; this model computes only 'default' or 'llama3' or 'yarn'"),
    "llama3-rope-without-its-numbers": (llama_config(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}), r"lacks rope_parameters.low_freq_factor, which a llama3 RoPE needs"),
    "rope-factor-not-a-number": (llama_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": "4"}), r"sets rope_parameters.factor='4', which is not a positive number"),
    "partial-rotary": (llama_config(transformers.StableLmConfig), r"sets rope_parameters.partial_rotary_factor=0.25; this model computes only 1.0"),
    "partial-rotary-left-out": ({k: v for k, v in llama_config(transformers.StableLmConfig).items() if k != "rope_parameters"}, r"leaves partial_rotary_factor out, which means 0.25; this model computes only 1.0"),
    "biases-that-differ": (llama_config(attention_bias=True, mlp_bias=False), r"sets attention_bias=True and mlp_bias=False; this model has biases everywhere or nowhere"),
    "qwen3-attention-bias": (llama_config(transformers.Qwen3Config, attention_bias=True), r"sets attention_bias=True; this model computes only False"),
    "qwen2-sliding-window": (llama_config(transformers.Qwen2Config, num_key_value_heads=4, use_sliding_window=True), r"sets use_sliding_window=True; this model computes only False"),
    "heads-that-do-not-divide": ({"model_type": "gpt2", "n_embd": 64, "n_head": 3, "vocab_size": VOCAB}, r"sets n_embd=64 and n_head=3, which does not divide it: a gpt2 model's heads are n_embd / n_head wide"),
    "stablelm-head-dim": (llama_config(transformers.StableLmConfig, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}, head_dim=32), r"sets head_dim=32, a key transformers' stablelm model reads and this model does not compute"),
    "encoder-decoder": (llama_config(is_encoder_decoder=True), r"sets is_encoder_decoder=True; this model computes only False"),
    "moe-family": ({**llama_config(), "model_type": "qwen3_moe"}, r"has model_type='qwen3_moe', a family this model cannot compute \(it reads gpt2, llama, qwen2, qwen3, stablelm, mistral\)"),
    "activation": (llama_config(hidden_act="gelu"), r"sets hidden_act='gelu'; this model computes only 'silu'"),
    "sliding-layers": (llama_config(transformers.Qwen3Config, head_dim=16, num_key_value_heads=4, layer_types=["sliding_attention", "full_attention"]), r"sets layer_types with \['full_attention', 'sliding_attention'\]; this model computes only full_attention"),
    "missing-size": (llama_config(num_hidden_layers=None), r"lacks num_hidden_layers: it is not a complete llama config.json"),
    "size-not-an-integer": (llama_config(hidden_size=64.5), r"sets hidden_size=64.5, which is not a positive integer"),
}  # fmt: skip


@pytest.mark.parametrize("key", IMPORT_REFUSALS)
def test_a_config_key_we_cannot_compute_is_refused_by_name(key, tmp_path):
    config, message = IMPORT_REFUSALS[key]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"^--init-from='.*' cannot be loaded: .*config.json " + message):
        model_from_pretrained(str(tmp_path / "hf"), key="--init-from")


def test_every_family_names_only_switches_and_settings_the_model_has():
    for family in FAMILIES:
        assert set(family.computes) == set(switches(tiny_model(VOCAB, 48).config)), family.model_type
        for weight in family.weights:
            assert weight.convert in CONVERSIONS and weight.when in ("", "bias", "qkv_bias", "qk_norm", "untied")


def test_a_gpt2_bpe_model_exports_its_tokenizer_for_autotokenizer(tmp_path):
    model = tiny_model(GPT2Tokenizer().vocab_size, 48)
    export_model(model, GPT2Tokenizer(), tmp_path / "export")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "ROMEO:\nWhat light  through yonder window breaks? ☃ naïve<|endoftext|>"
    ids = GPT2Tokenizer().encode(text)
    assert tokenizer.encode(text) == ids
    assert tokenizer.decode(ids) == GPT2Tokenizer().decode(ids)


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_a_character_export_saved_again_by_transformers_imports_with_no_end_of_text_token(key, tmp_path):
    """A character vocabulary has no end-of-text token: config.json says so (null), so transformers
    neither fills in its class's default ids (GPT-2's 50256, beyond the vocabulary; Llama's 2, a
    character) nor stops generating at one, and its save_pretrained writes a folder we import."""
    switches_, _ = OUR_MODELS[key]
    model = trained_like(tiny_model(VOCAB, 48, **switches_), 3)
    export_model(model, TOKENIZER, tmp_path / "export")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert reference.config.eos_token_id is None and reference.generation_config.eos_token_id is None
    reference.save_pretrained(tmp_path / "saved")
    transformers.AutoTokenizer.from_pretrained(tmp_path / "export").save_pretrained(tmp_path / "saved")
    imported, tokenizer, _ = model_from_pretrained(str(tmp_path / "saved"), key="--init-from")
    assert tokenizer.eot_token is None
    for name, tensor in model.state_dict().items():
        assert torch.equal(imported.state_dict()[name], tensor), name


QUICKSTART_SWITCHES = ("bias", "pos_emb", "norm", "qk_norm", "mlp", "n_kv_head", "tie_embeddings", "logit_softcap")


def test_quickstart_model_exports_and_transformers_greedy_text_equals_sample_py(data_dir, tmp_path):
    """The switches of configs/shakespeare_char.toml on a tiny run: the export loads in transformers
    (AutoModelForCausalLM, AutoTokenizer) with no code of ours, and its greedy generation decodes to
    exactly what sample.py --temperature 0 prints, up to block_size characters."""
    quickstart = load_config(str(PROJECT_ROOT / "configs" / "shakespeare_char.toml"), []).model
    switches_ = {key: getattr(quickstart, key) for key in QUICKSTART_SWITCHES}
    cfg = tiny_config(
        tmp_path / "run", data_dir, train__max_iters=30, **{f"model__{k}": v for k, v in switches_.items()}
    )
    Trainer(cfg).fit()
    prompt, new_tokens = "ROMEO:", 32 - len("ROMEO:")  # prompt and sample within block_size = 32
    greedy = ["--out-dir", str(tmp_path / "run"), "--prompt", prompt, "--temperature", "0", "--device", "cpu"]
    printed = run_script("sample.py", *greedy, "--max-new-tokens", str(new_tokens))
    assert printed.returncode == 0, printed.stderr
    exported = run_script("sample.py", "--out-dir", str(tmp_path / "run"), "--export", str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr
    assert "StableLmForCausalLM" in exported.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert tokenizer.decode(output[0]) + "\n" == printed.stdout


def test_docs_family_tables_are_the_table_in_model_families():
    page = (PROJECT_ROOT / "docs" / "models.md").read_text()
    start = page.index("<!-- families: generated by interop.families.markdown_tables() -->\n")
    end = page.index("<!-- end of families -->")
    assert page[start:end].split("\n", 1)[1] == markdown_tables()


@pytest.fixture
def llama_folder(tmp_path):
    """A tiny Llama-family folder as a hub download holds it: weights, config.json and a tokenizer.json
    (a byte-level BPE trained on Shakespeare, of as many ids as the embedding has rows). Its heads are
    wider than hidden_size / num_attention_heads, as Qwen3-0.6B's: fine-tuning keeps their width."""
    text = (PROJECT_ROOT / "data" / "tinyshakespeare.txt").read_text()[:200_000]
    tokenizer = train_bpe([text], 300, progress=False)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **(SIZES | {"vocab_size": tokenizer.vocab_size, "max_position_embeddings": 64}),
        num_key_value_heads=2,
        head_dim=32,
    )
    trained_like(transformers.LlamaForCausalLM(config), 5).save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "tokenizer.json").write_text(tokenizer.to_json())
    (tmp_path / "corpus.txt").write_text(text)
    return tmp_path / "llama"


def test_a_llama_folder_fine_tunes_in_two_commands_then_samples_and_resumes(llama_folder, tmp_path, monkeypatch):
    prepared = run_script(
        "data/prepare.py", "--dataset", str(tmp_path / "corpus.txt"), "--tokenizer", str(llama_folder),
        "--out", str(tmp_path / "data" / "notes"),
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    cfg = tiny_config(
        tmp_path / "run",
        tmp_path / "data",
        data__dataset="notes",
        train__init_from=str(llama_folder),
        train__max_iters=4,
    )
    trainer = Trainer(cfg)
    imported, tokenizer, _ = model_from_pretrained(str(llama_folder), key="train.init_from")
    assert (
        trainer.cfg.model.norm == "rmsnorm" and trainer.cfg.model.n_kv_head == 2 and trainer.cfg.model.vocab_size == 300
    )
    assert trainer.cfg.model.head_dim == 32  # the folder's, where the run left it at 0
    for name, tensor in imported.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    trainer.fit()
    sampled = run_script("sample.py", "--out-dir", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "8")
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr
    resumed = run_script("train.py", "--config", str(tmp_path / "run" / "config.toml"), "--train.init_from=resume",
                         "--train.max_iters=6")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] == 6


def greedy_sample_py_and_transformers(folder, tokenizer, prompt: str, new_tokens: int) -> tuple[str, str]:
    """What sample.py --init-from folder --temperature 0 prints, and the text of transformers' greedy
    generate on the same folder (up to the end-of-text token), as sample.py streams it: the tokens'
    bytes decoded as one string (a random model draws tokens that are bytes of no character)."""
    printed = run_script(
        "sample.py", "--init-from", str(folder), "--prompt", prompt, "--temperature", "0",
        "--max-new-tokens", str(new_tokens), "--device", "cpu",
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        output = reference.generate(
            prompt_ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=tokenizer.eot_token
        )
    new_ids = output[0, prompt_ids.size(1) :].tolist()
    if tokenizer.eot_token in new_ids:
        new_ids = new_ids[: new_ids.index(tokenizer.eot_token)]
    text = b"".join(tokenizer.token_bytes(i) for i in new_ids).decode("utf-8", errors="replace")
    return printed.stdout, prompt + text + "\n"


def test_sample_py_greedy_text_from_a_llama_folder_equals_transformers(llama_folder):
    tokenizer = JsonTokenizer.from_file(llama_folder / "tokenizer.json")
    printed, expected = greedy_sample_py_and_transformers(llama_folder, tokenizer, "ROMEO: ", 24)
    assert printed == expected


def test_a_tokenizer_larger_than_the_embedding_is_refused(llama_folder):
    config = json.loads((llama_folder / "config.json").read_text())
    tokens = train_bpe([(PROJECT_ROOT / "data" / "tinyshakespeare.txt").read_text()[:200_000]], 400, progress=False)
    (llama_folder / "tokenizer.json").write_text(tokens.to_json())
    with pytest.raises(
        UserError,
        match=r"holds a model of vocab_size=300 \(.*config.json\), fewer than the 400 tokens of its tokenizer \(.*tokenizer.json\)",
    ):
        model_from_pretrained(str(llama_folder), key="--init-from")
    assert config["vocab_size"] == 300


# ------------------------------------------------------------------ published config.json files
HF_CONFIGS = PROJECT_ROOT / "tests" / "hf_configs"
# each published config.json (tests/hf_configs/README.md): its family and the keys it ignores, which its
# transformers class does not define and no model code reads
PUBLISHED = {
    "gpt2.json": ("gpt2", ["n_ctx", "task_specific_params"]),
    "smollm2-135m-instruct.json": ("llama", ["is_llama_config", "rope_interleaved", "transformers.js_config"]),
    "smollm2-135m-instruct-from-gguf.json": ("llama", ["_model_name_or_path", "unk_token_id"]),
    "tinyllama-1.1b-chat-v1.0.json": ("llama", []),
    "qwen2.5-0.5b-instruct.json": ("qwen2", []),
    "qwen3-0.6b.json": ("qwen3", []),
    "llama-3.2-1b-instruct.json": ("llama", []),
    "mistral-7b-v0.1.json": ("mistral", []),
    "mistral-7b-v0.3.json": ("mistral", []),
}
# the published files that compute something this model does not, and what
PUBLISHED_REFUSED = {
    "stablelm-2-1_6b.json": r"sets partial_rotary_factor=0.25; this model computes only 1.0 \(it turns every feature of a head\)",
}  # fmt: skip
CONFIG_CLASSES = {
    "gpt2": "GPT2Config", "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
    "stablelm": "StableLmConfig", "mistral": "MistralConfig",
}  # fmt: skip


def test_every_published_config_is_tested():
    assert sorted(p.name for p in HF_CONFIGS.glob("*.json")) == sorted([*PUBLISHED, *PUBLISHED_REFUSED])


@pytest.mark.parametrize("name", PUBLISHED)
def test_a_published_config_loads_as_transformers_builds_it_ignoring_only_keys_no_model_code_reads(name):
    hf = json.loads((HF_CONFIGS / name).read_text())
    family, config = config_from_hf(hf, name)
    model_type, ignored = PUBLISHED[name]
    assert family.model_type == model_type and ignored_keys(hf) == ignored
    reference = getattr(transformers, CONFIG_CLASSES[model_type]).from_dict(dict(hf))
    for key in ignored:  # kept as plain attributes, which no modeling code reads (test below)
        assert key not in family.defined and getattr(reference, key) == hf[key]
    assert (config.n_layer, config.n_head, config.n_embd, config.vocab_size, config.block_size) == (
        reference.num_hidden_layers, reference.num_attention_heads, reference.hidden_size, reference.vocab_size,
        reference.max_position_embeddings,
    )  # fmt: skip
    if model_type == "gpt2":
        return
    assert config.kv_heads == reference.num_key_value_heads and config.mlp_hidden == reference.intermediate_size
    head_dim = getattr(reference, "head_dim", None) or reference.hidden_size // reference.num_attention_heads
    assert config.head_size == head_dim and config.norm_eps == reference.rms_norm_eps
    assert config.attn_window == (getattr(reference, "sliding_window", None) or 0)
    assert config.qkv_bias == (model_type == "qwen2") and config.tie_embeddings == reference.tie_word_embeddings
    # the rotation, bit for bit (Llama 3.2's stretched table too)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kind = reference.rope_parameters["rope_type"]
    compute = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    expected_table, expected_scale = compute(reference)
    table, scale = rope_frequencies(config)
    assert torch.equal(table, expected_table) and scale == expected_scale


@pytest.mark.parametrize("name", PUBLISHED_REFUSED)
def test_a_published_config_that_computes_otherwise_is_refused_naming_the_computation(name):
    with pytest.raises(ValueError, match=f"^{name} " + PUBLISHED_REFUSED[name]):
        config_from_hf(json.loads((HF_CONFIGS / name).read_text()), name)


def test_keys_no_model_code_reads_load_with_a_one_line_note_and_the_logits_of_transformers(tmp_path, capsys):
    """A folder whose config.json holds keys its class does not define (a tooling namespace,
    transformers' own _model_name_or_path and unk_token_id, nanotron's flags, an expert count the
    dense class never reads): transformers loads it ignoring them, and so does this model, saying so."""
    reference = hf_reference("llama")
    reference.save_pretrained(tmp_path / "hf")
    extra = {"_model_name_or_path": "Smollm2 135M", "unk_token_id": 0, "is_llama_config": True,
             "rope_interleaved": True, "num_local_experts": 8, "transformers.js_config": {"kv_cache_dtype": {}}}  # fmt: skip
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | extra
    config["rope_parameters"]["factor"] = 4.0  # read by no default rotation
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "tokenizer.json").write_text(TOKENIZER.to_json())
    capsys.readouterr()
    ours, _, _ = model_from_pretrained(str(tmp_path / "hf"), key="--init-from")
    note = capsys.readouterr().err.strip()
    assert note == (
        f"note: {tmp_path / 'hf' / 'config.json'}: ignored _model_name_or_path, unk_token_id, is_llama_config, "
        f"rope_interleaved, num_local_experts, transformers.js_config, rope_parameters.factor: keys transformers' "
        f"llama config does not define, which no model code reads"
    )
    assert_same_logits(ours, transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval())


def consumed_keys(config_class: type) -> set[str]:
    """The keys PreTrainedConfig's __post_init__ (and the class's own) take out of config.json's
    leftovers: kwargs.pop("X") and kwargs.get("X"), read from their source."""
    keys = set()
    for cls in config_class.__mro__:
        if "__post_init__" not in vars(cls):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(cls.__post_init__).strip().replace("\n    ", "\n"))):
            if (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("pop", "get")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "kwargs" and node.args
                and isinstance(node.args[0], ast.Constant) and not str(node.args[0].value).startswith("_")
            ):  # fmt: skip
                keys.add(node.args[0].value)
    return keys


def modeling_reads(model_type: str) -> set[str]:
    """The config attributes a family's modeling module reads: config.X, self.config.X and
    getattr/hasattr(config, "X"), from its parsed source (not from its comments)."""
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["_"])

    def is_config(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "config") or (
            isinstance(node, ast.Attribute) and node.attr == "config"
        )

    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute) and is_config(node.value):
            names.add(node.attr)
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2 and is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)
        ):  # fmt: skip
            names.add(node.args[1].value)
    return {name for name in names if isinstance(name, str) and not name.startswith("_")}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.model_type)
def test_the_keys_a_family_defines_are_its_transformers_class_own(family):
    """Family.defined, the keys a class defines (any other is ignored as no model code reads it), are the
    installed transformers' own: its fields, aliases, the keys its __post_init__ consumes, RoPE's keys,
    and what its modeling code reads (a newer transformers with a new field fails here, not silently)."""
    config_class = getattr(transformers, CONFIG_CLASSES[family.model_type])
    fields = {f.name for f in dataclasses.fields(config_class)}
    # RoPE's keys where the class has rope_parameters (a class without keeps them, converted, to no effect)
    expected = fields | set(config_class.attribute_map) | (consumed_keys(config_class) - set(ROPE_KEYS))
    expected |= set(ROPE_KEYS) if "rope_parameters" in fields else set()
    expected |= modeling_reads(family.model_type) - {"rope_parameters"} - set(vars(torch.nn.Module)) - {"training"}
    assert set(family.defined) == expected
    assert set(family.aliases) == set(config_class.attribute_map)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.model_type != "gpt2"], ids=lambda f: f.model_type)
def test_a_key_left_out_of_config_json_means_what_transformers_class_takes_it_to_mean(family):
    """Each key the family reads, left out of config.json, takes the value its transformers class gives it
    (Qwen3's head_dim 128, Mistral's window of 4096 and 8 key/value heads, StableLM's partial rotation)."""
    config_class = getattr(transformers, CONFIG_CLASSES[family.model_type])
    sizes = {"hidden_size": 256, "num_attention_heads": 32, "num_hidden_layers": 2, "vocab_size": 64,
             "max_position_embeddings": 48}  # fmt: skip
    built = config_class(**sizes)
    for key, value in family.defaults.items():
        if key == "partial_rotary_factor":
            assert built.rope_parameters.get("partial_rotary_factor", 1.0) == value
        elif value is None:  # derived: key/value heads as many as the heads, heads hidden_size / heads wide
            derived = {"num_key_value_heads": 32, "head_dim": 8}[key]
            assert (getattr(built, key, None) or derived) == derived, key
        else:
            assert getattr(built, key) == value, key
    hf = {"model_type": family.model_type, **sizes, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    hf["rope_parameters"] |= {"partial_rotary_factor": 1.0} if family.model_type == "stablelm" else {}
    _, config = config_from_hf(hf, "config.json")
    assert config.kv_heads == built.num_key_value_heads
    assert config.head_size == (getattr(built, "head_dim", None) or 8)
    assert config.mlp_hidden == built.intermediate_size
    assert config.attn_window == (getattr(built, "sliding_window", None) or 0)
