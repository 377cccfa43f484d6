"""sample.py --export-gguf: the file read back with gguf's own reader holds llama.cpp's architecture,
settings, tokenizer and our tensors; where llama-cpp-python is installed (pip install
llama-cpp-python), llama.cpp's greedy continuation equals sample.py --temperature 0."""

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # a dependency, yet missing on CUDA images that run the other tests

from data.conversations import chat_tokenizer  # noqa: E402
from data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, JsonTokenizer, train_bpe  # noqa: E402
from errors import UserError  # noqa: E402
from interop.families import FAMILY_BY_TYPE, split_gate_up, split_qkv  # noqa: E402
from interop.gguf import export_gguf  # noqa: E402
from interop.gguf_tensors import EXPORT_SOURCE_KEY, permute_rope, unpermute_rope  # noqa: E402
from interop.pretrained import export_model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from tests.conftest import PROJECT_ROOT, run_script, tiny_config, tiny_model  # noqa: E402
from tests.test_chat import LLAMA3_SPLIT, QWEN2_SPLIT  # noqa: E402
from tests.test_families import OUR_MODELS, QUICKSTART_SWITCHES, TOKENIZER, VOCAB, trained_like  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

# the combinations of switches of tests/test_families.py that llama.cpp runs, each with its architecture
GGUF_MODELS = {key: value for key, value in OUR_MODELS.items() if FAMILY_BY_TYPE[value[1]].gguf is not None}
CONTROL, NORMAL = 3, 1


def field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def export(tmp_path, key: str, dtype: str = "float32", tokenizer=TOKENIZER, vocab_size: int = VOCAB):
    switches, _ = GGUF_MODELS[key]
    model = trained_like(tiny_model(vocab_size, 48, **switches), 3)
    path = tmp_path / f"{key}.gguf"
    arch = export_gguf(model, tokenizer, path, dtype, source=tmp_path / "run")
    return model, arch, gguf.GGUFReader(path)


def expected_tensors(model, arch: str) -> dict[str, torch.Tensor]:
    """Our tensors under llama.cpp's names, written out here tensor by tensor from the model's layers
    (not through the export's table), in the layout llama.cpp reads."""
    config, state = model.config, model.state_dict()
    tensors = {"token_embd.weight": state["transformer.wte.weight"]}
    if config.pos_emb == "learned":
        tensors["position_embd.weight"] = state["transformer.wpe.weight"]
    norm_bias = arch in ("gpt2", "stablelm")  # families whose LayerNorms always have a bias: zeros where ours lack it
    for i in range(config.n_layer):
        ours = lambda name, i=i: state.get(f"transformer.h.{i}.{name}")  # noqa: E731
        blk = f"blk.{i}."
        for their, our in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
            tensors[blk + their + ".weight"] = ours(our + ".weight")
            if norm_bias:
                tensors[blk + their + ".bias"] = ours(our + ".bias") if config.bias else torch.zeros(config.n_embd)
        if arch == "gpt2":
            biases = {name: ours(name + ".bias") for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
            if not config.bias:
                biases = {name: torch.zeros(ours(name + ".weight").shape[0]) for name in biases}
            for their, our in (("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_up", "mlp.c_fc"),
                               ("ffn_down", "mlp.c_proj")):  # fmt: skip
                tensors[blk + their + ".weight"] = ours(our + ".weight")
                tensors[blk + their + ".bias"] = biases[our]
            continue
        rope_order = (lambda t, heads: permute_rope(t, heads)) if arch == "llama" else (lambda t, heads: t)
        if config.qkv_bias and not config.bias:  # Qwen2's biases: the queries', keys' and values' alone
            q, k, v = split_qkv(ours("attn.c_attn.bias"), config)
            tensors[blk + "attn_q.bias"], tensors[blk + "attn_k.bias"], tensors[blk + "attn_v.bias"] = q, k, v
        for kind in ("weight", "bias") if config.bias else ("weight",):
            q, k, v = split_qkv(ours("attn.c_attn." + kind), config)
            tensors[blk + "attn_q." + kind] = rope_order(q, config.n_head)
            tensors[blk + "attn_k." + kind] = rope_order(k, config.kv_heads)
            tensors[blk + "attn_v." + kind] = v
            tensors[blk + "attn_output." + kind] = ours("attn.c_proj." + kind)
            gate, up = split_gate_up(ours("mlp.c_fc." + kind), config)
            tensors[blk + "ffn_gate." + kind], tensors[blk + "ffn_up." + kind] = gate, up
            tensors[blk + "ffn_down." + kind] = ours("mlp.c_proj." + kind)
        if config.qk_norm:
            per_head = arch == "stablelm"  # a (heads, head_dim) tensor: one norm per head
            q_norm, k_norm = ours("attn.q_norm.weight"), ours("attn.k_norm.weight")
            tensors[blk + "attn_q_norm.weight"] = q_norm.expand(config.n_head, -1) if per_head else q_norm
            tensors[blk + "attn_k_norm.weight"] = k_norm.expand(config.kv_heads, -1) if per_head else k_norm
    tensors["output_norm.weight"] = state["transformer.ln_f.weight"]
    if norm_bias:
        tensors["output_norm.bias"] = state["transformer.ln_f.bias"] if config.bias else torch.zeros(config.n_embd)
    if not config.tie_embeddings or arch == "stablelm":  # StableLM's llama.cpp reads no tied output layer
        tensors["output.weight"] = state["lm_head.weight"]
    if config.rope_scaling == "llama3":  # the divisors of the plain frequencies, as llama.cpp's converter writes them
        tensors["rope_freqs.weight"] = torch.tensor(llama3_rope_factors(config), dtype=torch.float32)
    return tensors


def llama3_rope_factors(config) -> list[float]:
    """Llama 3's stretch as llama.cpp's converter computes it (conversion/llama.py): per pair, 1 where the
    wavelength is shorter than the original context / high_freq_factor, factor where longer than it /
    low_freq_factor, 1 / ((1 - s) / factor + s) in between."""
    D, base, original = config.head_size, config.rope_base, config.rope_original_context
    low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_factor
    factors = []
    for freq in (1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D)).tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


