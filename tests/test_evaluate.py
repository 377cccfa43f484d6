"""Evaluation: multiple choice, cloze, generation and text scored as lm-evaluation-harness scores
them, whatever the batching, and eval.py's figures."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import evals.evaluate as evaluate_module
from data.conversations import chat_tokenizer, render_prompt
from data.tokenizer import CharTokenizer, GPT2Tokenizer
from errors import UserError
from evals.evaluate import (
    EvaluationStopped,
    Prompt,
    TaskResult,
    centred_mean,
    evaluate_task,
    generate_replies,
    prompt_for,
    score_items,
    split_tokens,
)
from evals.tasks import GSM8K_JUDGE, LOCAL_JUDGE, Item, Question, Task, load_task, normalise
from inference.decode_step import prepare_decoding
from inference.load import model_from_checkpoint
from inference.packed_linear import packing_unavailable
from interop.pretrained import export_model
from plot import Run, loss_figure
from plot import main as plot_main
from tests.conftest import PROJECT_ROOT, run_entry_point, tiny_config, tiny_model
from trainer.checkpoint import load_checkpoint
from trainer.loop import Trainer
from trainer.metrics import read_metrics

TASKS = PROJECT_ROOT / "tests" / "tasks"


def scores_one_at_a_time(model, tokenizer, items) -> list[list[float]]:
    """Each continuation scored alone, in one full forward pass over its last block_size + 1 tokens."""
    block_size = model.config.block_size
    result = []
    for item in items:
        item_scores = []
        for continuation in item.continuations:
            context, tokens = split_tokens(tokenizer, item.context, continuation, item.where)
            ids = (context + tokens)[-(block_size + 1) :]
            logits, _ = model(torch.tensor(ids[:-1])[None])
            log_probs = F.log_softmax(logits[0, -len(tokens) :], dim=-1)
            item_scores.append(log_probs.gather(-1, torch.tensor(tokens)[:, None]).sum().item())
        result.append(item_scores)
    return result


def shakespeare_chars() -> CharTokenizer:
    return CharTokenizer.from_text((PROJECT_ROOT / "data" / "tinyshakespeare.txt").read_text())


@pytest.mark.parametrize(
    "block_size,pattern",
    [(64, {}), (160, {}), (64, {"attn_window": 8, "attn_sinks": 2}), (64, {"pos_emb": "rope", "n_kv_head": 1})],
    ids=["contexts-cut", "contexts-whole", "sliding-window", "rope-shared-kv-heads"],
)
@pytest.mark.parametrize("batch_size", [1, 5, 100])
def test_shared_context_batches_score_each_ending_as_alone(block_size, pattern, batch_size):
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=block_size, **pattern)
    items = load_task(str(TASKS / "next_line.jsonl"), limit=6).items
    with torch.no_grad():
        expected = scores_one_at_a_time(model, tokenizer, items)
    scored = score_items(model, tokenizer, items, batch_size)
    for item_scores, item_expected in zip(scored, expected, strict=True):
        assert [score for score, _ in item_scores] == pytest.approx(item_expected, abs=1e-4)


def test_the_progress_bar_counts_the_items_of_a_task(monkeypatch):
    """Its total is the task's items, not the groups that truncation cuts them into, and it ends full."""
    bars = []

    class RecordedBar(evaluate_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(evaluate_module, "tqdm", RecordedBar)
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)  # cuts contexts, each ending's its own way
    items = load_task(str(TASKS / "next_line.jsonl"), limit=6).items
    assert len(evaluate_module.encode_items(tokenizer, items, 64)) > len(items)
    score_items(model, tokenizer, items, batch_size=3, progress="next_line")
    assert [(bar.total, bar.n, bar.unit) for bar in bars] == [(6, 6, "item")]


def test_trailing_context_spaces_move_to_the_continuation():
    tokenizer = GPT2Tokenizer()
    context, tokens = split_tokens(tokenizer, "To be or not to ", " be", "here")
    assert tokenizer.decode(context) == "To be or not to"
    assert tokenizer.decode(tokens) == "  be"


