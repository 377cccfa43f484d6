"""Reinforcement learning on checked answers ([rl], docs/rl.md): the loss is a hand computation on a fixed
batch of answers and rewards (a group of equal rewards, an answer cut at the length limit, two
micro-batches, several updates with the clipped ratio and the KL term), the log-probabilities recorded
while sampling are a full forward pass's, an answer is what sample.py --chat prints for its seed, a run
resumes bit for bit after SIGKILL and honours SIGTERM while it samples, and the checkers are
lm-evaluation-harness's filters on tricky answers."""

import importlib.util
import itertools
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rl.rollout as rollout_module
from data.chat_dataset import prepare_chat
from data.conversations import end_of_turn, read_conversations
from errors import UserError
from evals.evaluate import prompt_for
from evals.tasks import load_task
from inference.load import model_from_checkpoint
from interop.pretrained import export_model
from plot import Run, downstream_keys, loss_figure
from rl.policy_gradient import Sampled, answer_log_probs, group_advantages, held_out_seed, pass_at
from rl.rewards import checker
from rl.rollout import Answer, sample_answers
from tests.conftest import PROJECT_ROOT, capture_gradients, run_entry_point, tiny_config
from trainer.checkpoint import load_checkpoint
from trainer.config import config_to_toml
from trainer.loop import Trainer
from trainer.metrics import METRICS_NAME, read_metrics

WORDS = ["cat", "dog", "bee", "owl", "hen", "ram"]  # few and short: a tiny model spells some of them right


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def question(word: str) -> dict:
    return {"messages": [{"role": "user", "content": f"Spell {word}"}], "answer": " ".join(word)}


@pytest.fixture(scope="module")
def chat_root(tmp_path_factory, data_dir) -> Path:
    """A tiny character model fine-tuned a little on spelling conversations (root/chat), its chat
    dataset (root/data/chat), and questions about the same words (root/questions.jsonl)."""
    root = tmp_path_factory.mktemp("rl")
    plain = root / "plain"
    Trainer(tiny_config(plain, data_dir, model__block_size=64, train__max_iters=4, train__eval_interval=4)).fit()
    chats = [
        {"messages": [{"role": "user", "content": f"Spell {word}"}, {"role": "assistant", "content": " ".join(word)}]}
        for word in WORDS * 8
    ]
    write_jsonl(root / "chats.jsonl", chats)
    prepare_chat(read_conversations(str(root / "chats.jsonl")), str(plain), root / "data" / "chat",
                 source="chats.jsonl", block_size=64, val_fraction=0.25)  # fmt: skip
    chat = dict(data__dataset="chat", model__block_size=64, train__init_from=str(plain))
    quick = dict(optim__learning_rate=1e-2, optim__min_lr=1e-3, optim__lr_decay_iters=150, train__log_interval=50)
    Trainer(
        tiny_config(root / "chat", root / "data", train__max_iters=150, train__eval_interval=150, **chat, **quick)
    ).fit()
    write_jsonl(root / "questions.jsonl", [question(word) for word in WORDS])
    return root


def rl_config(out: Path, root: Path, **overrides):
    values = dict(
        data__dataset="chat",
        model__block_size=64,
        train__init_from=str(root / "chat"),
        train__max_iters=6,
        train__eval_interval=3,
        rl__task=str(root / "questions.jsonl"),
        rl__questions=4,
        rl__samples=4,
        rl__max_new_tokens=8,
        rl__temperature=0.7,
        rl__top_k=5,
    )
    return tiny_config(out, root / "data", **values | overrides)