@pytest.mark.parametrize("key", GGUF_MODELS)
def test_gguf_file_holds_the_architecture_settings_and_our_tensors(key, tmp_path):
    model, arch, reader = export(tmp_path, key)
    config = model.config
    assert arch == GGUF_MODELS[key][1] == field(reader, "general.architecture")
    assert field(reader, f"{arch}.context_length") == config.block_size
    assert field(reader, f"{arch}.embedding_length") == config.n_embd
    assert field(reader, f"{arch}.block_count") == config.n_layer
    assert field(reader, f"{arch}.feed_forward_length") == config.mlp_hidden
    assert field(reader, f"{arch}.attention.head_count") == config.n_head
    assert field(reader, f"{arch}.attention.head_count_kv") == config.kv_heads
    assert field(reader, f"{arch}.attention.key_length") == config.head_size
    eps = "layer_norm_rms_epsilon" if config.norm == "rmsnorm" else "layer_norm_epsilon"
    assert field(reader, f"{arch}.attention.{eps}") == pytest.approx(config.norm_eps)
    if config.pos_emb == "rope":
        assert field(reader, f"{arch}.rope.dimension_count") == config.head_size
        assert field(reader, f"{arch}.rope.freq_base") == pytest.approx(config.rope_base)
    if config.rope_scaling == "yarn":
        assert field(reader, f"{arch}.rope.scaling.type") == "yarn"
        assert field(reader, f"{arch}.rope.scaling.factor") == config.rope_factor
        assert field(reader, f"{arch}.rope.scaling.original_context_length") == config.rope_original_context
    expected = expected_tensors(model, arch)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for tensor in reader.tensors:
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
        if tensor.name == "rope_freqs.weight":  # computed in float32 here, in Python's floats by llama.cpp
            np.testing.assert_allclose(tensor.data, expected[tensor.name].numpy(), rtol=1e-6, err_msg=tensor.name)
            continue
        np.testing.assert_array_equal(tensor.data, expected[tensor.name].numpy(), err_msg=tensor.name)
    # every tensor is one llama.cpp's architecture has (gguf's table of them)
    names = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[{v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]]}
    assert {
        t.name.rsplit(".", 1)[0].replace(".0.", ".{bid}.").replace(".1.", ".{bid}.") for t in reader.tensors
    } <= names


@pytest.mark.parametrize("key", ["qwen3", "stablelm-quickstart"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_export_holds_matrices_rounded_as_torch_rounds_them_and_norms_in_float32(dtype, key, tmp_path):
    model, arch, reader = export(tmp_path, key, dtype=dtype)
    expected = expected_tensors(model, arch)
    for tensor in reader.tensors:
        wanted = expected[tensor.name]
        if wanted.dim() > 1 and "_norm." not in tensor.name:  # StableLM's per-head norms are 2-D, and stay float32
            assert tensor.tensor_type == gguf.GGMLQuantizationType[{"float16": "F16", "bfloat16": "BF16"}[dtype]]
            raw = torch.from_numpy(tensor.data.copy().view(np.int16)).view(getattr(torch, dtype))
            assert torch.equal(raw.reshape(wanted.shape), wanted.to(getattr(torch, dtype))), tensor.name
        else:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
    file_type = {"float16": gguf.LlamaFileType.MOSTLY_F16, "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    assert field(reader, "general.file_type") == file_type


@pytest.mark.parametrize("key", GGUF_MODELS)
@pytest.mark.parametrize("file_type", ["Q8_0", "Q4_0"])
def test_quantized_export_holds_matrices_quantized_by_gguf_and_keeps_the_rest_as_llama_quantize_does(
    file_type, key, tmp_path
):
    """Matrices in the type, written by gguf's own quantizer (byte for byte); norm weights, biases and the
    position table in F32; the output layer (or the token embedding tied to it) Q8_0 in a Q4_0 file."""
    model, arch, reader = export(tmp_path, key, dtype=file_type)
    expected = expected_tensors(model, arch)
    output = "output.weight" if "output.weight" in expected else "token_embd.weight"
    for tensor in reader.tensors:
        wanted = expected[tensor.name].numpy()
        if wanted.ndim == 1 or tensor.name.endswith("_norm.weight") or tensor.name == "position_embd.weight":
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, tensor.name
            continue
        kind = gguf.GGMLQuantizationType["Q8_0" if tensor.name == output else file_type]
        if wanted.shape[-1] % 32:  # rows not in whole blocks (a SwiGLU MLP 85 wide): F16, as llama-quantize does
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F16, tensor.name
            assert np.array_equal(np.asarray(tensor.data).reshape(wanted.shape), wanted.astype(np.float16))
            continue
        assert tensor.tensor_type == kind, tensor.name
        assert np.array_equal(np.asarray(tensor.data), gguf.quants.quantize(wanted, kind)), tensor.name
        rows = gguf.quants.dequantize(np.asarray(tensor.data), kind).reshape(wanted.shape)
        # off by at most a block's step: its largest value over 127 (Q8_0) or 8 (Q4_0, whose -8..7 clamp one end)
        step = {"Q8_0": 1 / 127, "Q4_0": 1 / 8}[kind.name]
        assert np.abs(rows - wanted).max() <= 1.01 * step * np.abs(wanted).max(), tensor.name
    assert field(reader, "general.file_type") == gguf.LlamaFileType[f"MOSTLY_{file_type}"]


def test_a_matrix_whose_rows_do_not_fill_whole_blocks_is_written_in_float16_with_a_note(tmp_path, capsys):
    """A SwiGLU MLP 8/3 as wide as 32 features is 85 wide: its output layer's rows are not in blocks of 32."""
    model = trained_like(tiny_model(VOCAB, 48, bias=False, pos_emb="rope", norm="rmsnorm", mlp="swiglu"), 3)
    export_gguf(model, TOKENIZER, tmp_path / "m.gguf", "Q8_0", source=tmp_path / "run")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == types["blk.1.ffn_down.weight"] == "F16"
    assert types["blk.0.ffn_up.weight"] == types["blk.0.attn_q.weight"] == "Q8_0"
    assert (
        "note: 2 matrices (blk.0.ffn_down.weight, blk.1.ffn_down.weight) hold rows of a length that is not a "
        "multiple of Q8_0's blocks of 32, so they are F16, as llama-quantize writes them"
    ) in capsys.readouterr().err


# stretched RoPEs llama.cpp does not compute: Llama 3's table outside its "llama", YaRN with other betas
STRETCH_REFUSALS = {
    "llama3-in-qwen2": (
        {**GGUF_MODELS["qwen2"][0], "rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_context": 32},
        r"model.rope_scaling='llama3' is computed by llama.cpp's llama but not by its qwen2",
    ),
    "yarn-betas": (
        {**GGUF_MODELS["qwen2-gqa-untied-yarn"][0], "rope_beta_fast": 16.0},
        r"model.rope_beta_fast=16.0 is computed by no llama.cpp architecture: its YaRN reads only beta_fast = 32",
    ),
}


@pytest.mark.parametrize("key", STRETCH_REFUSALS)
def test_a_stretched_rope_llama_cpp_does_not_compute_is_refused_by_name(key, tmp_path):
    switches, message = STRETCH_REFUSALS[key]
    model = tiny_model(VOCAB, 48, **switches)
    with pytest.raises(UserError, match=r"^--export-gguf cannot write this model: " + message):
        export_gguf(model, TOKENIZER, tmp_path / "model.gguf", "float32", source=tmp_path)
    assert not (tmp_path / "model.gguf").exists()


@pytest.mark.parametrize("heads, head_size", [(4, 8), (1, 16), (2, 2)])
def test_rope_permutation_round_trips_and_pairs_feature_i_with_i_plus_half(heads, head_size):
    rows = torch.arange(heads * head_size * 3, dtype=torch.float32).reshape(heads * head_size, 3)
    permuted = permute_rope(rows, heads)
    assert torch.equal(unpermute_rope(permuted, heads), rows)
    half = head_size // 2
    # in llama.cpp's order, rows 2i and 2i + 1 of a head are transformers' rows i and i + D/2
    for head in range(heads):
        for i in range(half):
            start = head * head_size
            assert torch.equal(permuted[start + 2 * i], rows[start + i])
            assert torch.equal(permuted[start + 2 * i + 1], rows[start + i + half])


def test_gpt2_bpe_tokenizer_is_llama_cpps_byte_level_bpe(tmp_path):
    tokenizer = GPT2Tokenizer()
    _, _, reader = export(tmp_path, "gpt2", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size)
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert len(tokens) == 50257 and tokens[50256] == "<|endoftext|>" and types[50256] == CONTROL
    assert tokens[220] == "Ġ" and tokens[198] == "Ċ" and types[198] == NORMAL  # a space, a newline
    merges = field(reader, "tokenizer.ggml.merges")
    assert len(merges) == 50000 and merges[0] == "Ġ t"  # GPT-2's first merge
    assert field(reader, "tokenizer.ggml.eos_token_id") == 50256 == field(reader, "tokenizer.ggml.bos_token_id")
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, EXPORT_SOURCE_KEY) == str(tmp_path / "run")


def test_a_trained_bpe_and_a_chat_template_travel_in_the_file(tmp_path):
    bpe = train_bpe(["ROMEO: What light through yonder window breaks? " * 20], vocab_size=300)
    tokenizer = chat_tokenizer(bpe)
    _, _, reader = export(tmp_path, "llama", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size)
    tokens, types = field(reader, "tokenizer.ggml.tokens"), field(reader, "tokenizer.ggml.token_type")
    state = json.loads(tokenizer.to_json())
    assert tokens[: len(state["model"]["vocab"])] == sorted(state["model"]["vocab"], key=state["model"]["vocab"].get)
    im_end = tokenizer.specials["<|im_end|>"]
    assert tokens[im_end] == "<|im_end|>" and types[im_end] == CONTROL
    assert field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    assert field(reader, "tokenizer.ggml.eot_token_id") == im_end


def split_bpe(pattern: str) -> JsonTokenizer:
    """A tiny byte-level BPE split by pattern before a plain ByteLevel, as Qwen2's and Llama 3's are."""
    import tokenizers
    from tokenizers import Regex, pre_tokenizers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    model.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    model.train_from_iterator(["ROMEO: What light through yonder window breaks? 12345 " * 30], trainer=trainer)
    return JsonTokenizer(model.to_str(), source="split/tokenizer.json")


@pytest.mark.parametrize("pattern, pre", [(QWEN2_SPLIT, "qwen2"), (LLAMA3_SPLIT, "llama-bpe")])
def test_qwen2_and_llama3_split_patterns_name_llama_cpps_pre_tokenizer(pattern, pre, tmp_path):
    tokenizer = split_bpe(pattern)
    _, _, reader = export(tmp_path, "qwen3", tokenizer=tokenizer, vocab_size=tokenizer.vocab_size)
    assert field(reader, "tokenizer.ggml.pre") == pre
    merges = json.loads(tokenizer.to_json())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]


def test_another_split_pattern_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="tokenizer of split/tokenizer.json: its pre-tokenizer or normalizer is none"):
        export(tmp_path, "qwen3", tokenizer=split_bpe(r"\w+|\s+"), vocab_size=400)


