"""Training on conversations: the loss counts trained tokens only (a hand computation), a micro-batch
with none is finite and adds nothing, a chat run resumes exactly, a plain run is fine-tuned on a chat
dataset with its embedding grown, and the other kind of data is refused on resume."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import trainer.loop as loop_module
from data.chat_dataset import prepare_chat
from data.conversations import IM_END, IM_START, read_conversations, render_prompt
from data.corpus import SEED, in_val
from data.loader import CONVERSATION_START, TRAINED, RandomWindows, TokenDataset, has_trained_target
from errors import UserError
from inference.load import model_from_checkpoint
from tests.conftest import FixedBatches, capture_gradients, tiny_config
from trainer.checkpoint import load_checkpoint
from trainer.loop import Trainer
from trainer.metrics import METRICS_NAME
from trainer.metrics import read_metrics as read_log
from trainer.objective import Objective

WORDS = ["cat", "dog", "horse", "lamb", "crow", "deer", "mouse", "goat", "swan", "bee"]


def read_metrics(run):
    return read_log(run / METRICS_NAME)


def write_chats(path, count=60):
    """Small conversations over the characters of Shakespeare: spelling and reversing words."""
    lines = []
    for i in range(count):
        word = WORDS[i % len(WORDS)] + "s" * (i // len(WORDS) % 3)
        turns = [{"role": "user", "content": f"Spell {word}"}, {"role": "assistant", "content": " ".join(word)}]
        if i % 4 == 0:
            turns += [{"role": "user", "content": "Back"}, {"role": "assistant", "content": word[::-1]}]
        if i % 5 == 0:
            turns.insert(0, {"role": "system", "content": "Be brief"})
        lines.append(json.dumps({"messages": turns}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, data_dir):
    """A tiny character run on Shakespeare: the model a chat dataset fine-tunes."""
    out = tmp_path_factory.mktemp("plain") / "run"
    Trainer(tiny_config(out, data_dir, model__block_size=64, train__max_iters=4, train__eval_interval=4)).fit()
    return out


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, data_dir, plain_run):
    """data_dir/chat: conversations rendered with the plain run's characters and the built-in template."""
    root = tmp_path_factory.mktemp("chat_data")
    chats = write_chats(root / "chats.jsonl")
    prepare_chat(read_conversations(str(chats)), str(plain_run), root / "chat", source="chats.jsonl", block_size=64,
                 val_fraction=0.25, too_long="truncate")  # fmt: skip
    return root


def chat_config(out, chat_data, **overrides):
    return tiny_config(out, chat_data, data__dataset="chat", **{"model__block_size": 64} | overrides)


def test_chat_dataset_extends_the_runs_vocabulary(chat_data, data_dir):
    chat, plain = TokenDataset(chat_data / "chat"), TokenDataset(data_dir / "shakespeare_char")
    assert chat.meta["chars"] == plain.meta["chars"]
    assert chat.meta["chat"]["added_specials"] == ["<|endoftext|>", IM_START, IM_END]
    assert chat.vocab_size == plain.vocab_size + 3


def test_masked_loss_is_the_mean_over_trained_tokens_of_all_micro_batches(tmp_path, chat_data):
    """Two micro-batches with different numbers of trained targets (one with none at all): the step's
    loss and gradients are those of the sum of the trained targets' losses over their total number."""
    trainer = Trainer(chat_config(tmp_path / "run", chat_data, train__gradient_accumulation_steps=2))
    x = torch.randint(0, trainer.dataset.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, trainer.dataset.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
    y[:4] = -1  # the first micro-batch: prompts only
    y[4:, ::3] = -1
    trainer.batches = FixedBatches(x, y, 4)
    logits, _ = trainer.model(x)
    kept = y != -1
    expected = F.cross_entropy(logits[kept], y[kept])  # by hand: the trained targets' mean, over both
    expected.backward()
    by_hand = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    gradients = capture_gradients(trainer)
    loss = trainer.train_step(lr=0.0)
    torch.testing.assert_close(loss, expected.detach())
    assert int(trainer.trained_tokens) == int(kept.sum())
    for name, grad in gradients.items():
        torch.testing.assert_close(grad, by_hand[name], rtol=1e-4, atol=1e-7)


def test_a_micro_batch_without_trained_tokens_is_finite_and_adds_nothing(tmp_path, chat_data):
    trainer = Trainer(chat_config(tmp_path / "run", chat_data))
    x = torch.randint(0, trainer.dataset.vocab_size, (4, 64))
    _, loss = trainer.model(x, torch.full_like(x, -1))
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in trainer.model.parameters())
    trainer.batches = FixedBatches(x, torch.full_like(x, -1), 4)
    assert trainer.train_step(lr=1e-3).item() == 0.0


