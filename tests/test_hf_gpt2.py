"""Hugging Face GPT-2 interoperability, checked against transformers itself on tiny random models."""

import json
import math

import pytest
import torch

from data.tokenizer import GPT2Tokenizer
from errors import UserError
from interop.hf import read_safetensors, write_safetensors
from interop.pretrained import export_model, model_from_pretrained
from tests.conftest import run_entry_point, tiny_config, tiny_model
from tests.test_families import greedy_sample_py_and_transformers
from trainer.loop import Trainer

transformers = pytest.importorskip("transformers")

VOCAB = 50257  # GPT-2's, so the real tokenizer applies


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def hf_model(n_positions: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=n_positions, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # as trained: transformers starts biases at zero, which read as a model without them
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.02)
    return model


@pytest.fixture
def hf_dir(tmp_path):
    directory = tmp_path / "gpt2-tiny"
    hf_model().save_pretrained(directory)
    return directory


def test_loaded_gpt2_gives_the_logits_of_transformers(hf_dir):
    model, _ = model_from_pretrained(str(hf_dir), key="--init-from")[:2]
    reference = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    idx = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(idx).logits
        logits, _ = model(idx)
    assert (logits - expected).abs().max().item() < 1e-4
    assert model.lm_head.weight is model.transformer.wte.weight


def test_pytorch_model_bin_with_mask_buffers_loads_like_safetensors(hf_dir, tmp_path):
    from_safetensors, _ = model_from_pretrained(str(hf_dir), key="--init-from")[:2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((hf_dir / "config.json").read_text())
    state = {name.removeprefix("transformer."): t for name, t in read_safetensors(hf_dir / "model.safetensors").items()}
    # the layout of the original release: no prefix, causal-mask buffers stored with the weights
    state |= {f"h.{i}.attn.bias": torch.ones(1, 1, 64, 64).tril() for i in range(2)}
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, bin_dir / "pytorch_model.bin")
    from_bin, _ = model_from_pretrained(str(bin_dir), key="--init-from")[:2]
    for name, tensor in from_safetensors.state_dict().items():
        assert torch.equal(from_bin.state_dict()[name], tensor), name


def test_greedy_sample_py_continuation_equals_transformers_generate(hf_dir):
    printed, expected = greedy_sample_py_and_transformers(hf_dir, GPT2Tokenizer(), "The quick brown fox", 32)
    assert printed == expected


@pytest.mark.parametrize("bias", [True, False])
def test_exported_model_loads_in_transformers_bit_exactly(tmp_path, bias):
    model = tiny_model(vocab_size=VOCAB, block_size=48, bias=bias)
    with torch.no_grad():  # trained biases: all-zero ones come back as no biases, which compute the same
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.02)
    export_model(model, GPT2Tokenizer(), tmp_path / "export")
    reference, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf_state = reference.state_dict()
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        hf_tensor = hf_state[name]
        if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            hf_tensor = hf_tensor.t()
        assert torch.equal(hf_tensor, tensor), name
    if not bias:
        assert all(hf_state[name].count_nonzero() == 0 for name in hf_state if name.endswith(".bias"))
    idx = torch.randint(0, VOCAB, (1, 48))
    with torch.no_grad():
        assert (reference.eval()(idx).logits - model(idx)[0]).abs().max().item() < 1e-4
    reloaded, _ = model_from_pretrained(str(tmp_path / "export"), key="--init-from")[:2]
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_safetensors_round_trip_keeps_dtypes_and_values(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.randn(3).half(),
        "scalar": torch.tensor(2.5),
    }
    with open(tmp_path / "t.safetensors", "wb") as f:
        write_safetensors(tensors, f, metadata={"format": "pt"})
    back = read_safetensors(tmp_path / "t.safetensors")
    assert list(back) == list(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    safetensors_torch = pytest.importorskip("safetensors.torch")
    theirs = safetensors_torch.load_file(tmp_path / "t.safetensors")
    assert all(torch.equal(theirs[name], tensor) for name, tensor in tensors.items())


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"model_type": "bert"}, "model_type='bert', a family this model cannot compute (it reads gpt2, llama"),
        ({"model_type": "llama"}, "lacks num_hidden_layers: it is not a complete llama config.json"),
        ({"activation_function": "relu"}, "activation_function='relu'; this model computes only 'gelu_new' or"),
        ({"n_embd": 128}, "has shape (50257, 64) but config.json implies (50257, 128)"),
    ],
    ids=["unknown-family", "gpt2-keys-as-llama", "activation", "shape"],
)
def test_a_directory_that_is_not_this_gpt2_is_a_clear_error(hf_dir, change, fragment):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(UserError, match="--init-from=.*cannot be loaded: ") as error:
        model_from_pretrained(str(hf_dir), key="--init-from")[:2]
    assert fragment in str(error.value)