def test_a_character_vocabulary_is_spelled_in_bytes_and_padded_to_the_model(tmp_path):
    tokenizer = CharTokenizer("\n !ABab")
    _, _, reader = export(tmp_path, "stablelm-quickstart", tokenizer=tokenizer, vocab_size=10)
    assert field(reader, "tokenizer.ggml.tokens") == ["Ċ", "Ġ", "!", "A", "B", "a", "b", "[PAD7]", "[PAD8]", "[PAD9]"]
    assert field(reader, "tokenizer.ggml.token_type")[-1] == 5  # unused
    assert "tokenizer.ggml.eos_token_id" not in reader.fields  # a character vocabulary has no end-of-text token


def test_a_character_beyond_one_byte_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="'é' is 2 bytes in UTF-8"):
        export(tmp_path, "gpt2", tokenizer=CharTokenizer("ABé"), vocab_size=3)
    assert list(tmp_path.iterdir()) == []


def test_a_sentencepiece_style_tokenizer_is_refused_by_name(tmp_path):
    import tokenizers

    model = tokenizers.models.BPE(vocab={"<0x41>": 0, "▁a": 1, "a": 2}, merges=[], byte_fallback=True)
    tokenizer = JsonTokenizer(tokenizers.Tokenizer(model).to_str(), source="spm/tokenizer.json")
    with pytest.raises(UserError, match="tokenizer of spm/tokenizer.json: it is a BPE with byte fallback"):
        export(tmp_path, "llama", tokenizer=tokenizer, vocab_size=3)


def test_sample_py_replaces_its_own_earlier_export_and_nothing_else(tmp_path):
    model = trained_like(tiny_model(VOCAB, 48, **GGUF_MODELS["llama"][0]), 3)
    export_model(model, TOKENIZER, tmp_path / "folder")
    args = ["--init-from", str(tmp_path / "folder"), "--export-gguf", str(tmp_path / "m.gguf")]
    for _ in range(2):  # the second run replaces the first's file
        written = run_script("sample.py", *args)
        assert written.returncode == 0, written.stderr
        assert "as a llama.cpp llama model in F32" in written.stderr
    assert gguf.GGUFReader(tmp_path / "m.gguf").fields["general.architecture"].contents() == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "m.gguf"]  # no temporary file left