def test_cloze_is_right_exactly_when_greedy_decoding_gives_the_word():
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    context = "ROMEO: what"
    ids = tokenizer.encode(context)
    with torch.no_grad():
        for _ in range(3):
            logits, _ = model(torch.tensor(ids)[None])
            ids.append(int(logits[0, -1].argmax()))
    greedy = tokenizer.decode(ids)[len(context) :]
    wrong = greedy[:2] + next(ch for ch in "abc" if ch != greedy[2])
    items = [Item(context, [word], [word], 0, f"item {n}") for n, word in enumerate([greedy, wrong])]
    for item in items:
        result = evaluate_task(model, tokenizer, Task("cloze", "cloze", "here", [item]), batch_size=4)
        (score,) = scores_one_at_a_time(model, tokenizer, [item])[0]
        assert result.metrics["acc"] == float(item.continuations[0] == greedy)
        assert result.metrics["ppl"] == pytest.approx(math.exp(-score), rel=1e-4)


def test_text_bits_per_byte_are_the_mean_loss_over_bytes(tmp_path):
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=16)
    text = (TASKS / "passage.txt").read_text()[:200]  # ASCII: one byte a character
    (tmp_path / "passage.txt").write_text(text)
    result = evaluate_task(model, tokenizer, load_task(str(tmp_path / "passage.txt")), batch_size=3)
    ids = torch.tensor(tokenizer.encode(text))
    losses = []
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 16):  # windows of block_size, each token predicted once
            end = min(start + 16, len(ids) - 1)
            first = max(0, end - 16)  # the short last window reads back to a full block
            logits, _ = model(ids[None, first:end])
            log_probs = F.log_softmax(logits[0, start - first :], dim=-1)
            losses.append(-log_probs.gather(-1, ids[start + 1 : end + 1, None]).sum().item())
    nats = sum(losses)
    assert result.metrics["n"] == len(text) - 1
    assert result.metrics["bpb"] == pytest.approx(nats / math.log(2) / (len(text) - 1), rel=1e-5)
    assert result.metrics["ppl"] == pytest.approx(math.exp(nats / (len(text) - 1)), rel=1e-5)


def test_centred_mean_puts_chance_at_zero_and_perfect_at_one():
    results = [
        TaskResult("guess", "choice", {"acc": 0.25, "acc_norm": 0.3, "n": 4}, chance=0.25),
        TaskResult("perfect", "choice", {"acc": 1.0, "acc_norm": 1.0, "n": 4}, chance=0.5),
        TaskResult("text", "text", {"ppl": 3.0, "bpb": 1.0, "n": 9}),
    ]
    assert [result.centred for result in results] == [0.0, 1.0, None]
    assert centred_mean(results) == 0.5


@pytest.mark.parametrize(
    "spec,kind,n_choices",
    [
        ("next_line.jsonl", "choice", {4}),
        ("last_word.jsonl", "cloze", {1}),
        ("line_end.jsonl", "generation", None),
        ("hellaswag=hellaswag.jsonl", "choice", {4}),
        ("arc_easy=arc.jsonl", "choice", {3, 4, 5}),
        ("piqa=piqa.jsonl", "choice", {2}),
        ("lambada=lambada.jsonl", "cloze", {1}),
        ("gsm8k=gsm8k.jsonl", "generation", None),
    ],
)
def test_shipped_task_files_read_in_every_format(spec, kind, n_choices):
    name, _, path = spec.rpartition("=")
    task = load_task(f"{name}={TASKS / path}" if name else str(TASKS / path))
    assert task.kind == kind and len(task.items) >= 20
    if n_choices is not None:
        assert {len(item.choices) for item in task.items} <= n_choices


def test_hellaswag_records_lose_their_bracketed_marks():
    task = load_task(f"hellaswag={TASKS / 'hellaswag.jsonl'}")
    assert not any("[" in item.context or any("[" in c for c in item.choices) for item in task.items)
    assert any(". Act" in choice for item in task.items for choice in item.choices)  # " [title]" became ". "