def test_sampled_log_probs_equal_a_full_forward_pass(tmp_path, chat_root):
    """The log-probability the sampler recorded for each answer token (under the temperature's
    distribution over the top-k tokens) is what one forward pass over the prompt and answer gives,
    row by row alone and as the loss's padded micro-batch reads it: within 1e-5."""
    trainer = Trainer(rl_config(tmp_path / "run", chat_root))
    objective = trainer.objective
    sampled = objective._sample(0, None)
    assert len(sampled.answers) == 16 and any(len(a.tokens) > 1 for a in sampled.answers)
    model = trainer.model.eval()
    with torch.no_grad():
        for prompt, answer in zip(sampled.prompts, sampled.answers, strict=True):
            logits, _ = model(torch.tensor([prompt + answer.tokens[:-1]]))
            last = logits[0, -len(answer.tokens) :].float() / 0.7  # the positions that predict the answer
            kept = last >= last.topk(5, dim=-1).values[:, -1:]  # renormalised over the 5 most likely tokens
            by_hand = last.masked_fill(~kept, float("-inf")).log_softmax(dim=-1)
            expected = by_hand[torch.arange(len(answer.tokens)), torch.tensor(answer.tokens)]
            torch.testing.assert_close(answer.log_probs, expected, rtol=0, atol=1e-5)
        for batch in objective._micro_batches(sampled, 2):  # as the loss computes them, left padded
            logits, _ = model(batch.inputs, pad=batch.pad, logits_to_keep=batch.targets.size(1))
            recomputed = answer_log_probs(logits, batch.targets, 0.7, 5)
            torch.testing.assert_close(recomputed, batch.sampled_log_probs, rtol=0, atol=1e-5)


def visible_reply(answer: Answer, tokenizer) -> str:
    """An answer as sample.py --chat shows it: up to the end of the turn, without the template's tokens."""
    specials = set(tokenizer.specials.values())
    return tokenizer.decode([token for token in answer.tokens if token not in specials])


def test_an_answer_is_what_sample_py_chat_prints_for_its_seed(chat_root, monkeypatch, capfd):
    model, tokenizer = model_from_checkpoint(load_checkpoint(chat_root / "chat" / "ckpt.pt"), chat_root / "chat")
    prompt = prompt_for(tokenizer, load_task(str(chat_root / "questions.jsonl")).items[2])  # Spell bee
    seeds = [11, 12, 13, 14]
    sampling = rollout_module.Sampling(0.7, 5, 8, tokenizer.vocab_size)
    answers, _ = sample_answers(model, tokenizer, [prompt] * len(seeds), seeds, sampling, 4, ())
    assert len({tuple(answer.tokens) for answer in answers}) > 1  # the seeds draw different answers
    capfd.readouterr()
    for seed, answer in zip(seeds, answers, strict=True):
        args = ["--out-dir", str(chat_root / "chat"), "--chat", "--prompt", "Spell bee", "--seed", str(seed)]
        args += ["--temperature", "0.7", "--top-k", "5", "--max-new-tokens", "8"]
        assert run_entry_point("sample.py", args, monkeypatch) == 0
        assert capfd.readouterr().out == visible_reply(answer, tokenizer) + "\n"


# --- the loss on a fixed batch, by hand ---


def fixed_sampled(vocab_size: int, end: int, rows: slice = slice(None)) -> Sampled:
    """Three questions of four answers (rows[...]: a share of them): the first group's rewards differ,
    the second's are all 0 (no gradient), the third mixes rewards and holds an answer cut at the length
    limit (no end token). The recorded log-probabilities are set apart from the model's own, so that
    the ratios differ from 1 and some fall outside the clip range."""
    generator = torch.Generator().manual_seed(5)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    answers, rewards = [], [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]]
    lengths = [[2, 3, 1, 4], [3, 3, 2, 1], [5, 2, 8, 3]]
    for q in range(len(prompts)):
        for j, length in enumerate(lengths[q]):
            cut = (q, j) == (2, 2)
            tokens = torch.randint(0, vocab_size - 3, (length,), generator=generator).tolist()
            if not cut:
                tokens[-1] = end
            log_probs = -torch.rand(length, generator=generator) * 3
            answers.append(Answer(tokens, log_probs, not cut, ""))
    prompt_rows = [prompt for prompt in prompts for _ in range(4)]
    shared = Sampled(prompt_rows, answers, torch.tensor(rewards), 0.1)
    questions = range(3)[rows]
    picked = [q * 4 + j for q in questions for j in range(4)]
    return Sampled([shared.prompts[i] for i in picked], [shared.answers[i] for i in picked],
                   shared.rewards[rows], 0.1)  # fmt: skip