# --------------------------------------------------------------------------------------- llama.cpp itself
# llama.cpp's float32 kernels sum in another order than torch's, and ggml reads GELU from a float16 table:
# logits agree to this much (tiny models, logits of a few units); float16 weights round each to 11 significant
# bits, which moves logits by up to this
FLOAT32_LOGITS, FLOAT16_LOGITS = 5e-3, 5e-2


def llama_greedy(path, prompt: str, new_tokens: int, n_ctx: int, stop: bool) -> tuple[list[int], str, np.ndarray]:
    """llama.cpp's tokens of prompt, its greedy continuation's text (ending at its end-of-text token if
    stop: a vocabulary without one has llama.cpp's default id there, which --ignore-eos ignores), and
    its logits at the prompt's positions."""
    llama_cpp = pytest.importorskip("llama_cpp")
    # the KV cache in float32 (llama.cpp's default is float16, which alone moves logits by about 1e-3)
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=1, **cache)
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)])
    continuation = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if (stop and token == llm.token_eos()) or len(continuation) == new_tokens:
            break
        continuation.append(token)
    return ids, llm.detokenize(continuation).decode("utf-8", errors="replace"), logits


def assert_llama_cpp_agrees(tmp_path, source: list[str], tokenizer, prompt: str, new_tokens: int, model) -> None:
    block_size = model.config.block_size
    greedy = [*source, "--prompt", prompt, "--temperature", "0", "--device", "cpu", "--max-new-tokens"]
    printed = run_script("sample.py", *greedy, str(new_tokens))
    assert printed.returncode == 0, printed.stderr
    ours_ids = tokenizer.encode(prompt)
    with torch.no_grad():
        ours_logits = model(torch.tensor([ours_ids]))[0][0].numpy()
    for dtype, tolerance in (("float32", FLOAT32_LOGITS), ("float16", FLOAT16_LOGITS)):
        path = tmp_path / f"{dtype}.gguf"
        written = run_script("sample.py", *source, "--export-gguf", str(path), "--dtype", dtype)
        assert written.returncode == 0, written.stderr
        ids, text, logits = llama_greedy(path, prompt, new_tokens, block_size, tokenizer.eot_token is not None)
        assert ids == ours_ids
        assert np.abs(logits - ours_logits).max() < tolerance, dtype
        if dtype == "float32":
            assert prompt + text + "\n" == printed.stdout


llama_cpp_needed = pytest.mark.skipif(
    __import__("importlib").util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install llama-cpp-python; docs/shipping.md)",
)


@llama_cpp_needed
@pytest.mark.slow
@pytest.mark.parametrize("key", GGUF_MODELS)
def test_llama_cpp_greedy_text_equals_sample_py(key, tmp_path):
    model = trained_like(tiny_model(VOCAB, 48, **GGUF_MODELS[key][0]), 3)
    export_model(model, TOKENIZER, tmp_path / "folder")
    source = ["--init-from", str(tmp_path / "folder")]
    assert_llama_cpp_agrees(tmp_path, source, TOKENIZER, "ABCABD", 40, model)


@llama_cpp_needed
@pytest.mark.slow
def test_llama_cpp_runs_a_gpt2_bpe_model_as_sample_py_does(tmp_path):
    tokenizer = GPT2Tokenizer()
    model = trained_like(tiny_model(tokenizer.vocab_size, 48), 3)
    export_model(model, tokenizer, tmp_path / "folder")
    source = ["--init-from", str(tmp_path / "folder")]
    assert_llama_cpp_agrees(tmp_path, source, tokenizer, "ROMEO: What light through", 20, model)


@llama_cpp_needed
@pytest.mark.slow
@pytest.mark.parametrize("pattern", [QWEN2_SPLIT, LLAMA3_SPLIT], ids=["qwen2", "llama3"])
def test_llama_cpp_splits_and_runs_a_qwen3_model_with_a_split_bpe_as_sample_py_does(pattern, tmp_path):
    tokenizer = split_bpe(pattern)
    model = trained_like(tiny_model(tokenizer.vocab_size, 48, **GGUF_MODELS["qwen3"][0]), 3)
    export_model(model, tokenizer, tmp_path / "folder")
    source = ["--init-from", str(tmp_path / "folder")]
    assert_llama_cpp_agrees(tmp_path, source, tokenizer, "ROMEO: What 12345 light's  through", 16, model)


@llama_cpp_needed
@pytest.mark.slow
def test_llama_cpp_runs_the_quickstart_model_as_sample_py_does(data_dir, tmp_path):
    from inference.load import model_from_checkpoint
    from trainer.checkpoint import load_checkpoint

    quickstart = load_config(str(PROJECT_ROOT / "configs" / "shakespeare_char.toml"), []).model
    switches = {f"model__{key}": getattr(quickstart, key) for key in QUICKSTART_SWITCHES}
    Trainer(tiny_config(tmp_path / "run", data_dir, train__max_iters=30, **switches)).fit()
    model, tokenizer = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), tmp_path / "run")
    source = ["--out-dir", str(tmp_path / "run")]
    assert_llama_cpp_agrees(tmp_path, source, tokenizer, "ROMEO:", 32 - len("ROMEO:"), model.eval())


