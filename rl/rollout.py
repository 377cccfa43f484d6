"""Sampling answers for RL: each question's prompt rendered through the model's chat template (as
sample.py --chat and eval.py render a turn), answers drawn by the KV-cache sampler in batches, each with
a torch.Generator of its own seed, so that an answer equals what

    python sample.py --out-dir RUN --chat --prompt QUESTION --seed SEED --temperature T --top-k K

prints for the same weights. Beside its tokens, an answer keeps the log-probability of each under the
distribution it was drawn from (the temperature's, renormalised over the top-k tokens): the loss's
starting point (rl/policy_gradient.py)."""

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from data.tokenizer import StreamDecoder, Tokenizer
from errors import UserError
from evals.evaluate import Prompt, prompt_for
from evals.tasks import Task, load_task
from model import GPT
from model.generate import generate, left_pad
from rl.rewards import Checker, checker

TASK_KINDS = {"choice": "multiple-choice", "cloze": "cloze", "text": "text (loss)"}  # as a refusal names them


@dataclass(frozen=True)
class Sampling:
    """How answers are drawn: rl.temperature, rl.top_k (None: every token), rl.max_new_tokens."""

    temperature: float
    top_k: int | None
    max_new_tokens: int
    vocab_size: int  # the tokenizer's ids: a padded vocabulary's extra ids are never sampled


@dataclass
class Answer:
    """One sampled answer: its tokens (up to and with the end of its turn, when it ended), the
    log-probability of each under the sampling distribution, and the reply's text as checked."""

    tokens: list[int]
    log_probs: torch.Tensor  # (len(tokens),) float32, on the CPU
    ended: bool  # sampled an end-of-turn (or end-of-text) token; False: cut at max_new_tokens
    text: str


@dataclass
class Questions:
    """A generation task's items ready to be asked: each one's prompt ids and the reference its
    answers are checked against."""

    task: Task
    prompts: list[Prompt]
    references: list[object]
    checker: Checker

    def stops(self) -> tuple[str, ...]:
        """The task's stop strings: a reply's text is cut at the first, as eval.py cuts it."""
        return self.task.judge.stops

    def reward(self, index: int, text: str) -> float:
        return self.checker.score(text, self.references[index])

    def ask(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        picked: list[int],
        seeds: list[list[int]],
        sampling: "Sampling",
        batch_size: int,
        lockstep: bool,
        stop: Callable[[], bool] | None,
    ) -> tuple[list["Answer"], torch.Tensor, float] | None:
        """len(seeds[i]) answers to question picked[i], each drawn with its seed (sample_answers), question
        after question; their (len(picked), answers each) rewards; and the sampling's seconds. None if
        stop() said so after a batch."""
        n = len(seeds[0])
        prompts = [self.prompts[q] for q in picked for _ in range(n)]
        flat = [seed for row in seeds for seed in row]
        sampled = sample_answers(model, tokenizer, prompts, flat, sampling, batch_size, self.stops(), lockstep, stop)
        if sampled is None:
            return None
        answers, seconds = sampled
        rewards = [self.reward(q, answers[i * n + j].text) for i, q in enumerate(picked) for j in range(n)]
        return answers, torch.tensor(rewards).view(len(picked), n), seconds