def hand_loss(model, reference, sampled: Sampled, temperature, top_k, clip, kl, std, drop=False) -> torch.Tensor:
    """The step's loss written out token by token: every answer token's term, summed, over their number
    (drop: of the groups whose rewards differ only)."""
    rewards = sampled.rewards
    terms = []
    for q in range(rewards.size(0)):
        if drop and len(set(rewards[q].tolist())) == 1:
            continue
        mean = sum(rewards[q].tolist()) / rewards.size(1)
        deviation = (sum((r - mean) ** 2 for r in rewards[q].tolist()) / (rewards.size(1) - 1)) ** 0.5
        for j in range(rewards.size(1)):
            advantage = float(rewards[q, j]) - mean
            if std:
                advantage /= deviation + 1e-4
            row = q * rewards.size(1) + j
            prompt, answer = sampled.prompts[row], sampled.answers[row]
            inputs = torch.tensor([prompt + answer.tokens[:-1]])
            logits = model(inputs)[0][0, -len(answer.tokens) :].float()
            with torch.no_grad():
                reference_logits = reference(inputs)[0][0, -len(answer.tokens) :].float() if kl else None
            for t, token in enumerate(answer.tokens):
                scaled = logits[t] / temperature
                kth = scaled.topk(top_k).values[-1]
                new = scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(dim=-1)[token]
                ratio = torch.exp(new - answer.log_probs[t])
                clipped = ratio.clamp(1 - clip, 1 + clip)
                term = -torch.minimum(ratio * advantage, clipped * advantage)
                if kl:  # at the temperature, untruncated
                    ref = F.log_softmax(reference_logits[t] / temperature, dim=-1)[token]
                    policy = F.log_softmax(scaled, dim=-1)[token]
                    term = term + kl * (torch.exp(ref - policy) - (ref - policy) - 1)
                terms.append(term)
    return torch.stack(terms).sum() / len(terms)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(rl__updates=2, rl__clip=0.2, rl__kl=0.1, rl__std_advantage=True),
        dict(rl__drop_equal_groups=True),
    ],
    ids=["defaults", "clipped-kl-std", "drop-equal-groups"],
)
def test_the_loss_is_the_hand_computation_over_all_answer_tokens_of_the_step(tmp_path, chat_root, options):
    """Two micro-batches of three groups (one of equal rewards, one with an answer cut off): the step's
    loss and gradients are those of the sum of every answer token's term over their number, whatever
    micro-batch each fell in; the equal group's answers add nothing but count in that number, unless
    rl.drop_equal_groups leaves them out of it too."""
    cfg = rl_config(tmp_path / "run", chat_root, rl__questions=3, train__gradient_accumulation_steps=2, **options)
    trainer = Trainer(cfg)
    rl = trainer.cfg.rl
    end = end_of_turn(trainer.tokenizer)[0]
    sampled = fixed_sampled(trainer.tokenizer.vocab_size, end)
    trainer.objective._sample = lambda step, stop: sampled
    model = trainer.model
    drop = rl.drop_equal_groups
    expected = hand_loss(model, trainer.objective.reference, sampled, 0.7, 5, rl.clip, rl.kl, rl.std_advantage, drop)
    expected.backward()
    by_hand = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    gradients = capture_gradients(trainer)
    loss = trainer.train_step(lr=0.0)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    trained = sampled.answers[:4] + sampled.answers[8:] if drop else sampled.answers  # the second group: equal
    assert int(trainer.trained_tokens) == sum(len(answer.tokens) for answer in trained)
    for name, grad in gradients.items():
        torch.testing.assert_close(grad, by_hand[name], rtol=1e-4, atol=1e-6, msg=name)
    figures, _ = trainer.objective.report()
    assert figures["rl/reward"] == pytest.approx(5 / 12) and figures["rl/equal_groups"] == pytest.approx(1 / 3)
    assert figures["rl/cut_off"] == pytest.approx(1 / 12)