def llama_cpp_perplexity(path, windows: list[list[int]]) -> float:
    """llama.cpp's perplexity of every token after each window's first (its KV cache in float32)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    width = len(windows[0])
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=width, logits_all=True, verbose=False, n_threads=1, **cache)
    nll = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = torch.tensor(np.array(llm.scores[: width - 1]), dtype=torch.float64)
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(window[1:]), reduction="none").tolist()
    llm.close()
    return float(np.exp(np.mean(nll)))


# how far llama.cpp's perplexity of each type may lie above F32's on held-out text (docs/shipping.md)
QUANTIZED_PERPLEXITY = {"F16": 1e-4, "Q8_0": 5e-3, "Q4_0": 3e-2}


@llama_cpp_needed
@pytest.mark.slow
def test_llama_cpp_loads_each_quantized_file_within_its_perplexity_bound_of_float32(data_dir, tmp_path):
    """A model trained for 200 steps on the quickstart's characters, scored on the first 1,024 characters of
    the val split in windows of its 64-token context."""
    from inference.load import model_from_checkpoint
    from trainer.checkpoint import load_checkpoint

    sizes = {"model__n_embd": 64, "model__block_size": 64, "train__eval_interval": 200, "optim__lr_decay_iters": 200}
    Trainer(tiny_config(tmp_path / "run", data_dir, train__max_iters=200, **sizes)).fit()
    model, tokenizer = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), tmp_path / "run")
    val = np.fromfile(data_dir / "shakespeare_char" / "val.bin", dtype=np.uint16).astype(int).tolist()
    windows = [val[start : start + 64] for start in range(0, 1024, 64)]
    with torch.no_grad():
        logits = model(torch.tensor(windows))[0][:, :-1].double()
    ours = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor(windows)[:, 1:].flatten()).exp())
    perplexity = {}
    for file_type in ("F32", *QUANTIZED_PERPLEXITY):
        path = tmp_path / f"{file_type}.gguf"
        export_gguf(model, tokenizer, path, file_type, source=tmp_path / "run")
        perplexity[file_type] = llama_cpp_perplexity(path, windows)
    assert perplexity["F32"] == pytest.approx(ours, rel=1e-5)
    for file_type, bound in QUANTIZED_PERPLEXITY.items():
        assert perplexity[file_type] <= perplexity["F32"] * (1 + bound), (file_type, perplexity)


# ------------------------------------------------------------------ a folder's special tokens, and a run's
LLAMA3_CHATS = [
    [{"role": "user", "content": f"spell: {word}"}, {"role": "assistant", "content": " ".join(word)}]
    for word in ["dog", "cat", "lamb", "crow", "deer", "goat", "swan", "bee", "horse", "mouse"] * 3
]


def llama3_instruct_folder(folder):
    """A tiny random Llama with Llama 3 Instruct's tokenizer and special tokens as its files name them: the
    chat template opens with bos_token, tokenizer_config.json names <|begin_of_text|> and <|eot_id|> as bos and eos, its
    tokenizer.json's post-processor puts <|begin_of_text|> before a text, and config.json and
    generation_config.json give bos and the two ends (of text, of a turn) by id."""
    from tests.test_chat_command import build_llama3_folder

    build_llama3_folder(folder)
    state = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {token["content"]: token["id"] for token in state["added_tokens"]}
    for step in state["pre_tokenizer"]["pretokenizers"]:  # Llama 3's splits with no space put before a text
        step.update(add_prefix_space=False) if step["type"] == "ByteLevel" else None
    bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    state["post_processor"] = {  # as Meta-Llama-3-8B-Instruct's tokenizer.json has it
        "type": "Sequence",
        "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {
                "type": "TemplateProcessing",
                "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {
                    "<|begin_of_text|>": {
                        "id": "<|begin_of_text|>",
                        "ids": [ids["<|begin_of_text|>"]],
                        "tokens": ["<|begin_of_text|>"],
                    }  # fmt: skip
                },
            },
        ],
    }
    (folder / "tokenizer.json").write_text(json.dumps(state), encoding="utf-8")
    ends = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    config = json.loads((folder / "config.json").read_text()) | {"bos_token_id": ids["<|begin_of_text|>"]}
    (folder / "config.json").write_text(json.dumps(config | {"eos_token_id": ends}))
    generation = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ends, "do_sample": True}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def assert_the_folders_special_tokens(reader: gguf.GGUFReader, folder) -> None:
    """The file's bos, eos, end of turn and padding are those of the folder's tokenizer_config.json and
    generation_config.json, and llama.cpp adds bos to a text as transformers' tokenizer of the folder does."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
    assert bos == theirs.bos_token_id == generation["bos_token_id"] == theirs.convert_tokens_to_ids("<|begin_of_text|>")
    assert eos == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|eot_id|>")
    assert field(reader, "tokenizer.ggml.eot_token_id") == eos and eos in generation["eos_token_id"]
    assert "tokenizer.ggml.padding_token_id" not in reader.fields  # neither file names one
    assert theirs("spell").input_ids[0] == bos and field(reader, "tokenizer.ggml.add_bos_token") is True
    assert theirs("spell").input_ids[-1] != eos and field(reader, "tokenizer.ggml.add_eos_token") is False


def test_a_llama3_folders_own_special_tokens_travel_in_the_file(tmp_path):
    folder = llama3_instruct_folder(tmp_path / "llama")
    written = run_script("sample.py", "--init-from", str(folder), "--export-gguf", str(tmp_path / "m.gguf"))
    assert written.returncode == 0, written.stderr
    assert_the_folders_special_tokens(gguf.GGUFReader(tmp_path / "m.gguf"), folder)


@pytest.fixture(scope="module")
def llama3_chat_run(tmp_path_factory):
    """A folder of Llama 3 Instruct's special tokens, and a run fine-tuned from it on conversations
    rendered through its template."""
    from data.chat_dataset import prepare_chat
    from data.conversations import Conversation

    root = tmp_path_factory.mktemp("llama3_chat")
    folder = llama3_instruct_folder(root / "llama")
    conversations = [Conversation(messages, f"chat {i}") for i, messages in enumerate(LLAMA3_CHATS)]
    prepare_chat(conversations, str(folder), root / "chat", source="chats", block_size=64, val_fraction=0.2)
    cfg = tiny_config(root / "run", root, data__dataset="chat", model__block_size=64, train__init_from=str(folder),
                      train__max_iters=2)  # fmt: skip
    Trainer(cfg).fit()
    return folder, root / "run"


def test_a_run_fine_tuned_from_a_llama3_folder_keeps_its_special_tokens_in_the_file(llama3_chat_run, tmp_path):
    folder, run = llama3_chat_run
    written = run_script("sample.py", "--out-dir", str(run), "--export-gguf", str(tmp_path / "run.gguf"))
    assert written.returncode == 0, written.stderr
    assert_the_folders_special_tokens(gguf.GGUFReader(tmp_path / "run.gguf"), folder)