def test_eval_py_writes_every_task_under_its_stem(tmp_path, monkeypatch, capsys):
    tokenizer = GPT2Tokenizer()
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    export_model(model, tokenizer, tmp_path / "model")
    tasks = [str(TASKS / "next_line.jsonl"), f"lambada={TASKS / 'lambada.jsonl'}", str(TASKS / "passage.txt")]
    tasks += [str(TASKS / "line_end.jsonl"), f"gsm8k={TASKS / 'gsm8k.jsonl'}"]
    out = tmp_path / "out.json"
    args = ["--init-from", str(tmp_path / "model"), "--tasks", ",".join(tasks), "--json", str(out), "--device", "cpu"]
    assert run_entry_point("eval.py", [*args, "--limit", "6", "--max-new-tokens", "5"], monkeypatch) == 0
    figures = json.loads(out.read_text())
    assert list(figures["tasks"]) == ["next_line", "lambada", "passage", "line_end", "gsm8k"]
    assert set(figures["tasks"]["gsm8k"]) == {"acc", "acc_flexible", "n"}
    expected = [evaluate_task(model, tokenizer, load_task(spec, 6, 5), 32, limit=6) for spec in tasks]
    for result in expected:
        assert figures["tasks"][result.name] == pytest.approx(result.metrics)
    assert figures["centred_mean"] == pytest.approx(centred_mean(expected))
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == ["next_line", "lambada", "passage", "line_end", "gsm8k", "centred"]