def test_a_chat_step_without_a_trained_token_logs_no_loss(tmp_path, chat_data):
    """Its loss would be a mean over nothing: the record keeps its trained_tokens (0) and has no loss;
    the next step, which has trained tokens, logs one."""
    run = tmp_path / "run"
    trainer = Trainer(chat_config(run, chat_data, train__max_iters=2, train__eval_interval=2))
    draw, drawn = trainer.batches.next_batch, []

    def first_without_targets(*shape):
        x, y = draw(*shape)
        drawn.append(x)
        return (x, torch.full_like(y, -1)) if len(drawn) == 1 else (x, y)

    trainer.batches.next_batch = first_without_targets
    trainer.fit()
    steps = [r for r in read_metrics(run) if "trained_tokens" in r]
    assert [(r["step"], r["trained_tokens"] > 0, "loss" in r) for r in steps] == [(1, False, False), (2, True, True)]


def test_an_evaluation_whose_batches_hold_no_trained_token_reports_no_loss(tmp_path, chat_data, monkeypatch, capsys):
    """A split whose eval_iters batches hold no trained target has no mean: the line says so, and the
    record leaves its loss, perplexity and bits per byte out (0, 1 and 0 would look like a perfect model)."""

    class ValWithoutTargets(RandomWindows):
        def next_batch(self, *shape):
            x, y = super().next_batch(*shape)
            return (x, torch.full_like(y, -1)) if self.split == "val" else (x, y)

    monkeypatch.setattr(loop_module, "RandomWindows", ValWithoutTargets)
    run = tmp_path / "run"
    Trainer(chat_config(run, chat_data, train__max_iters=2, train__eval_interval=2)).fit()
    evaluations = [r for r in read_metrics(run) if "train_loss" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    assert not any(key.startswith("val_") for r in evaluations for key in r)
    out = capsys.readouterr().out
    assert "step 2: train loss " in out
    assert "val loss undefined (its 2 evaluation batches hold no trained token; a larger train.eval_iters" in out


def test_a_trained_token_counts_only_where_a_training_window_reaches_it():
    """Windows of block_size + 1 tokens start at a conversation that starts block_size + 1 tokens or more
    before the split's end; their targets are their tokens after the first."""
    S, R = CONVERSATION_START, TRAINED
    late = np.array([S, 0, 0, 0, S, 0, R, 0], dtype=np.uint8)  # the second conversation's reply
    assert not has_trained_target(late, 4)  # only the first conversation has a window: targets 1 .. 4
    assert has_trained_target(late, 6)  # its window reaches position 6
    assert not has_trained_target(np.array([S | R, 0, 0, 0, 0], dtype=np.uint8), 3)  # a window's first token
    assert not has_trained_target(np.array([S, 0, R], dtype=np.uint8), 3)  # no window fits


def test_a_split_whose_replies_are_all_cut_off_is_refused_where_it_is_made(tmp_path, plain_run):
    """--too-long truncate that leaves the val split no trained token: refused, naming the split, how
    many conversations were cut and the longest, and nothing is written."""
    long = [{"role": "user", "content": "Spell " + "horse " * 12}, {"role": "assistant", "content": "h o r s e"}]
    short = [{"role": "user", "content": "Spell cat"}, {"role": "assistant", "content": "c a t"}]
    records = [long if in_val(i, SEED, 0.25) else short for i in range(40)]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records), encoding="utf-8")
    cut = sum(m is long for m in records)
    message = (
        rf"the val split of chats.jsonl has no trained token within --block-size=64 tokens of a conversation's "
        rf"start \({cut} of its {cut} conversation\(s\) cut to that length by --too-long truncate\), so training "
        rf"would report a loss over nothing \(pass a larger --block-size, up to the model's: the longest "
        rf"conversation is 108 tokens"  # 21 of the template around 78 + 9 characters
    )
    with pytest.raises(UserError, match=message):
        prepare_chat(read_conversations(str(chats)), str(plain_run), tmp_path / "chat", source="chats.jsonl",
                     block_size=64, val_fraction=0.25, too_long="truncate")  # fmt: skip
    assert not (tmp_path / "chat").exists()