@pytest.mark.parametrize("source", ["folder", "run"])
def test_the_hugging_face_export_names_the_special_tokens_the_gguf_file_names(source, llama3_chat_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder, run = llama3_chat_run
    model = ["--init-from", str(folder)] if source == "folder" else ["--out-dir", str(run)]
    for flag, path in (("--export", tmp_path / "exported"), ("--export-gguf", tmp_path / "m.gguf")):
        written = run_script("sample.py", *model, flag, str(path))
        assert written.returncode == 0, written.stderr
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    bos, eos = field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id")
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert (theirs.bos_token_id, theirs.eos_token_id) == (bos, eos)
    assert theirs("spell").input_ids[0] == bos  # the folder's tokenizer.json, which adds bos, travels as it is


def test_a_chat_model_trained_with_documents_is_written_as_the_plain_causal_model_with_a_note(tmp_path):
    characters = CharTokenizer.from_text("\n !AB Hi Hello user assistant system")
    tokenizer = chat_tokenizer(characters)
    eot = tokenizer.eot_token
    model = trained_like(tiny_model(tokenizer.vocab_size, 48, attn_documents=True, eot_token=eot), 3)
    path = tmp_path / "chat.gguf"
    with pytest.raises(UserError, match="model.attn_documents=true is computed by no llama.cpp architecture"):
        export_gguf(model, CharTokenizer(characters.chars, (END_OF_TEXT,)), path, "float32", source=tmp_path)
    assert not path.exists()
    notes = io.StringIO()
    with contextlib.redirect_stderr(notes):
        arch = export_gguf(model, tokenizer, path, "float32", source=tmp_path / "run")
    assert arch == "gpt2" == field(gguf.GGUFReader(path), "general.architecture")
    assert notes.getvalue().count("\n") == 1
    assert notes.getvalue().startswith("note: model.attn_documents=true is written as the plain causal model")
    folder_notes = io.StringIO()
    with contextlib.redirect_stderr(folder_notes):  # --export follows the same rule and says the same
        export_model(model, tokenizer, tmp_path / "folder")
    assert folder_notes.getvalue() == notes.getvalue()


def llama_cpp_chat_prompt(llm, messages: list[dict]) -> list[int]:
    """The ids llama-cpp-python's chat completion gives the model for messages through the handler that
    renders the file's template with the file's bos and eos (where it recognises a template, Llama 3's,
    it picks a format of its own by default, which leaves out the template's trimming of contents),
    seen where it starts generating."""
    llm.chat_format = "chat_template.default"
    seen = []
    generate = llm.generate

    def spy(tokens, **options):
        seen.append(list(tokens))
        return generate(tokens, **options)

    llm.generate = spy
    llm.create_chat_completion(messages, max_tokens=1, temperature=0)
    del llm.generate
    return seen[0]


def llama_cpp_template_prompt(llm, llama_cpp, messages: list[dict]) -> list[int]:
    """The ids llama.cpp's own chat template engine (llama_chat_apply_template, which recognises the
    file's template) gives for messages, tokenized with the bos the file says to add."""
    import ctypes

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode()) for m in messages)
    )
    template = llm.metadata["tokenizer.chat_template"].encode()
    size = llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, None, 0)
    buffer = ctypes.create_string_buffer(size + 1)
    llama_cpp.llama_chat_apply_template(template, chat, len(messages), True, buffer, size + 1)
    return llm.tokenize(buffer.value, add_bos=True, special=True)  # add_bos: as the file says


@llama_cpp_needed
@pytest.mark.slow
@pytest.mark.parametrize("source", ["folder", "run"])
def test_llama_cpp_renders_a_llama3_chat_as_transformers_does(source, llama3_chat_run, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    transformers = pytest.importorskip("transformers")
    from tests.test_chat import CONVERSATIONS, their_ids

    folder, run = llama3_chat_run
    path = tmp_path / "chat.gguf"
    model = ["--init-from", str(folder)] if source == "folder" else ["--out-dir", str(run)]
    written = run_script("sample.py", *model, "--export-gguf", str(path))
    assert written.returncode == 0, written.stderr
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, n_threads=1)
    for messages in [*CONVERSATIONS, *LLAMA3_CHATS[:2]]:
        expected = their_ids(theirs, messages[:-1], add_generation_prompt=True)
        assert llama_cpp_chat_prompt(llm, messages[:-1]) == expected
        assert llama_cpp_template_prompt(llm, llama_cpp, messages[:-1]) == expected


@pytest.fixture(scope="module")
def documents_chat_run(tmp_path_factory, data_dir):
    """A tiny character model trained with model.attn_documents on spelling conversations (the
    quickstart's 65 characters, the built-in template), long enough to answer in letters."""
    from data.chat_dataset import prepare_chat
    from data.conversations import Conversation

    root = tmp_path_factory.mktemp("documents_chat")
    spelling = [
        Conversation(
            [{"role": "user", "content": f"spell: {word}"}, {"role": "assistant", "content": " ".join(word)}],
            f"chat {i}",
        )  # fmt: skip
        for i, word in enumerate(["dog", "cat", "lamb", "crow", "deer", "goat", "swan", "bee", "horse", "mouse"] * 3)
    ]
    prepare_chat(spelling, str(data_dir / "shakespeare_char"), root / "chat", source="spelling", block_size=64,
                 val_fraction=0.2)  # fmt: skip
    steps = {"train__max_iters": 150, "optim__lr_decay_iters": 150, "train__eval_interval": 150}
    cfg = tiny_config(root / "run", root, data__dataset="chat", model__block_size=128, model__attn_documents=True,
                      optim__learning_rate=1e-2, optim__min_lr=1e-3, **steps)  # fmt: skip
    Trainer(cfg).fit()
    return root / "run"