def load_questions(
    spec: str, key: str, tokenizer: Tokenizer, block_size: int, sampling: Sampling, reward: str, tolerance: float
) -> Questions:
    """The generation task spec (an eval.py --tasks entry) that config key `key` names, every item
    rendered through the chat template and checked by the reward rl.reward names (rl/rewards.py);
    refused, naming what to change, when it is no generation task, when the model has no chat template,
    or when an item's prompt leaves its answer no room in the block."""
    if tokenizer.chat_template is None:
        raise UserError(
            f"{key}={spec!r}: the model has no chat template, and answers are sampled through it (a prompt "
            f"without it never learns where its answer ends): fine-tune on conversations first (docs/chat.md), "
            f"or start from a folder whose tokenizer has one"
        )
    task = load_task(spec, key=key)
    if task.kind != "generation":
        raise UserError(
            f"{key}={spec!r} is a {TASK_KINDS.get(task.kind, task.kind)} task; RL rewards sampled answers, so it needs "
            f"a generation task "
            f'({{"prompt": ..., "answer": ...}} or {{"messages": [...], "answer": ...}} items, or gsm8k)'
        )
    prompts = [prompt_for(tokenizer, item) for item in task.items]
    room = block_size - sampling.max_new_tokens
    for item, prompt in zip(task.items, prompts, strict=True):
        if len(prompt.ids) > room:
            raise UserError(
                f"{item.where}: its prompt is {len(prompt.ids)} tokens through the chat template, and with "
                f"rl.max_new_tokens={sampling.max_new_tokens} of answer it would not fit the model's "
                f"block_size={block_size} (shorten the item, or lower rl.max_new_tokens to at most "
                f"{block_size - len(prompt.ids)})"
            )
    found = checker(reward, tolerance, task)
    return Questions(task, prompts, [found.reference(item.answer) for item in task.items], found)


def reply_text(tokenizer: Tokenizer, tokens: list[int], end_tokens: tuple[int, ...], stops: tuple[str, ...]) -> str:
    """An answer's text as eval.py reads a reply: the tokens before its end token, decoded, cut at the
    first stop string."""
    decoder = StreamDecoder(tokenizer, stops)
    pieces = [decoder.feed(token) for token in tokens if token not in end_tokens]
    return "".join(pieces) + decoder.flush()


@torch.no_grad()
def sample_answers(
    model: GPT,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    seeds: list[int],
    sampling: Sampling,
    batch_size: int,
    stops: tuple[str, ...],
    lockstep: bool = False,
    stop: Callable[[], bool] | None = None,
) -> tuple[list[Answer], float] | None:
    """One answer to each prompt, drawn with a generator of its own seed, in batches of batch_size
    (rows of one prompt side by side); and the seconds the sampling took. lockstep: every batch
    samples max_new_tokens steps, however soon its answers end (under FSDP every process must run as
    many forward passes as the others). stop, asked after every batch: True abandons the sampling
    (None is returned). The model is put in eval mode for it, and back as it was found."""
    device = model.transformer.wte.weight.device
    answers: list[Answer | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))  # less padding
    was_training = model.training
    model.eval()
    started = time.perf_counter()
    try:
        for first in range(0, len(order), batch_size):
            rows = order[first : first + batch_size]
            batch = [prompts[i] for i in rows]
            generators = [torch.Generator(device=device).manual_seed(seeds[i]) for i in rows]
            for i, answer in zip(
                rows, _sample_batch(model, tokenizer, batch, generators, sampling, lockstep), strict=True
            ):
                answer.text = reply_text(tokenizer, answer.tokens, prompts[i].end_tokens, stops)
                answers[i] = answer
            if stop is not None and stop():
                return None
    finally:
        model.train(was_training)
    return answers, time.perf_counter() - started


def _sample_batch(
    model: GPT,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    generators: list[torch.Generator],
    sampling: Sampling,
    lockstep: bool,
) -> list[Answer]:
    """One answer to each prompt, sampled together (model/generate.py: each row as it would be alone)."""
    device = model.transformer.wte.weight.device
    batch, pad = left_pad([prompt.ids for prompt in prompts], device)
    log_probs: list[torch.Tensor] = []
    steps = generate(
        model,
        batch,
        sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        vocab_size=sampling.vocab_size,
        generators=generators,
        pad=pad,
        log_probs=log_probs,
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    for step_tokens in steps:
        for row, token in enumerate(step_tokens.tolist()):
            if not ended[row]:
                tokens[row].append(token)
                ended[row] = token in prompts[row].end_tokens
        if all(ended) and not lockstep:
            steps.close()
            break
    drawn = torch.stack(log_probs, dim=1).cpu()  # (B, steps)
    return [
        Answer(row_tokens, drawn[row, : len(row_tokens)].clone(), done, "")
        for row, (row_tokens, done) in enumerate(zip(tokens, ended, strict=True))
    ]