def test_a_chat_split_without_a_trained_token_is_refused_before_training(tmp_path, chat_data):
    data = tmp_path / "data"
    shutil.copytree(chat_data / "chat", data / "chat")
    mask = data / "chat" / "train.mask.bin"
    mask.write_bytes(bytes(flags & ~TRAINED for flags in mask.read_bytes()))
    message = "the train split of .* has no trained token that a window of model.block_size=64 tokens reaches"
    with pytest.raises(UserError, match=message):
        Trainer(chat_config(tmp_path / "run", data))
    assert not (tmp_path / "run").exists()


def test_val_bench_scores_a_chat_run_on_its_trained_tokens_and_refuses_a_split_without_one(tmp_path, chat_data):
    """bench/val.py on a chat dataset: a window at every conversation, the trained tokens its targets
    (the trainer's metric), their mean computed by hand; a split with none is refused, not scored 0."""
    from bench.val import split_loss

    dataset = TokenDataset(chat_data / "chat")
    model = Trainer(chat_config(tmp_path / "run", chat_data)).model.eval()
    loss, windows = split_loss(model, Objective(model.config, 0), dataset, "val", 64, stride=16)
    starts = dataset.window_starts("val", 64)
    tokens, mask = torch.from_numpy(dataset.tokens("val").astype(np.int64)), dataset.mask("val")
    x = torch.stack([tokens[i : i + 64] for i in starts])
    y = torch.stack([tokens[i + 1 : i + 65] for i in starts])
    trained = torch.from_numpy(np.stack([mask[i + 1 : i + 65] & TRAINED for i in starts]).astype(bool))
    with torch.no_grad():
        logits, _ = model(x)
    assert windows == len(starts)
    assert loss == pytest.approx(F.cross_entropy(logits[trained], y[trained]).item(), rel=1e-5)
    shutil.copytree(chat_data / "chat", tmp_path / "untrained")
    untrained = tmp_path / "untrained" / "val.mask.bin"
    untrained.write_bytes(bytes(flags & ~TRAINED for flags in untrained.read_bytes()))
    with pytest.raises(UserError, match="no window of the val split of .*untrained holds a trained token"):
        split_loss(model, Objective(model.config, 0), TokenDataset(tmp_path / "untrained"), "val", 64, stride=16)


def test_chat_windows_start_at_conversations_and_train_replies_only(chat_data):
    from data.loader import RandomWindows
    from data.tokenizer import tokenizer_from_meta

    dataset = TokenDataset(chat_data / "chat")
    tokenizer = tokenizer_from_meta(dataset.meta)
    x, y = RandomWindows(dataset, "train", 8, 64, 0, torch.device("cpu")).next_batch()
    for row, targets in zip(x.tolist(), y.tolist(), strict=True):
        text = tokenizer.decode(row)
        assert text.startswith("<|im_start|>")
        learnt = tokenizer.decode([t for t in targets if t != -1])
        assert "user" not in learnt and "Spell" not in learnt  # prompts are never targets
        assert learnt.count(IM_END) >= 1