def test_missing_weights_are_a_clear_error(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has neither model.safetensors nor pytorch_model.bin"):
        model_from_pretrained(str(hf_dir), key="--init-from")[:2]


def test_fine_tuning_starts_from_the_gpt2_weights(hf_dir, bpe_data_dir, tmp_path):
    cfg = tiny_config(
        tmp_path / "run", bpe_data_dir, data__dataset="shakespeare", train__init_from=str(hf_dir), model__dropout=0.1
    )
    trainer = Trainer(cfg)
    loaded, _ = model_from_pretrained(str(hf_dir), key="--init-from")[:2]
    model_cfg = trainer.cfg.model
    assert (model_cfg.n_layer, model_cfg.n_embd, model_cfg.vocab_size, model_cfg.bias) == (2, 64, VOCAB, True)
    assert model_cfg.block_size == 32 and model_cfg.dropout == 0.1  # the run's own
    state = trainer.model.state_dict()
    assert torch.equal(state["transformer.wpe.weight"], loaded.transformer.wpe.weight[:32])
    assert torch.equal(state["transformer.h.1.mlp.c_fc.weight"], loaded.transformer.h[1].mlp.c_fc.weight)


def padded_gpt2_dir(directory, vocab_size: int = 50304):
    """A GPT-2 directory whose vocabulary is padded beyond the tokenizer's 50,257 rows with rows that
    would win every argmax, were they drawn; returns it and the unpadded model it extends."""
    model = tiny_model(vocab_size=VOCAB)
    padded = tiny_model(vocab_size=vocab_size)
    state = model.state_dict()
    extra = 50 * torch.randn(vocab_size - VOCAB, model.config.n_embd, generator=torch.Generator().manual_seed(0))
    wte = torch.cat([state["transformer.wte.weight"], extra])  # (vocab_size, n_embd)
    padded.load_state_dict(state | {"transformer.wte.weight": wte, "lm_head.weight": wte})
    export_model(padded, GPT2Tokenizer(), directory)
    return directory, model


def test_a_gpt2_directory_padded_beyond_the_tokenizer_samples_as_the_unpadded_model(tmp_path, monkeypatch, capsys):
    padded_dir, model = padded_gpt2_dir(tmp_path / "padded")
    export_model(model, GPT2Tokenizer(), tmp_path / "plain")
    prompt = "The quick brown fox"
    loaded, _, _ = model_from_pretrained(str(padded_dir), key="--init-from")
    ids = torch.tensor([GPT2Tokenizer().encode(prompt)])
    assert loaded(ids)[0][0, -1].argmax() >= VOCAB  # a padding row would win, were it drawn
    samples = []
    for directory in (tmp_path / "plain", padded_dir):
        args = ["--init-from", str(directory), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "8"]
        assert run_entry_point("sample.py", [*args, "--device", "cpu"], monkeypatch) == 0
        samples.append(capsys.readouterr().out)
    assert samples[0] == samples[1] and samples[0].startswith(prompt)


def test_fine_tuning_keeps_a_padded_vocabulary_and_its_weights(tmp_path, bpe_data_dir):
    padded_dir, _ = padded_gpt2_dir(tmp_path / "padded")
    cfg = tiny_config(tmp_path / "run", bpe_data_dir, data__dataset="shakespeare", train__init_from=str(padded_dir))
    trainer = Trainer(cfg)
    loaded, _, _ = model_from_pretrained(str(padded_dir), key="--init-from")
    assert trainer.cfg.model.vocab_size == 50304
    assert torch.equal(trainer.model.transformer.wte.weight, loaded.transformer.wte.weight)
    assert math.isfinite(trainer.train_step(1e-4).item())


def test_fine_tuning_needs_a_gpt2_bpe_dataset_and_fitting_context(hf_dir, data_dir, bpe_data_dir, tmp_path):
    with pytest.raises(
        UserError,
        match="reads the ids of its GPT-2 BPE, but data.dataset='shakespeare_char' was prepared with another tokenizer",
    ):
        Trainer(tiny_config(tmp_path / "a", data_dir, train__init_from=str(hf_dir)))
    too_long = tiny_config(
        tmp_path / "b", bpe_data_dir, data__dataset="shakespeare", train__init_from=str(hf_dir), model__block_size=65
    )
    with pytest.raises(UserError, match="model.block_size=65 is longer than the 64 positions"):
        Trainer(too_long)
    missing = tiny_config(tmp_path / "c", bpe_data_dir, data__dataset="shakespeare", train__init_from="resme")
    typo = "train.init_from='resme' is neither scratch nor resume nor a directory.*did you mean 'resume'"
    with pytest.raises(UserError, match=typo):
        Trainer(missing)