@llama_cpp_needed
@pytest.mark.slow
def test_llama_cpp_chat_replies_as_sample_py_chat_to_a_model_trained_with_documents(documents_chat_run, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from inference.chat import Sampling
    from inference.load import model_from_checkpoint
    from tests.test_chat_command import run_sample, talk
    from trainer.checkpoint import load_checkpoint

    run = documents_chat_run
    model, tokenizer = model_from_checkpoint(load_checkpoint(run / "ckpt.pt"), run)
    path = tmp_path / "chat.gguf"
    written = run_script("sample.py", "--out-dir", str(run), "--export-gguf", str(path))
    assert written.returncode == 0, written.stderr
    assert "note: model.attn_documents=true is written as the plain causal model" in written.stderr
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=model.config.block_size, verbose=False, n_threads=1, **cache)

    def their_reply(messages: list[dict], new_tokens: int) -> str:
        reply = llm.create_chat_completion(messages, max_tokens=new_tokens, temperature=0)
        return reply["choices"][0]["message"]["content"]

    printed = run_sample("--out-dir", str(run), "--chat", "--prompt", "spell: dog", "--temperature", "0",
                         "--max-new-tokens", "12")  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    assert (
        printed.stdout.strip() and their_reply([{"role": "user", "content": "spell: dog"}], 12) + "\n" == printed.stdout
    )
    # turn by turn, each reply joining the conversation the next one continues
    messages, _, notes = talk(
        model, tokenizer, "spell: cat", "spell: bee", system="Be brief.", sampling=Sampling(12, 0)
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"] and not notes
    for turn in (2, 4):
        assert their_reply(messages[:turn], 12) == messages[turn]["content"]


# ------------------------------------------------------------------ GGUF files in (interop/gguf_read.py)
def rewrite_gguf(source, path, fields: dict | None = None, types: dict | None = None, drop: tuple = ()) -> None:
    """A copy of a GGUF file with some metadata changed (fields: key -> (value, type, sub_type), value None
    drops the key) and some tensors stored in other types (types: name -> a GGMLQuantizationType, the
    values quantized by gguf's own quantize) or left out (drop): the files llama.cpp's tools write."""
    reader = gguf.GGUFReader(source)
    fields = fields or {}
    writer = gguf.GGUFWriter(path, str(fields.get("general.architecture", (field(reader, "general.architecture"),))[0]))
    for name, entry in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in fields:
            continue
        sub_type = entry.types[1] if entry.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, entry.contents(), entry.types[0], sub_type=sub_type)
    for name, (value, kind, sub_type) in fields.items():
        if value is not None and name != "general.architecture":
            writer.add_key_value(name, value, kind, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        kind = (types or {}).get(tensor.name)
        values = np.array(tensor.data)
        if kind is None:
            writer.add_tensor(tensor.name, values, raw_dtype=tensor.tensor_type)
        elif kind == gguf.GGMLQuantizationType.F64:
            writer.add_tensor(tensor.name, values.astype(np.float64), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("key", GGUF_MODELS)
def test_a_gguf_file_reads_back_as_the_model_it_was_written_from_bit_for_bit(key, tmp_path):
    """--init-from MODEL.gguf: the architecture's settings become the model's config, the tensors its
    weights (llama's query and key rows back in transformers' order, GPT-2's Conv1D layout, StableLM's
    stacked per-head norms, a tied head, Qwen2's biases, Llama 3's rope_freqs and YaRN's settings), the
    tokenizer the same ids."""
    from interop.pretrained import folder_tokenizer, load_pretrained

    model, _, _ = export(tmp_path, key)
    pretrained = load_pretrained(str(tmp_path / f"{key}.gguf"), key="--init-from")
    assert pretrained.config == model.config
    assert set(pretrained.state) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        assert torch.equal(pretrained.state[name], tensor), name
    tokenizer = folder_tokenizer(pretrained, key="--init-from")
    assert tokenizer.encode("ABCABD") == TOKENIZER.encode("ABCABD") and tokenizer.decode([1, 2, 3]) == "BCD"


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "F16", "BF16"])
def test_a_quantized_gguf_file_loads_dequantized_as_gguf_dequantizes_it(kind, tmp_path):
    from interop.pretrained import load_pretrained

    model, arch, reader = export(tmp_path, "qwen2")
    # the matrices whose rows fill whole blocks of 32 (llama.cpp's quantize leaves the others so too)
    quantized = {t.name: gguf.GGMLQuantizationType[kind] for t in reader.tensors if len(t.shape) == 2 and t.shape[0] % 32 == 0}  # fmt: skip
    rewrite_gguf(tmp_path / "qwen2.gguf", tmp_path / "quantized.gguf", types=quantized)
    pretrained = load_pretrained(str(tmp_path / "quantized.gguf"), key="--init-from")
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "quantized.gguf").tensors}
    gate = stored["blk.1.ffn_gate.weight"]
    assert gate.tensor_type == gguf.GGMLQuantizationType[kind]
    expected = torch.from_numpy(np.array(gguf.quants.dequantize(gate.data, gate.tensor_type), dtype=np.float32))
    hidden = model.config.mlp_hidden
    assert torch.equal(pretrained.state["transformer.h.1.mlp.c_fc.weight"][:hidden], expected.reshape(hidden, -1))
    embedding = stored["token_embd.weight"]
    expected = np.array(gguf.quants.dequantize(embedding.data, embedding.tensor_type), dtype=np.float32)
    assert torch.equal(pretrained.state["transformer.wte.weight"], torch.from_numpy(expected).reshape(VOCAB, -1))
    GPT(pretrained.config).load_state_dict(pretrained.state)  # every tensor of its shape


def test_llama_cpps_rope_freqs_of_llama_3_2_read_as_its_published_settings():
    """A Llama 3.1/3.2 GGUF from llama.cpp's converter holds only the divisors (rope_freqs.weight, in
    Python's floats); they read as Llama 3.2's factor 32, low 1, high 4 over 8192 positions, whose table
    is transformers' own."""
    from interop.gguf_read import llama3_settings

    config = GPTConfig(n_layer=1, n_head=32, n_embd=2048, pos_emb="rope", rope_base=500000.0, rope_scaling="llama3",
                       rope_factor=32.0, rope_original_context=8192)  # fmt: skip
    divisors = torch.tensor(llama3_rope_factors(config), dtype=torch.float32)
    settings = llama3_settings(None, 500000.0, 64, divisors, "Llama-3.2-1B.gguf")
    assert settings == {"rope_scaling": "llama3", "rope_factor": 32.0, "rope_low_freq_factor": 1.0,
                        "rope_high_freq_factor": 4.0, "rope_original_context": 8192}  # fmt: skip
    with pytest.raises(ValueError, match=r"^other.gguf: rope_freqs.weight is no Llama 3.1/3.2 stretch"):
        llama3_settings(None, 500000.0, 64, divisors.flip(0), "other.gguf")