def test_plain_run_fine_tunes_on_a_chat_dataset_with_its_embedding_grown(tmp_path, chat_data, plain_run):
    run = tmp_path / "chat_run"
    trainer = Trainer(chat_config(run, chat_data, train__init_from=str(plain_run), train__max_iters=4,
                                  model__attn_documents=True))  # fmt: skip
    saved = torch.load(plain_run / "ckpt.pt", weights_only=True)["model"]["transformer.wte.weight"]
    wte = trainer.model.transformer.wte.weight.detach()
    assert wte.shape[0] == saved.shape[0] + 3
    torch.testing.assert_close(wte[: saved.shape[0]], saved)
    torch.testing.assert_close(wte[saved.shape[0] :], saved.mean(0, keepdim=True).expand(3, -1))
    trainer.fit()
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records and all(0 < r["trained_tokens"] < 4 * 64 for r in records)


def test_chat_run_resumes_to_the_same_losses(tmp_path, chat_data):
    common = dict(model__dropout=0.1, train__max_iters=8, train__eval_interval=4, train__gradient_accumulation_steps=2)
    Trainer(chat_config(tmp_path / "whole", chat_data, **common)).fit()
    Trainer(chat_config(tmp_path / "split", chat_data, **common | {"train__max_iters": 4})).fit()
    Trainer(chat_config(tmp_path / "split", chat_data, **common | {"train__init_from": "resume"})).fit()

    def losses(run):
        return [(r["step"], r["loss"], r["trained_tokens"]) for r in read_metrics(run) if "loss" in r]

    assert losses(tmp_path / "split") == losses(tmp_path / "whole")


def test_a_chat_run_trains_on_a_schedule_of_rows_that_hold_every_conversation(tmp_path, chat_data):
    longest = TokenDataset(chat_data / "chat").meta["chat"]["longest"]  # 64: prepared for rows of 64
    schedules = dict(
        train__block_size_schedule=f"{longest}:0.5", train__batch_size_schedule="2:0.5", train__max_iters=4
    )
    run = chat_config(tmp_path / "run", chat_data, model__block_size=96, train__eval_interval=4, **schedules)
    trainer = Trainer(run)
    forward, shapes = trainer.forward, []

    def record_shape(x, y, **kwargs):
        if trainer.model.training:
            shapes.append((*x.shape, int((y != -1).sum())))  # (B, T, trained targets)
        return forward(x, y, **kwargs)

    trainer.forward = record_shape
    trainer.fit()
    assert [(B, T) for B, T, _ in shapes] == [(2, longest), (2, longest), (4, 96), (4, 96)]
    assert all(trained > 0 for *_, trained in shapes)
    short = f"{longest - 1}:0.5"
    message = rf"train.block_size_schedule='{short}' trains rows of {longest - 1} tokens, but .* holds a conversation"
    with pytest.raises(UserError, match=message + rf" of {longest} tokens, which they would cut"):
        Trainer(chat_config(tmp_path / "short", chat_data, train__block_size_schedule=short))


def test_resuming_a_plain_run_on_a_chat_dataset_is_refused(tmp_path, chat_data, plain_run, data_dir):
    with pytest.raises(UserError, match="holds conversations, but the run in .* was trained on plain text"):
        Trainer(chat_config(tmp_path / "x", chat_data, train__init_from="resume", train__out_dir=str(plain_run)))


def test_a_chat_model_fine_tuned_on_plain_text_is_refused(tmp_path, chat_data, data_dir):
    chat_run = tmp_path / "chat_run"
    Trainer(chat_config(chat_run, chat_data, train__max_iters=2, train__eval_interval=2)).fit()
    with pytest.raises(UserError, match="plain text, but the run in .* was trained on conversations"):
        Trainer(tiny_config(chat_run, data_dir, train__init_from="resume"))
    with pytest.raises(UserError, match="does not extend the vocabulary .* with a chat template"):
        Trainer(tiny_config(tmp_path / "plain", data_dir, train__init_from=str(chat_run)))