def test_a_step_of_equal_groups_only_trains_on_nothing_when_they_are_dropped(tmp_path, chat_root):
    """With rl.drop_equal_groups and every group's rewards equal, each of the two micro-batches still
    runs (a filler row each) but holds no answer token: the loss and every gradient are 0."""
    cfg = rl_config(tmp_path / "run", chat_root, rl__questions=3, rl__drop_equal_groups=True,
                    train__gradient_accumulation_steps=2)  # fmt: skip
    trainer = Trainer(cfg)
    sampled = fixed_sampled(trainer.tokenizer.vocab_size, end_of_turn(trainer.tokenizer)[0])
    sampled.rewards = torch.tensor([[1.0] * 4, [0.0] * 4, [1.0] * 4])
    trainer.objective._sample = lambda step, stop: sampled
    batches, counts = trainer.objective.draw(0, 2)
    assert [len(batch.targets) for batch in batches] == [1, 1] and [int(count) for count in counts] == [0, 0]
    trainer.objective.uses_left = 0
    gradients = capture_gradients(trainer)
    assert float(trainer.train_step(lr=1e-2)) == 0.0 and int(trainer.trained_tokens) == 0
    assert gradients and all(not grad.any() for grad in gradients.values())


@pytest.mark.parametrize("drop", [False, True])
def test_a_step_of_mostly_equal_groups_is_noted_once_naming_rl_drop_equal_groups(tmp_path, chat_root, drop):
    objective = Trainer(rl_config(tmp_path / "run", chat_root, rl__drop_equal_groups=drop)).objective
    objective.figures = {"rl/equal_groups": 0.75}
    _, note = objective.report()
    assert note.startswith("75% of this step's questions got the same reward for all their 4 answers")
    assert ("they are left out of the update" in note) == drop and "rl.drop_equal_groups" in note
    assert objective.report()[1] is None  # once a run