# files of a kind this reader refuses, each in one line naming what
GGUF_IN_REFUSALS = {
    "architecture": ({"general.architecture": ("phi3", None, None)}, {}, (), r"holds general.architecture='phi3', which this model cannot compute \(it reads gpt2, llama, qwen2, qwen3, stablelm\)"),
    "sentencepiece": ({"tokenizer.ggml.model": ("llama", gguf.GGUFValueType.STRING, None)}, {}, (), r"holds tokenizer.ggml.model='llama' \(SentencePiece\): only llama.cpp's byte-level BPE"),
    "pre-tokenizer": ({"tokenizer.ggml.pre": ("deepseek-llm", gguf.GGUFValueType.STRING, None)}, {}, (), r"holds tokenizer.ggml.pre='deepseek-llm', a split before BPE this reader does not rebuild"),
    "tensor-type": ({}, {"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.F64}, (), r"blk.0.ffn_up.weight is of type F64, which the gguf package cannot dequantize"),
    "partial-rotary": ({"qwen2.rope.dimension_count": (8, gguf.GGUFValueType.UINT32, None)}, {}, (), r"sets qwen2.rope.dimension_count=8 for heads 16 wide: it turns part of each head"),
    "linear-rope": ({"qwen2.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING, None), "qwen2.rope.scaling.factor": (2.0, gguf.GGUFValueType.FLOAT32, None)}, {}, (), r"sets qwen2.rope.scaling.type='linear', a stretched RoPE this model does not compute"),
    "missing-tensor": ({}, {}, ("blk.1.attn_k.bias",), r"lacks the tensor model.layers.1.self_attn.k_proj.bias"),
}  # fmt: skip


@pytest.mark.parametrize("key", GGUF_IN_REFUSALS)
def test_a_gguf_file_this_model_cannot_read_is_refused_in_one_line(key, tmp_path):
    from interop.pretrained import model_from_pretrained

    fields, types, drop, message = GGUF_IN_REFUSALS[key]
    export(tmp_path, "qwen2")
    rewrite_gguf(tmp_path / "qwen2.gguf", tmp_path / "odd.gguf", fields, types, drop)
    with pytest.raises(
        UserError, match=r"^--init-from='.*odd.gguf' cannot be loaded: .*odd.gguf:? " + message
    ) as error:
        model_from_pretrained(str(tmp_path / "odd.gguf"), key="--init-from")
    assert "\n" not in str(error.value)


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path):
    from interop.pretrained import model_from_pretrained

    (tmp_path / "model.gguf").write_bytes(b"not a GGUF file at all")
    with pytest.raises(UserError, match=r"^--init-from='.*model.gguf' is not a readable GGUF file \("):
        model_from_pretrained(str(tmp_path / "model.gguf"), key="--init-from")
    with pytest.raises(UserError, match=r"^--init-from='.*missing.gguf' is not a file \(give a .gguf file"):
        model_from_pretrained(str(tmp_path / "missing.gguf"), key="--init-from")


@pytest.mark.slow
def test_sample_py_from_a_gguf_file_prints_what_it_prints_from_the_folder(tmp_path):
    model = trained_like(tiny_model(VOCAB, 48, **GGUF_MODELS["llama-llama3-rope"][0]), 3)
    export_model(model, TOKENIZER, tmp_path / "folder")
    export_gguf(model, TOKENIZER, tmp_path / "model.gguf", "float32", source=tmp_path / "folder")
    greedy = ["--prompt", "ABCABD", "--temperature", "0", "--max-new-tokens", "30", "--device", "cpu"]
    from_folder = run_script("sample.py", "--init-from", str(tmp_path / "folder"), *greedy)
    from_file = run_script("sample.py", "--init-from", str(tmp_path / "model.gguf"), *greedy)
    assert from_folder.returncode == 0 and from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == from_folder.stdout


@pytest.mark.slow
def test_a_gguf_file_fine_tunes_on_text_prepared_with_its_own_tokenizer(tmp_path):
    """prepare.py --tokenizer MODEL.gguf, then train.init_from = MODEL.gguf: the run takes the file's
    architecture and weights, trains, and samples."""
    text = (PROJECT_ROOT / "data" / "tinyshakespeare.txt").read_text()[:100_000]
    tokenizer = train_bpe([text], 300, progress=False)
    model = trained_like(tiny_model(tokenizer.vocab_size, 48, **GGUF_MODELS["qwen2"][0]), 3)
    export_gguf(model, tokenizer, tmp_path / "model.gguf", "float32", source=tmp_path)
    (tmp_path / "corpus.txt").write_text(text)
    prepared = run_script("data/prepare.py", "--dataset", str(tmp_path / "corpus.txt"), "--tokenizer",
                          str(tmp_path / "model.gguf"), "--out", str(tmp_path / "data" / "notes"))  # fmt: skip
    assert prepared.returncode == 0, prepared.stderr
    cfg = tiny_config(tmp_path / "run", tmp_path / "data", data__dataset="notes", train__max_iters=3,
                      train__init_from=str(tmp_path / "model.gguf"), model__block_size=32)  # fmt: skip
    trainer = Trainer(cfg)
    assert trainer.cfg.model.qkv_bias and not trainer.cfg.model.bias and trainer.cfg.model.n_layer == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], tensor), name
    trainer.fit()
    sampled = run_script("sample.py", "--out-dir", str(tmp_path / "run"), "--prompt", "ROMEO:", "--max-new-tokens", "5")
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO:"), sampled.stderr


def digits_bpe() -> JsonTokenizer:
    """A tiny byte-level BPE that splits every digit off before GPT-2's split, as SmolLM2's does."""
    import tokenizers
    from tokenizers import pre_tokenizers

    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    model.train_from_iterator(["ROMEO: What light through yonder window breaks? 12345 " * 30], trainer=trainer)
    return JsonTokenizer(model.to_str(), source="digits/tokenizer.json")


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "qwen2", "llama-bpe"])
def test_a_tokenizer_travels_through_a_gguf_file_and_back_with_its_ids_and_template(pre, tmp_path):
    from interop.pretrained import folder_tokenizer, load_pretrained

    tokenizer = {"gpt-2": GPT2Tokenizer, "smollm": digits_bpe, "qwen2": lambda: split_bpe(QWEN2_SPLIT),
                 "llama-bpe": lambda: split_bpe(LLAMA3_SPLIT)}[pre]()  # fmt: skip
    tokenizer = chat_tokenizer(tokenizer)
    model = trained_like(tiny_model(tokenizer.vocab_size, 48, **GGUF_MODELS["qwen3"][0]), 3)
    export_gguf(model, tokenizer, tmp_path / "model.gguf", "float32", source=tmp_path)
    assert field(gguf.GGUFReader(tmp_path / "model.gguf"), "tokenizer.ggml.pre") == pre
    back = folder_tokenizer(load_pretrained(str(tmp_path / "model.gguf"), key="--init-from"), key="--init-from")
    text = "ROMEO: What  light's 12345 through\n\nyonder naïve window<|endoftext|> breaks?"
    assert back.encode(text) == tokenizer.encode(text)
    assert back.decode(tokenizer.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    assert back.chat_template == tokenizer.chat_template and back.eot_token == tokenizer.eot_token