@pytest.mark.parametrize("documents", [True, False])
def test_no_gradient_flows_across_conversations_packed_in_a_window(tmp_path, plain_run, documents):
    """The trained targets of the conversations after a window's first send gradient to none of the first
    conversation's tokens (with model.attn_documents; without it they do: the test can fail)."""
    from data.loader import RandomWindows
    from data.tokenizer import tokenizer_from_meta

    chats = tmp_path / "short.jsonl"  # conversations of about 25 tokens: two or three to a 64-token window
    turns = [[{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}] for w in WORDS]
    chats.write_text("".join(json.dumps({"messages": t}) + "\n" for t in turns * 4), encoding="utf-8")
    prepare_chat(read_conversations(str(chats)), str(plain_run), tmp_path / "chat", source="short.jsonl",
                 block_size=64, val_fraction=0.25)  # fmt: skip
    dataset = TokenDataset(tmp_path / "chat")
    eot = tokenizer_from_meta(dataset.meta).eot_token  # each conversation ends with it: the next starts there
    trainer = Trainer(chat_config(tmp_path / "run", tmp_path, model__attn_documents=documents))
    x, y = RandomWindows(dataset, "train", 8, 64, 0, torch.device("cpu")).next_batch()
    starts = [ids.index(eot, 1) for ids in x.tolist()]  # the second document's first token
    later = torch.arange(64)[None, :] >= torch.tensor(starts)[:, None]  # (B, T): the conversations after the first
    embeddings = []
    trainer.model.transformer.wte.register_forward_hook(lambda m, i, out: embeddings.append(out) or out.retain_grad())
    targets = y.masked_fill(~later, -1)
    assert (targets != -1).sum(1).min() > 0  # every row trains on a reply after its first conversation
    _, loss = trainer.model(x, targets)
    loss.backward()
    reached = embeddings[0].grad.abs().sum(-1) > 0  # (B, T): the positions the loss sends gradient to
    assert reached[later].any()
    assert not reached[~later].any() if documents else reached[~later].all()


def test_lora_on_a_chat_dataset_adapts_a_chat_run_and_loads_as_base_and_adapters(tmp_path, chat_data, plain_run):
    """LoRA and chat together: a run fine-tuned on conversations (its vocabulary holds the template's
    tokens) is adapted further; the adapters alone train on the replies, and the run loads for
    chatting as the base with its adapters merged."""
    chat_run = tmp_path / "chat_run"
    Trainer(chat_config(chat_run, chat_data, train__init_from=str(plain_run), train__max_iters=4)).fit()
    run = tmp_path / "lora_chat"
    lora = dict(lora__rank=4, optim__optimizer="adamw", optim__learning_rate=1e-2, model__attn_documents=True)
    Trainer(chat_config(run, chat_data, train__init_from=str(chat_run), train__max_iters=6, **lora)).fit()
    checkpoint = load_checkpoint(run / "ckpt.pt")
    assert checkpoint["model"] and all(".lora_" in name for name in checkpoint["model"])
    records = [r for r in read_metrics(run) if "loss" in r]
    assert records and all(r["trained_tokens"] > 0 for r in records)
    model, tokenizer = model_from_checkpoint(checkpoint, run / "ckpt.pt")
    prompt = torch.tensor([render_prompt([{"role": "user", "content": "hello"}], tokenizer)])
    logits, _ = model(prompt)
    assert torch.isfinite(logits).all()


def test_lora_refuses_a_base_without_the_chat_templates_tokens(tmp_path, chat_data, plain_run):
    """Frozen, the rows grown for the template's tokens would all be the mean row: the model could
    not tell <|im_start|> from <|im_end|>, nor end a reply."""
    config = chat_config(tmp_path / "run", chat_data, train__init_from=str(plain_run), lora__rank=4)
    with pytest.raises(UserError, match="the dataset has 3 token\\(s\\) that train.init_from=.* has no embedding"):
        Trainer(config)