def test_an_equal_group_gives_zero_advantages_and_std_divides_only_the_others():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert group_advantages(rewards, False).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4]
    scaled = group_advantages(rewards, True)
    assert scaled[1].tolist() == [0.0] * 4
    torch.testing.assert_close(scaled[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5774 + 1e-4), rtol=1e-4, atol=0)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_unbiased_estimate_a_brute_force_count_gives(n):
    """For every number c of right answers among n and every k reported: the share of all the ways to
    choose k of the n answers that hold a right one, counted one by one."""
    for c in range(n + 1):
        answers = [1.0] * c + [0.0] * (n - c)
        figures = pass_at(torch.tensor([answers]))
        assert list(figures) == [k for k in (1, 2, 4, 5, 8) if k <= n and (k & (k - 1) == 0 or k == n)]
        for k, value in figures.items():
            draws = list(itertools.combinations(answers, k))
            assert value == pytest.approx(sum(max(draw) for draw in draws) / len(draws), abs=1e-12), (n, c, k)
    # the mean over the questions: pass@1 is the share of right answers, pass@2 of 3 answers per question
    figures = pass_at(torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    assert figures == {1: pytest.approx(1 / 3), 2: pytest.approx((2 / 3 + 0 + 1) / 3), 3: pytest.approx(2 / 3)}


def held_out(path: Path) -> dict:
    """The held-out scoring of the two-process runs: 5 questions of the file (shared 3 and 2), 3 answers each."""
    return dict(rl__heldout=str(path), rl__eval_items=5, rl__eval_samples=3)


def questions_answered_as_sampled(trainer: Trainer, path: Path) -> Path:
    """The held-out questions with, for answer, the reply the trainer's model samples first to each (the
    tiny model spells none right): a scoring finds some answers right and some wrong."""
    scoring = trainer.tasks[-1]
    seeds = [[held_out_seed(trainer.cfg.train.seed, item, 0, 3)] for item in range(5)]
    answers, _, _ = scoring.questions.ask(trainer.model, trainer.tokenizer, list(range(5)), seeds,
                                          scoring.sampling, 4, False, None)  # fmt: skip
    items = [item | {"answer": answer.text} for item, answer in zip(map(question, WORDS), answers, strict=False)]
    return write_jsonl(path, items)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_the_loss_over_two_processes_is_the_hand_computation_over_both(tmp_path, chat_root, parallelism):
    """Under torchrun with DDP or FSDP2 (gloo), each process trains its own share of the answers (the first group, the
    other two), one micro-batch each: the averaged gradients are the hand computation's over all the
    step's answer tokens. Each process answers its share of the held-out questions, and the figures are
    one process's scoring them all."""
    import os

    out = tmp_path / "after_step.pt"
    probe = Trainer(rl_config(tmp_path / "probe", chat_root, **held_out(chat_root / "questions.jsonl")))
    heldout = questions_answered_as_sampled(probe, tmp_path / "heldout.jsonl")
    env = os.environ | {"PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1"}
    worker = [str(PROJECT_ROOT / "tests" / "rl_worker.py"), str(chat_root), str(out), parallelism, str(heldout)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *worker]
    result = subprocess.run(command, cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    distributed = torch.load(out, weights_only=True)
    trainer = Trainer(rl_config(tmp_path / "run", chat_root, rl__questions=3, **held_out(heldout)))
    alone, _ = trainer.tasks[-1].score(trainer.model, None)
    assert distributed["held_out"] == alone and 0 < alone["rl/pass@1"] < 1
    assert distributed["held_out_asked"] == [3, 3]  # of 5 questions: 3, and 2 and the first again, unscored
    sampled = fixed_sampled(trainer.tokenizer.vocab_size, end_of_turn(trainer.tokenizer)[0])
    expected = hand_loss(trainer.model, None, sampled, 0.7, 5, 0.2, 0.0, False)
    expected.backward()
    assert distributed["trained_tokens"] == sum(len(answer.tokens) for answer in sampled.answers)
    torch.testing.assert_close(distributed["loss"], expected.detach(), rtol=1e-5, atol=1e-6)
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(distributed["gradients"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


# --- runs that stop and resume ---


def rl_records(run: Path) -> list[tuple]:
    """What the run logged, but the wall times and speeds: its steps' losses and answers, its evaluations."""
    timed = ("time", "rl/sampled_tokens_per_sec")
    return [tuple(sorted((k, v) for k, v in r.items() if k not in timed)) for r in read_metrics(run / METRICS_NAME)]


def start_rl(config: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", "--config", str(config), *args],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_an_rl_run_killed_at_a_random_step_resumes_bit_for_bit(tmp_path, chat_root):
    """SIGKILL anywhere (in sampling, in an update, in a checkpoint write): the resumed run draws the
    same questions and seeds, samples the same answers and logs the same losses, rewards and held-out
    pass@k as the run that was never stopped (rl.updates=2: the answers of a step half trained on are in
    the checkpoint too)."""
    extra = dict(train__max_iters=16, train__eval_interval=2, train__log_interval=1, rl__updates=2,
                 rl__heldout=str(chat_root / "questions.jsonl"), rl__eval_items=3, rl__eval_samples=2)  # fmt: skip
    configs = {}
    for name in ("whole", "killed"):
        configs[name] = tmp_path / f"{name}.toml"
        configs[name].write_text(config_to_toml(rl_config(tmp_path / name, chat_root, **extra)))
    whole = start_rl(configs["whole"])
    assert whole.wait(timeout=300) == 0, whole.communicate()
    kill_after = random.randint(3, 14)
    killed = start_rl(configs["killed"])
    deadline = time.monotonic() + 120
    while (
        not (tmp_path / "killed" / METRICS_NAME).exists()
        or max((r["step"] for r in read_metrics(tmp_path / "killed" / METRICS_NAME)), default=0) < kill_after
    ):
        assert killed.poll() is None and time.monotonic() < deadline, killed.communicate()
        time.sleep(0.02)
    killed.kill()
    killed.communicate()
    resumed = start_rl(configs["killed"], "--train.init_from=resume")
    assert resumed.wait(timeout=300) == 0, resumed.communicate()
    assert rl_records(tmp_path / "killed") == rl_records(tmp_path / "whole"), f"killed after step {kill_after}"


def test_sigterm_while_answers_are_sampled_drops_the_step_and_resumes_bit_for_bit(tmp_path, chat_root, monkeypatch):
    """The sampling of a step is cut after the batch of answers the signal came in (here 2 of 4): the
    step is dropped (its questions' seeds too), the checkpoint holds the step before, and the resumed
    run repeats the uninterrupted one."""
    run = dict(train__max_iters=6, train__eval_interval=3, rl__sample_batch_size=4, rl__updates=2)
    Trainer(rl_config(tmp_path / "whole", chat_root, **run)).fit()
    trainer = Trainer(rl_config(tmp_path / "split", chat_root, **run))
    sample_batch, batches = rollout_module._sample_batch, []

    def signal_in_second_batch(*args, **kwargs):
        if trainer.step == 4 and trainer.model.training is False:
            batches.append(4)
            if len(batches) == 2:
                signal.raise_signal(signal.SIGTERM)
        return sample_batch(*args, **kwargs)

    monkeypatch.setattr(rollout_module, "_sample_batch", signal_in_second_batch)
    assert trainer.fit() == signal.SIGTERM
    assert len(batches) == 2  # of the 16 answers' 4 batches: none after the one the signal came in
    assert load_checkpoint(tmp_path / "split" / "ckpt.pt")["step"] == 4
    monkeypatch.setattr(rollout_module, "_sample_batch", sample_batch)
    assert Trainer(rl_config(tmp_path / "split", chat_root, train__init_from="resume", **run)).fit() is None
    assert rl_records(tmp_path / "split") == rl_records(tmp_path / "whole")


def test_a_run_records_rewards_answers_and_held_out_pass_at_k_and_plot_draws_them(
    tmp_path, chat_root, capsys, monkeypatch
):
    run = tmp_path / "run"
    heldout = dict(rl__heldout=str(chat_root / "questions.jsonl"), rl__eval_samples=3, rl__eval_items=5)
    Trainer(rl_config(run, chat_root, train__log_interval=2, **heldout)).fit()
    records = read_metrics(run / METRICS_NAME)
    steps = [r for r in records if "rl/reward" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    for r in steps:
        assert 0 <= r["rl/reward"] <= 1 and 0 <= r["rl/cut_off"] <= 1 and 0 <= r["rl/equal_groups"] <= 1
        assert 1 <= r["rl/answer_tokens"] <= 8 and r["rl/sampled_tokens_per_sec"] > 0
        assert "tokens" not in r and "tokens_per_sec" not in r  # no windows of text were trained on
    evaluations = [r for r in records if "rl/pass@1" in r]
    assert [r["step"] for r in evaluations] == [0, 3, 6]
    assert all(0 <= r["rl/pass@1"] <= r["rl/pass@2"] <= r["rl/pass@3"] <= 1 for r in evaluations)
    out = capsys.readouterr().out
    assert "RL: 4 questions x 4 answers a step from" in out and "questions pass@1 " in out
    # plot.py loss draws the reward and pass@k beside the losses
    # the loss is the policy-gradient objective: a panel of its own, not drawn against the val loss (cross-entropy)
    drawn = Run.read(str(run))
    assert downstream_keys([drawn]) == ["rl/loss", "rl/reward", "rl/pass@1", "rl/pass@2", "rl/pass@3"]
    assert not any("loss" in r for r in drawn.records) and any("val_loss" in r for r in drawn.records)
    train_ax, val_ax = loss_figure([drawn], "steps").axes[:2]
    assert train_ax.get_title().startswith("[rl] policy-gradient loss") and len(train_ax.get_lines()[0].get_xdata())
    assert val_ax.get_ylabel().startswith("cross-entropy") and not val_ax.get_shared_y_axes().joined(val_ax, train_ax)
    assert run_entry_point("plot.py", ["loss", str(run), "--out", str(tmp_path / "rl.png")], monkeypatch) == 0
    assert (tmp_path / "rl.png").stat().st_size > 0


def test_a_gsm8k_file_is_asked_and_rewarded_as_gsm8k(tmp_path, chat_root, capsys):
    """rl.task=gsm8k=FILE: its items are asked as the gsm8k task asks them (through the chat template),
    rewarded by its strict match, and scored held out."""
    items = [
        {"question": f"Add {a} and {b}", "answer": f"So\n#### {n}"}
        for a, b, n in [("one", "one", 2), ("two", "two", 4)]
    ]
    task = f"gsm8k={write_jsonl(tmp_path / 'gsm8k.jsonl', items)}"
    run = tmp_path / "run"
    heldout = dict(rl__heldout=task, rl__eval_samples=2, rl__eval_items=2)
    Trainer(rl_config(run, chat_root, rl__task=task, rl__questions=2, train__max_iters=2, **heldout)).fit()
    assert "rewarded by gsm8k_strict" in capsys.readouterr().out
    records = read_metrics(run / METRICS_NAME)
    rewards = [r["rl/reward"] for r in records if "rl/reward" in r]
    assert rewards and set(rewards) == {0.0}  # the play has no 2 nor 4: the model cannot write either answer
    assert [r["rl/pass@2"] for r in records if "rl/pass@2" in r] == [0.0, 0.0]


def test_an_rl_run_with_lora_trains_only_its_adapters_and_keeps_the_starting_model_as_reference(tmp_path, chat_root):
    """lora.rank with rl.kl: the checkpoint holds adapters only, moved by the policy gradient, and the KL
    term's reference is the base the adapters sit on (their start, where the KL is 0)."""
    run = tmp_path / "lora"
    trainer = Trainer(rl_config(run, chat_root, lora__rank=2, rl__kl=0.1, train__max_iters=2, rl__temperature=1.0))
    reference = trainer.objective.reference
    assert all(".lora_" not in name for name, _ in reference.named_parameters())
    with torch.no_grad():
        prompt = torch.tensor([[5, 6, 7, 8]])
        torch.testing.assert_close(reference(prompt)[0], trainer.model(prompt)[0])  # the KL starts at 0
    trainer.fit()
    checkpoint = load_checkpoint(run / "ckpt.pt")
    assert checkpoint["model"] and all(".lora_" in name for name in checkpoint["model"])
    assert any(t.abs().sum() > 0 for name, t in checkpoint["model"].items() if "lora_B" in name)


# --- the checkers, against lm-evaluation-harness's own ---

TRICKY = [
    "#### 1,234",
    "The total is 1,234.",
    "#### -5",
    "so -5 apples, #### 5",
    "#### 3\n#### 4",
    "$1,234.00 in all",
    "#### 12.",
    "no number here",
    "#### 7 #### 8 then 9",
    "answer: 1234",
    "#### -0.5",
    "It costs $12. Later 13",
]
REFERENCES = ["... so 1234\n#### 1,234", "#### -5", "#### 3", "#### 12", "#### 9", "#### -0.5", "#### 13"]


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")
@pytest.mark.parametrize(
    "reward,filter_name", [("gsm8k_strict", "strict-match"), ("gsm8k_flexible", "flexible-extract")]
)
def test_the_gsm8k_checkers_equal_lm_eval_filters_and_exact_match(tmp_path, reward, filter_name):
    """Every tricky reply against every reference: rewarded exactly when the harness's gsm8k task (its
    regex filter, take_first and exact_match with its ignored regexes, read from its own gsm8k.yaml)
    scores it right."""
    import lm_eval
    import yaml
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    spec = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    (metric,) = spec["metric_list"]
    steps = next(f for f in spec["filter_list"] if f["name"] == filter_name)["filter"]
    regex = RegexFilter(steps[0]["regex_pattern"], steps[0].get("group_select", 0))
    items = [{"question": f"q{i}", "answer": reference} for i, reference in enumerate(REFERENCES)]
    task = load_task(f"gsm8k={write_jsonl(tmp_path / 'gsm8k.jsonl', items)}")
    found = checker(reward, 0.0, task)
    rewarded = []
    for item in task.items:
        for reply in TRICKY:
            (filtered,) = regex.apply([[reply]], [{}])[0]  # take_first: the one response
            theirs = exact_match_hf_evaluate(
                [filtered], [item.answer], regexes_to_ignore=metric["regexes_to_ignore"], ignore_case=True
            )["exact_match"]
            ours = found.score(reply, found.reference(item.answer))
            assert ours == theirs, (reply, item.answer)
            rewarded.append(ours)
    assert 5 <= sum(rewarded) < len(rewarded)  # the cases tell right from wrong


def test_exact_and_numeric_checkers(tmp_path):
    task = load_task(str(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2?", "answer": "#### 3.5"}])))
    exact, numeric = checker("exact", 0.0, task), checker("numeric", 0.01, task)
    assert exact.score("  forty\n two ", exact.reference(" forty two")) == 1.0
    assert exact.score("Forty two", exact.reference("forty two")) == 0.0  # case is kept
    reference = numeric.reference("#### 3.5")
    replies = ("about 3.505", "3.52", "-3.5", "#### 3.5.", "1,003.5 or 3.5", "none")
    assert [numeric.score(reply, reference) for reply in replies] == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_a_numeric_reward_refuses_an_answer_that_is_no_number(tmp_path):
    task = load_task(str(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2?", "answer": "4"}, question("cat")])))
    with pytest.raises(
        UserError, match=r"t.jsonl item 2: field 'answer'='c a t' is no number, and rl.reward='numeric'"
    ):
        checker("numeric", 0.0, task)


def test_an_rl_run_starts_from_a_hugging_face_folder_as_from_the_run_it_was_exported_from(tmp_path, chat_root):
    """train.init_from = the exported folder of the chat run: the run reads its chat template from the folder,
    samples the same answers as a run started from the run directory, and trains."""
    model, tokenizer = model_from_checkpoint(load_checkpoint(chat_root / "chat" / "ckpt.pt"), chat_root / "chat")
    export_model(model, tokenizer, tmp_path / "hf")
    from_folder = Trainer(rl_config(tmp_path / "from_folder", chat_root, train__init_from=str(tmp_path / "hf")))
    from_run = Trainer(rl_config(tmp_path / "from_run", chat_root))
    folder_answers, run_answers = from_folder.objective._sample(0, None), from_run.objective._sample(0, None)
    assert [a.tokens for a in folder_answers.answers] == [a.tokens for a in run_answers.answers]
    from_folder.fit()
    records = [r for r in read_metrics(tmp_path / "from_folder" / METRICS_NAME) if "rl/reward" in r]
    assert records and records[-1]["step"] == 6