def test_training_scores_the_eval_tasks_into_metrics(tmp_path, data_dir):
    tasks = f"{TASKS / 'next_line.jsonl'},{TASKS / 'passage.txt'}"
    cfg = tiny_config(tmp_path / "run", data_dir, model__block_size=64, eval__tasks=tasks, eval__items=4, eval__every=2)
    Trainer(cfg).fit()  # losses at steps 0, 10, 20; tasks at every 2nd evaluation and the last
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    scored = [r["step"] for r in records if "eval/next_line/acc" in r]
    assert scored == [0, 20]
    last = records[-1]
    model, tokenizer = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), tmp_path)
    for spec in tasks.split(","):
        result = evaluate_task(model, tokenizer, load_task(spec, 4), batch_size=32, limit=4)
        for key, value in result.metrics.items():
            assert last[f"eval/{result.name}/{key}"] == pytest.approx(value, rel=1e-4), key
    assert last["eval/centred_mean"] == pytest.approx(last["eval/next_line/acc"] / 0.75 - 1 / 3)
    # plot.py draws each figure in a panel of its own after the two losses: four panels, two by two
    out = tmp_path / "loss.png"
    plot_main(["loss", str(tmp_path / "run"), "--x", "tokens", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = [ax.get_title() for ax in loss_figure([Run.read(str(tmp_path / "run"))], "tokens").axes]
    assert titles[2:] == ["[eval] next_line/acc", "[eval] centred_mean"]  # passage.txt scores no acc


def test_a_bad_eval_task_stops_training_before_it_starts(tmp_path, data_dir):
    (tmp_path / "odd.jsonl").write_text('{"ctx": "ROMEO:", "endings": ["a", "b"], "label": 3}\n')
    cfg = tiny_config(tmp_path / "run", data_dir, eval__tasks=str(tmp_path / "odd.jsonl"))
    with pytest.raises(UserError, match="odd.jsonl item 1: field 'label'=3 is out of range"):
        Trainer(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def strict_json(text: str):
    """JSON as the standard has it: NaN and Infinity, which Python's json writes and reads, are refused."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_task_file_whose_name_holds_an_equals_sign_is_read_as_that_file(tmp_path, monkeypatch):
    """An entry that is a file is that file; only another entry is split into NAME=FILE."""
    (tmp_path / "my=items.jsonl").write_text((TASKS / "next_line.jsonl").read_text())
    (tmp_path / "hellaswag=local.jsonl").write_text((TASKS / "next_line.jsonl").read_text())
    monkeypatch.chdir(tmp_path)
    assert load_task("my=items.jsonl").name == "my=items"
    assert load_task("hellaswag=local.jsonl").name == "hellaswag=local"  # the file there wins
    builtin = load_task(f"hellaswag={TASKS / 'hellaswag.jsonl'}")
    assert builtin.name == "hellaswag" and len(builtin.items[0].choices) == 4
    with pytest.raises(UserError, match="'my=nothing.jsonl' is no file, and 'my' is not a built-in task"):
        load_task("my=nothing.jsonl")


def long_word_cloze(path, characters: int) -> None:
    """A cloze item whose last word is `characters` characters of Shakespeare's alphabet: an untrained
    model gives it a log-likelihood far below -709.8 nats, past which exp overflows a float."""
    path.write_text(json.dumps({"text": "ROMEO: " + "abcdefghij" * (characters // 10)}) + "\n")


def test_a_perplexity_past_the_float_range_is_inf_and_null_in_json(tmp_path, monkeypatch, capsys):
    tokenizer = GPT2Tokenizer()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=256)
    export_model(model, tokenizer, tmp_path / "model")
    long_word_cloze(tmp_path / "long.jsonl", 400)  # ~100 BPE tokens of ~10.8 nats each
    out = tmp_path / "out.json"
    args = ["--init-from", str(tmp_path / "model"), "--tasks", str(tmp_path / "long.jsonl"), "--json", str(out)]
    assert run_entry_point("eval.py", [*args, "--device", "cpu", "--no-progress"], monkeypatch) == 0
    assert "ppl inf" in capsys.readouterr().out
    figures = strict_json(out.read_text())
    assert figures["tasks"]["long"]["ppl"] is None and figures["tasks"]["long"]["acc"] == 0.0
    assert figures["centred_mean"] == 0.0


def test_a_perplexity_past_the_float_range_does_not_stop_training(tmp_path, data_dir):
    long_word_cloze(tmp_path / "long.jsonl", 250)  # ~4.2 nats a character untrained: over 1,000 nats
    cfg = tiny_config(tmp_path / "run", data_dir, model__block_size=256, eval__tasks=str(tmp_path / "long.jsonl"))
    Trainer(cfg).fit()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [record for record in map(strict_json, lines) if "val_loss" in record]
    assert [record["step"] for record in records] == [0, 10, 20]
    assert "eval/long/acc" in records[0] and "eval/long/ppl" not in records[0]  # JSON numbers only


def nan_model(vocab_size: int, **kwargs):
    model = tiny_model(vocab_size=vocab_size, **kwargs)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_proj.weight.fill_(float("nan"))
    return model


@pytest.mark.parametrize(
    "spec,message",
    [
        ("next_line.jsonl", r"next_line.jsonl item \d+: continuation \d .* scores a log-likelihood of nan"),
        ("last_word.jsonl", r"last_word.jsonl item \d+: continuation 0 .* scores a log-likelihood of nan"),
        ("passage.txt", r"passage.txt: the text from token 0 to \d+ scores a log-likelihood of nan"),
    ],
)
def test_scores_that_are_not_finite_are_refused_naming_the_item(spec, message):
    """A model of NaN weights scored 0.40 on multiple choice (every log-likelihood NaN, argmax picks
    the first ending): every score must be a number, or the evaluation ends naming what it scored."""
    tokenizer = shakespeare_chars()
    model = nan_model(tokenizer.vocab_size, block_size=64)
    with pytest.raises(UserError, match=message):
        evaluate_task(model, tokenizer, load_task(str(TASKS / spec), limit=4), batch_size=4, limit=4)


# generation tasks


def greedy_by_hand(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    """The greedy continuation of prompt, one full forward pass per token, no cache, no batch."""
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits, _ = model(torch.tensor(ids)[None])
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(tokenizer.encode(prompt)) :]


def generation_task(items: list[Question], max_new_tokens: int) -> Task:
    judge = dataclasses.replace(LOCAL_JUDGE, max_new_tokens=max_new_tokens)
    return Task("lines", "generation", "here", items, judge=judge)


@pytest.mark.parametrize("batch_size", [1, 4, 100])
@pytest.mark.parametrize("decoding_step", [False, True], ids=["model", "decoding-step"])
def test_generation_acc_is_the_share_of_greedy_first_lines_equal_to_the_answer(batch_size, decoding_step):
    """Half of the answers are the model's own greedy first line (spaced otherwise: normalisation),
    the other half that line with one more character: acc and every item's verdict as by hand,
    whatever the batching (prompts of different lengths share a left-padded batch), and as eval.py
    decodes on a CPU: packed products and the one-token step of inference/decode_step.py."""
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)
    prompts = [item.prompt for item in load_task(str(TASKS / "line_end.jsonl"), limit=7).items]
    items, expected = [], []
    for n, prompt in enumerate(prompts):
        reply = tokenizer.decode(greedy_by_hand(model, tokenizer, prompt, 12)).split("\n")[0]
        right = n % 2 == 0
        answer = "  " + " ".join(reply.split()).replace(" ", " \t ") + " " if right else reply.strip() + "x"
        items.append(Question(prompt, None, answer, f"item {n}"))
        expected.append(int(right))
    step = None
    if decoding_step:
        if packing_unavailable(torch.device("cpu"), torch.float32) is not None:
            pytest.skip(packing_unavailable(torch.device("cpu"), torch.float32))
        prepared, calls = prepare_decoding(model, torch.device("cpu")).step, []

        def step(*args, **kwargs):
            calls.append(1)
            return prepared(*args, **kwargs)

    result = evaluate_task(model, tokenizer, generation_task(items, 12), batch_size, step=step)
    assert result.predictions == expected
    assert result.metrics == {"acc": 4 / 7, "n": 7}
    assert not decoding_step or calls  # the replies' tokens after the first came from the step
    assert result.centred == 4 / 7  # chance is 0


def test_normalisation_strips_and_collapses_whitespace_and_keeps_case():
    assert normalise("  thou  art\t\n so\n") == "thou art so"
    assert normalise("ROMEO") != normalise("romeo")


def test_a_reply_ends_at_the_first_stop_string_or_end_token():
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)
    prompt = "ROMEO: what"
    full = greedy_by_hand(model, tokenizer, prompt, 10)
    text = tokenizer.decode(full)
    ids = tokenizer.encode(prompt)

    def reply(stops: tuple[str, ...], end_tokens: tuple[int, ...] = ()) -> str:
        prompts = [Prompt(ids, end_tokens, chat=False)]
        return generate_replies(model, tokenizer, prompts, lambda _: stops, 10, batch_size=1)[0]

    assert reply(()) == text  # max_new_tokens
    # as the harness: generation ends once a stop string is complete, and the text is cut before every one in it
    stops = (text[5:7], text[2:9])
    expected = text[: min(text.find(stop) + len(stop) for stop in stops)]
    for stop in stops:
        expected = expected.split(stop)[0]
    assert reply(stops) == expected
    assert reply((), (full[5],)) == tokenizer.decode(full[: full.index(full[5])])


def test_gsm8k_compares_numbers_as_the_harness_filters_and_exact_match_do():
    """acc is the harness's strict-match (the number after '#### '), acc_flexible its flexible-extract
    (the last number), both then through exact_match's regexes_to_ignore and ignore_case."""
    harness_filters = pytest.importorskip("lm_eval.filters.extraction")
    from lm_eval.api.metrics import exact_match_hf_evaluate

    reference = (
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 1,072"
    )
    replies = [
        " She sold 1072 clips.\n#### 1,072",
        " The answer is $1,072.",
        " 48 and then 1072, no: 24",
        " #### -3.50.",
        " nothing here",
        "#### 1072.",
    ]
    harness = {
        "acc": harness_filters.RegexFilter("#### (\\-?[0-9\\.\\,]+)", 0),
        "acc_flexible": harness_filters.RegexFilter("(-?[$0-9.,]{2,})|(-?[0-9]+)", -1),
    }
    ignore = [",", "\\$", "(?s).*#### ", "\\.$"]
    assert GSM8K_JUDGE.reference(reference) == "1072"
    for figure, regex_filter in harness.items():
        extracted = [picked[0] for picked in regex_filter.apply([[reply] for reply in replies], [])]
        expected = [
            exact_match_hf_evaluate([x], [reference], regexes_to_ignore=ignore, ignore_case=True)["exact_match"]
            for x in extracted
        ]
        ours = [float(GSM8K_JUDGE.figures[figure](reply) == GSM8K_JUDGE.reference(reference)) for reply in replies]
        assert ours == expected, figure
    assert GSM8K_JUDGE.figures["acc"](replies[0]) == "1072" and GSM8K_JUDGE.figures["acc"](replies[4]) == "[invalid]"
    assert GSM8K_JUDGE.figures["acc_flexible"](replies[1]) == "1072"


def test_gsm8k_records_become_the_harness_zero_shot_prompt():
    task = load_task(f"gsm8k={TASKS / 'gsm8k.jsonl'}", limit=2)
    question = json.loads((TASKS / "gsm8k.jsonl").read_text().splitlines()[0])["question"]
    assert task.kind == "generation" and task.judge is GSM8K_JUDGE
    assert task.items[0].prompt == f"Question: {question}\nAnswer:"
    assert GSM8K_JUDGE.stops == ("Question:", "</s>", "<|im_end|>") and not GSM8K_JUDGE.first_line
    assert load_task(f"gsm8k={TASKS / 'gsm8k.jsonl'}", max_new_tokens=5).judge.max_new_tokens == 5


def test_a_stop_request_ends_generation_after_the_batch():
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)
    task = load_task(str(TASKS / "line_end.jsonl"), limit=6, max_new_tokens=4)
    asked = []
    with pytest.raises(EvaluationStopped):
        evaluate_task(model, tokenizer, task, batch_size=2, stop=lambda: asked.append(1) or len(asked) == 2)
    assert len(asked) == 2  # asked after each batch, and the second ended it


def test_messages_need_a_chat_template():
    tokenizer = shakespeare_chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)
    item = Question(None, [{"role": "user", "content": "spell: dog"}], "d o g", "here item 1")
    with pytest.raises(UserError, match="here item 1: field 'messages' is a conversation, and this model's tokenizer"):
        evaluate_task(model, tokenizer, generation_task([item], 4), batch_size=1)


def test_a_chat_model_gets_every_item_through_its_template_and_its_replies_end_at_the_end_of_turn():
    tokenizer = chat_tokenizer(shakespeare_chars())
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "spell: dog"}]
    from_messages = prompt_for(tokenizer, Question(None, conversation, "d o g", "here item 1"))
    from_prompt = prompt_for(tokenizer, Question("spell: dog", None, "d o g", "here item 2"))
    assert from_messages.chat and from_messages.ids == render_prompt(conversation, tokenizer)
    assert from_prompt.ids == render_prompt(conversation[1:], tokenizer)
    assert from_prompt.ids[-11:] == [tokenizer.specials["<|im_start|>"], *tokenizer.encode("assistant\n")]
    assert tokenizer.specials["<|im_end|>"] in from_prompt.end_tokens
    # a model that answers "dog" and then ends its turn scores its reply without the end-of-turn token
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)
    reply = [*tokenizer.encode("d o g"), tokenizer.specials["<|im_end|>"]]
    assert generate_replies_of(model, tokenizer, [from_prompt], reply) == ["d o g"]


def generate_replies_of(model, tokenizer, prompts, reply: list[int]) -> list[str]:
    """generate_replies with a model that writes `reply` token by token, then its last token again."""
    step = iter(range(len(reply) + 100))

    def forced(logits):
        logits = torch.full_like(logits, -1e9)
        logits[..., reply[min(next(step), len(reply) - 1)]] = 0
        return logits

    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: forced(output))
    try:
        return generate_replies(model, tokenizer, prompts, lambda prompt: (), 20, batch_size=1)
    finally:
        handle.remove()


def test_training_scores_a_generation_task_into_metrics(tmp_path, data_dir):
    spec = str(TASKS / "line_end.jsonl")
    cfg = tiny_config(tmp_path / "run", data_dir, model__block_size=64, eval__tasks=spec, eval__items=3)
    Trainer(cfg).fit()
    last = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r][-1]
    model, tokenizer = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), tmp_path)
    result = evaluate_task(model, tokenizer, load_task(spec, 3), batch_size=32, limit=3)
    assert last["eval/line_end/acc"] == result.metrics["acc"] and last["eval/line_end/n"] == 3
    assert last["eval/centred_mean"] == result.metrics["acc"]
