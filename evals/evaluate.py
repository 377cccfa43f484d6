"""Scoring a model on evaluation tasks (evals/tasks.py): multiple choice, cloze, generation, perplexity.

A continuation's score is the sum of the log-probabilities of its tokens given the context, computed
as lm-evaluation-harness does it, so that the figures compare with published ones:

- context and continuation are encoded together and split where the context's own tokens end
  (trailing spaces of the context move to the continuation first);
- a pair longer than the model's block keeps its last block_size + 1 tokens, so a long context
  loses its beginning;
- multiple choice: `acc` picks the ending of highest summed log-likelihood, `acc_norm` the highest
  log-likelihood per character of the ending (ties go to the first); cloze: `acc` counts the
  continuations that greedy decoding would produce, `ppl` is exp(-mean summed log-likelihood);
- text: the file's tokens in windows of block_size, each token predicted once (after an
  <|endoftext|> where the tokenizer has one, so that the first is predicted too), the last window
  reading back to a full block as the harness's rolling windows do; `ppl` per token and `bpb`, bits
  per UTF-8 byte, which compares models with different tokenizers.

Generation: each item's prompt (see `prompt_for`) is continued greedily, in batches left padded
into one KV cache (model/generate.py), until the end-of-text token (or the chat template's end of
turn), the task's stop strings, a newline for a plain prompt of a local task, or its max_new_tokens;
a prompt longer than the block keeps its last block_size tokens, and a reply past the block slides
the context as sample.py does. `acc` is the share of replies equal to the answer as the task's Judge
compares them; chance is 0.

Every score is a finite number or the evaluation ends: a log-likelihood that is not (NaN weights,
a dtype's overflow) is a UserError naming the item or window. A perplexity past the largest float
(a mean log-likelihood below about -709.8 nats, an untrained model on a long word) is infinite;
it prints as `inf` and is null in --json and left out of metrics.jsonl, which hold JSON numbers only.

A stop request (trainer/stop.py) is asked after every batch: `stop`, a function answering whether
to stop, ends the evaluation with EvaluationStopped.

Speed: the endings of one question share their context, so the contexts of a batch of questions go
through the model once, left padded into one KV cache; its rows are then copied, one per ending
(KVCache.copy_rows), and the endings of the batch go through in two more forward passes, the
longer half and the shorter, each padded to its own longest.
"""

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from data.conversations import end_of_turn, render_prompt
from data.tokenizer import StreamDecoder, Tokenizer
from errors import UserError
from evals.tasks import Item, Question, Task, load_task
from model import GPT
from model.generate import generate, left_pad
from trainer.config import EvalConfig

LOGITS_BYTES = 2**29  # the float32 logits one batch may hold (512 MiB): a GPT-2 vocabulary is 200 KB a token
StopCheck = Callable[[], bool] | None  # asked after every batch: True abandons the evaluation


class EvaluationStopped(Exception):
    """A stop request ended the evaluation after a batch: it has no figures."""


def _after_batch(stop: StopCheck) -> None:
    if stop is not None and stop():
        raise EvaluationStopped


def perplexity(mean_nll: float) -> float:
    """exp(mean_nll), infinite past the largest float (mean_nll over about 709.8 nats)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def _check_finite(value: float, what: str) -> None:
    if not math.isfinite(value):
        raise UserError(
            f"{what} scores a log-likelihood of {value}, not a finite number: the model's weights hold NaN or "
            f"infinite values, or its dtype overflows (check the checkpoint; score in float32)"
        )


@dataclass
class Group:
    """Continuations scored after the same context tokens: each (item, continuation) pair of a
    question, unless truncation to the block gives them different contexts."""

    context: list[int]
    continuations: list[list[int]]
    keys: list[tuple[int, int]]  # (item, continuation) of each continuation


@dataclass
class Prompt:
    """What the model continues for a generation item, and how its reply may end."""

    ids: list[int]
    end_tokens: tuple[int, ...]  # a reply ends at the first of these (not part of it)
    chat: bool  # rendered through the model's chat template


@dataclass
class TaskResult:
    name: str
    kind: str
    metrics: dict[str, float]  # acc, acc_norm, ppl, bpb, n, as the kind has them
    predictions: list[int] = field(default_factory=list)  # per item: the ending picked by acc
    predictions_norm: list[int] = field(default_factory=list)  # per item: by acc_norm
    chance: float | None = None  # acc of guessing; None for text

    @property
    def centred(self) -> float | None:
        """acc rescaled so that guessing is 0 and a perfect score 1 (nanochat's CORE does this)."""
        if self.chance is None:
            return None
        return (self.metrics["acc"] - self.chance) / (1 - self.chance)


def split_tokens(tokenizer: Tokenizer, context: str, continuation: str, where: str) -> tuple[list[int], list[int]]:
    """The context's tokens and the continuation's, split as lm-evaluation-harness splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    try:
        whole = tokenizer.encode(context + continuation)
        context_ids = tokenizer.encode(context)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    return context_ids, whole[len(context_ids) :]


def encode_items(tokenizer: Tokenizer, items: list[Item], block_size: int) -> list[Group]:
    """The groups of continuations to score, each context cut to what fits the block."""
    pairs, keys = [], []
    for item_index, item in enumerate(items):
        for number, continuation in enumerate(item.continuations):
            pairs.append(split_tokens(tokenizer, item.context, continuation, item.where))
            keys.append((item_index, number))
            if len(pairs[-1][1]) > block_size:
                raise UserError(
                    f"{item.where}: continuation {number} is {len(pairs[-1][1])} tokens, more than the model's "
                    f"block_size={block_size} (shorten it)"
                )
    return group_pairs(pairs, keys, block_size)


def prompt_for(tokenizer: Tokenizer, item: Question) -> Prompt:
    """The one place where a generation item becomes tokens. With a chat template, the item's messages
    (a plain prompt as one user turn) are rendered with the generation prompt (data/conversations.py's
    render_prompt, as sample.py --chat renders a turn), and a reply ends at the end of its turn. Without
    one, a plain prompt is encoded as it is (no end-of-text token before it, as the scored tasks'
    contexts), and a reply ends at the end-of-text token."""
    end_tokens = () if tokenizer.eot_token is None else (tokenizer.eot_token,)
    if tokenizer.chat_template is not None:
        messages = item.messages or [{"role": "user", "content": item.prompt}]
        ids = render_prompt(messages, tokenizer, item.where)  # its errors name item.where
        return Prompt(ids, tuple(dict.fromkeys([*end_of_turn(tokenizer), *end_tokens])), chat=True)
    if item.messages is not None:
        raise UserError(
            f"{item.where}: field 'messages' is a conversation, and this model's tokenizer has no chat template to "
            f'render it with (give {{"prompt": ..., "answer": ...}} items, or evaluate a model fine-tuned on '
            f"conversations)"
        )
    try:
        return Prompt(tokenizer.encode(item.prompt), end_tokens, chat=False)
    except UserError as e:
        raise UserError(f"{item.where}: {e}") from None


def group_pairs(pairs: list[tuple[list[int], list[int]]], keys: list, block_size: int) -> list[Group]:
    """(context, continuation) token pairs in groups by their context once cut to the block: a pair
    keeps its last block_size + 1 tokens, the last of which is never read."""
    by_context: dict[tuple[int, ...], Group] = {}
    for (context, tokens), key in zip(pairs, keys, strict=True):
        context = context[max(0, len(context) + len(tokens) - block_size - 1) :]
        group = by_context.setdefault(tuple(context), Group(context, [], []))
        group.continuations.append(tokens)
        group.keys.append(key)
    return list(by_context.values())


def batches(groups: list[Group], block_size: int, batch_size: int, vocab_size: int) -> list[list[Group]]:
    """Groups in batches of at most batch_size continuations (a larger group goes alone), whose
    longest context and longest continuation fit in one cache of block_size, and whose logits fit
    in LOGITS_BYTES. Longest first, by continuation and then context: a batch holds several
    continuations per context, padded to its longest, so that padding weighs most."""
    result, batch = [], []
    for group in sorted(groups, key=lambda g: (max(map(len, g.continuations)), len(g.context)), reverse=True):
        candidate = batch + [group]
        context_len = max(len(g.context) for g in candidate)
        continuation_len = max(len(c) for g in candidate for c in g.continuations)
        rows = sum(len(g.continuations) for g in candidate)
        logits_bytes = 4 * vocab_size * (len(candidate) + rows * continuation_len)  # contexts: the last position
        fits = context_len + continuation_len - 1 <= block_size and logits_bytes <= LOGITS_BYTES
        if batch and (rows > batch_size or not fits):
            result.append(batch)
            candidate = [group]
        batch = candidate
    return result + [batch] if batch else result


@torch.no_grad()
def score_batch(model: GPT, groups: list[Group]) -> list[tuple[float, bool]]:
    """(summed log-likelihood, whether greedy decoding gives it) of every continuation of the
    groups, in order: the contexts in one forward pass, then the continuations in two more."""
    device = model.transformer.wte.weight.device
    G = len(groups)
    context_len = max(len(g.context) for g in groups)
    continuations = [c for g in groups for c in g.continuations]
    R = len(continuations)
    continuation_len = max(len(c) for c in continuations)
    contexts = torch.zeros(G, context_len, dtype=torch.long)
    for i, group in enumerate(groups):
        contexts[i, context_len - len(group.context) :] = torch.tensor(group.context)
    pad = torch.tensor([context_len - len(g.context) for g in groups], device=device)  # (G,) left padding
    rows = torch.tensor([i for i, g in enumerate(groups) for _ in g.continuations], device=device)  # (R,)
    max_len = context_len + continuation_len - 1
    cache = model.new_cache(G, max_len)
    last_logits, _ = model(contexts.to(device), cache=cache, pad=pad, logits_to_keep=1)  # (G, 1, V)
    targets = torch.zeros(R, continuation_len, dtype=torch.long)
    real = torch.zeros(R, continuation_len, dtype=torch.bool)
    for r, tokens in enumerate(continuations):
        targets[r, : len(tokens)] = torch.tensor(tokens)
        real[r, : len(tokens)] = True
    targets, real = targets.to(device), real.to(device)
    # each continuation's first token is read from its context's last position
    sums, greedy = _score_tokens(last_logits[rows], targets[:, :1])  # (R,), (R,)
    lengths = torch.tensor([len(tokens) for tokens in continuations], device=device)  # (R,)
    if R == G:  # one continuation per context (cloze): the contexts' cache serves as it is
        pieces = [torch.arange(R, device=device)]
    else:
        # two passes, the longer half of the continuations and then the shorter, each padded to its
        # own longest: endings of one question differ in length, and padding costs what tokens do
        order = torch.argsort(lengths, descending=True, stable=True)
        pieces = [order[: (R + 1) // 2], order[(R + 1) // 2 :]]
    for piece in pieces:
        piece_len = int(lengths[piece].max())
        if piece_len == 1:
            continue  # every token of these was read from the contexts' last positions
        piece_cache = cache
        if R > G:
            piece_cache = model.new_cache(len(piece), max_len)
            piece_cache.copy_rows(cache, rows[piece])
        inputs = targets[piece, : piece_len - 1]  # right padded with 0: the padding's logits are read by no one
        logits, _ = model(inputs, cache=piece_cache, pad=pad[rows[piece]])  # (piece, piece_len - 1, V)
        piece_sums, piece_greedy = _score_tokens(logits, targets[piece, 1:piece_len], real[piece, 1:piece_len])
        sums[piece] += piece_sums
        greedy[piece] &= piece_greedy
    return list(zip(sums.tolist(), greedy.tolist(), strict=True))


def _score_tokens(
    logits: torch.Tensor, targets: torch.Tensor, real: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of (R, T, V) logits: the summed log-probability of the (R, T) targets where real, and
    whether each real target is the argmax."""
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (R, T, V)
    token_log_probs = log_probs.gather(-1, targets[..., None]).squeeze(-1)  # (R, T)
    hits = log_probs.argmax(dim=-1) == targets  # (R, T)
    if real is not None:
        token_log_probs, hits = torch.where(real, token_log_probs, 0.0), hits | ~real
    return token_log_probs.sum(dim=1), hits.all(dim=1)


def score_groups(
    model: GPT,
    groups: list[Group],
    batch_size: int,
    bar: tqdm | None = None,
    name: Callable[[object], str] = lambda key: f"continuation {key}",
    stop: StopCheck = None,
    item: Callable[[object], object] = lambda key: key,
) -> dict:
    """key -> (summed log-likelihood, greedy) of every continuation of the groups; bar, if given,
    advances by one for each item all of whose continuations are scored (item(key): the item a
    continuation belongs to, by default itself; one item's continuations may lie in several groups,
    when truncation gives them different contexts). A score that is not finite is a UserError naming
    its key's continuation (name(key))."""
    config = model.config
    scores = {}
    unscored = Counter(item(key) for group in groups for key in group.keys)  # continuations left per item
    for batch in batches(groups, config.block_size, batch_size, config.vocab_size):
        keys = [key for group in batch for key in group.keys]
        batch_scores = score_batch(model, batch)
        for key, (score, _) in zip(keys, batch_scores, strict=True):
            _check_finite(score, name(key))
        scores |= dict(zip(keys, batch_scores, strict=True))
        unscored.subtract(item(key) for key in keys)
        if bar is not None:
            bar.update(sum(unscored[done] == 0 for done in {item(key) for key in keys}))
        _after_batch(stop)
    return scores


def score_items(
    model: GPT,
    tokenizer: Tokenizer,
    items: list[Item],
    batch_size: int,
    progress: str | None = None,
    stop: StopCheck = None,
) -> list[list[tuple[float, bool]]]:
    """Per item, (summed log-likelihood, greedy) of each continuation. progress: a tqdm bar's label,
    or None for none."""
    groups = encode_items(tokenizer, items, model.config.block_size)

    def name(key: tuple[int, int]) -> str:
        return f"{items[key[0]].where}: continuation {key[1]} ({items[key[0]].continuations[key[1]]!r:.40})"

    with tqdm(total=len(items), desc=progress, unit="item", disable=progress is None, leave=False) as bar:
        scores = score_groups(model, groups, batch_size, bar, name, stop, item=lambda key: key[0])
    return [[scores[i, n] for n in range(len(item.continuations))] for i, item in enumerate(items)]


def evaluate_choice(
    model: GPT, tokenizer: Tokenizer, task: Task, batch_size: int, progress: str | None = None, stop: StopCheck = None
) -> TaskResult:
    scores = score_items(model, tokenizer, task.items, batch_size, progress, stop)
    predictions, predictions_norm = [], []
    for item, item_scores in zip(task.items, scores, strict=True):
        log_likelihoods = np.array([score for score, _ in item_scores])
        lengths = np.array([float(len(choice)) for choice in item.choices])
        predictions.append(int(np.argmax(log_likelihoods)))
        predictions_norm.append(int(np.argmax(log_likelihoods / lengths)))
    labels = np.array([item.label for item in task.items])
    metrics = {
        "acc": float(np.mean(np.array(predictions) == labels)),
        "acc_norm": float(np.mean(np.array(predictions_norm) == labels)),
        "n": len(task.items),
    }
    chance = float(np.mean([1 / len(item.choices) for item in task.items]))
    return TaskResult(task.name, task.kind, metrics, predictions, predictions_norm, chance)


def evaluate_cloze(
    model: GPT, tokenizer: Tokenizer, task: Task, batch_size: int, progress: str | None = None, stop: StopCheck = None
) -> TaskResult:
    item_scores = score_items(model, tokenizer, task.items, batch_size, progress, stop)
    scores = [continuation_scores[0] for continuation_scores in item_scores]
    greedy = [int(is_greedy) for _, is_greedy in scores]
    metrics = {
        "acc": float(np.mean(greedy)),
        "ppl": perplexity(-float(np.mean([score for score, _ in scores]))),
        "n": len(task.items),
    }
    return TaskResult(task.name, task.kind, metrics, greedy, greedy, chance=0.0)


@torch.no_grad()
def generate_replies(
    model: GPT,
    tokenizer: Tokenizer,
    prompts: list[Prompt],
    stops: Callable[[Prompt], tuple[str, ...]],
    max_new_tokens: int,
    batch_size: int,
    bar: tqdm | None = None,
    stop: StopCheck = None,
    step: Callable | None = None,
) -> list[str]:
    """Each prompt's greedy reply, up to its first end token or stop string (stops(prompt)), or
    max_new_tokens. Batches of prompts of similar length, left padded: each row is generated exactly
    as it would be alone (model/generate.py). step: the one-token step (None: the model's forward)."""
    block_size = model.config.block_size
    device = model.transformer.wte.weight.device
    replies = [""] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))  # less padding
    for first in range(0, len(order), batch_size):
        rows = order[first : first + batch_size]
        batch, pad = left_pad([prompts[i].ids[-block_size:] for i in rows], device)
        decoders = [StreamDecoder(tokenizer, stops(prompts[i])) for i in rows]
        texts = [[] for _ in rows]
        ended = [False] * len(rows)
        steps = generate(
            model, batch, max_new_tokens, temperature=0, vocab_size=tokenizer.vocab_size, pad=pad, step=step
        )
        for tokens in steps:
            for row, (i, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                if ended[row]:
                    continue
                if token in prompts[i].end_tokens:
                    ended[row] = True
                    continue
                texts[row].append(decoders[row].feed(token))
                ended[row] = decoders[row].stopped
            if all(ended):
                break
        for row, i in enumerate(rows):
            replies[i] = "".join(texts[row]) + decoders[row].flush()
        if bar is not None:
            bar.update(len(rows))
        _after_batch(stop)
    return replies


def evaluate_generation(
    model: GPT,
    tokenizer: Tokenizer,
    task: Task,
    batch_size: int,
    progress: str | None = None,
    stop: StopCheck = None,
    step: Callable | None = None,
) -> TaskResult:
    """Each figure of the task's Judge: the share of replies that equal their reference, compared as
    the Judge says. step: the one-token step of the replies (None: the model's forward)."""
    judge = task.judge
    prompts = [prompt_for(tokenizer, item) for item in task.items]

    def stops(prompt: Prompt) -> tuple[str, ...]:
        return judge.stops + ("\n",) if judge.first_line and not prompt.chat else judge.stops

    with tqdm(total=len(prompts), desc=progress, unit="question", disable=progress is None, leave=False) as bar:
        replies = generate_replies(model, tokenizer, prompts, stops, judge.max_new_tokens, batch_size, bar, stop, step)
    references = [judge.reference(item.answer) for item in task.items]
    right = {
        figure: [int(compared(reply) == reference) for reply, reference in zip(replies, references, strict=True)]
        for figure, compared in judge.figures.items()
    }
    metrics = {figure: float(np.mean(hits)) for figure, hits in right.items()} | {"n": len(task.items)}
    return TaskResult(task.name, task.kind, metrics, right["acc"], right["acc"], chance=0.0)


@torch.no_grad()
def evaluate_text(
    model: GPT,
    tokenizer: Tokenizer,
    task: Task,
    batch_size: int,
    progress: str | None = None,
    limit: int | None = None,
    stop: StopCheck = None,
) -> TaskResult:
    """Perplexity per token and bits per byte of the text, over its first `limit` windows or all."""
    block_size = model.config.block_size
    device = model.transformer.wte.weight.device
    try:
        ids = tokenizer.encode_array(task.text).astype(np.int64)
    except UserError as e:
        raise UserError(f"{task.source}: {e}") from None
    if tokenizer.eot_token is not None:
        ids = np.concatenate([[tokenizer.eot_token], ids])
    if len(ids) < 2:
        raise UserError(f"{task.source} is a single token (perplexity needs at least two)")
    starts = list(range(0, len(ids) - 1, block_size))[:limit]
    nll, tokens = 0.0, 0
    with tqdm(total=len(starts), desc=progress, unit="window", disable=progress is None, leave=False) as bar:
        for first in range(0, len(starts), batch_size):
            rows = starts[first : first + batch_size]
            x = torch.zeros(len(rows), block_size, dtype=torch.long)
            y = torch.full((len(rows), block_size), -1, dtype=torch.long)  # -1: past the end, not scored
            for r, start in enumerate(rows):
                end = min(start + block_size, len(ids) - 1)  # the window predicts ids[start + 1 : end + 1]
                first = max(0, end - block_size)  # a short last window reads back to a full block, as the harness
                window = torch.from_numpy(ids[first : end + 1])
                x[r, : len(window) - 1], y[r, : len(window) - 1] = window[:-1], window[1:]
                y[r, : start - first] = -1  # predicted by the window before
            logits, _ = model(x.to(device))
            batch_nll = F.cross_entropy(
                logits.float().flatten(0, 1), y.to(device).flatten(), ignore_index=-1, reduction="sum"
            ).item()
            _check_finite(-batch_nll, f"{task.source}: the text from token {rows[0]} to {end}")
            nll += batch_nll
            tokens += int((y >= 0).sum())
            bar.update(len(rows))
            _after_batch(stop)
    n_bytes = _byte_count(tokenizer, ids[1 : 1 + tokens])  # the windows are consecutive from the start
    metrics = {"ppl": perplexity(nll / tokens), "bpb": nll / (math.log(2) * n_bytes), "n": tokens}
    return TaskResult(task.name, task.kind, metrics)


def _byte_count(tokenizer: Tokenizer, ids: np.ndarray) -> int:
    """UTF-8 bytes the tokens stand for."""
    tokens, counts = np.unique(ids, return_counts=True)
    return int(sum(len(tokenizer.token_bytes(int(t))) * int(c) for t, c in zip(tokens, counts, strict=True)))


EVALUATORS = {"choice": evaluate_choice, "cloze": evaluate_cloze}  # text and generation: evaluate_task


def evaluate_task(
    model: GPT,
    tokenizer: Tokenizer,
    task: Task,
    batch_size: int,
    progress: bool = False,
    limit: int | None = None,
    stop: StopCheck = None,
    step: Callable | None = None,
) -> TaskResult:
    """Score one task with the model in eval mode (put back as it was found); stop, if given, is asked
    after every batch (True: EvaluationStopped). step: the one-token step of generation tasks'
    replies (inference/decode_step.py's; None: the model's forward)."""
    label = task.name if progress else None
    was_training = model.training
    model.eval()
    try:
        if task.kind == "text":
            return evaluate_text(model, tokenizer, task, batch_size, label, limit, stop)
        if task.kind == "generation":
            return evaluate_generation(model, tokenizer, task, batch_size, label, stop, step)
        return EVALUATORS[task.kind](model, tokenizer, task, batch_size, label, stop)
    finally:
        model.train(was_training)


def load_tasks(
    specs: list[str], limit: int | None, tokenizer: Tokenizer, block_size: int, max_new_tokens: int | None = None
) -> list[Task]:
    """The tasks named (see evals/tasks.py), each item read, checked and encoded once before any is
    scored: a bad one ends the run before the model's time is spent on the rest. max_new_tokens, if
    given, replaces each generation task's own."""
    tasks = [load_task(spec, limit, max_new_tokens) for spec in specs]
    names = [task.name for task in tasks]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UserError(f"--tasks names {repeated[0]!r} twice (give each task once; a file's name is its stem)")
    check_encodable(tokenizer, tasks, block_size)
    return tasks


def check_encodable(tokenizer: Tokenizer, tasks: list[Task], block_size: int) -> None:
    """Encode every item (and text) of the tasks: one the tokenizer cannot encode, or too long for the
    block, is a UserError naming it."""
    for task in tasks:
        if task.kind == "text":
            try:
                tokenizer.encode_array(task.text)
            except UserError as e:
                raise UserError(f"{task.source}: {e}") from None
        elif task.kind == "generation":
            for item in task.items:
                prompt_for(tokenizer, item)
        else:
            encode_items(tokenizer, task.items, block_size)


def centred_mean(results: list[TaskResult]) -> float | None:
    """The mean of the centred accuracies of the tasks that have one (not text); None if none has."""
    centred = [result.centred for result in results if result.chance is not None]
    return float(np.mean(centred)) if centred else None


def summary_lines(results: list[TaskResult]) -> list[str]:
    """One line per task, then the centred mean."""
    width = max(len(result.name) for result in results)
    lines = []
    for result in results:
        figures = [f"{key} {value:.4f}" for key, value in result.metrics.items() if key != "n"]
        if result.centred is not None:
            figures.append(f"centred {result.centred:.4f}")
        lines.append(f"{result.name:<{width}}  " + "  ".join(figures) + f"  n {result.metrics['n']}")
    mean = centred_mean(results)
    if mean is not None:
        lines.append(f"{'centred mean':<{width}}  {mean:.4f}")
    return lines


def metrics_record(results: list[TaskResult]) -> dict[str, float]:
    """The figures as metrics.jsonl and wandb keys: eval/<task>/<figure>, eval/centred_mean; an
    infinite perplexity is left out (a record holds JSON numbers only)."""
    figures = {f"eval/{result.name}/{key}": value for result in results for key, value in result.metrics.items()}
    record = {key: value for key, value in figures.items() if math.isfinite(value)}
    mean = centred_mean(results)
    return record if mean is None else record | {"eval/centred_mean": mean}


def results_json(results: list[TaskResult]) -> dict:
    """The figures as --json writes them: an infinite perplexity as null (JSON has no infinity)."""
    tasks = {
        result.name: {key: value if math.isfinite(value) else None for key, value in result.metrics.items()}
        for result in results
    }
    return {"tasks": tasks, "centred_mean": centred_mean(results)}


class TrainingTasks:
    """The [eval] tasks a training run scores at its evaluations (trainer/loop.py): read, checked and
    encoded once, when the run is built, so that a bad item stops it before it starts."""

    def __init__(self, cfg: EvalConfig, tokenizer: Tokenizer, block_size: int):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.tasks = load_tasks(cfg.task_list, cfg.items or None, tokenizer, block_size)

    def score(self, model: GPT, stop: StopCheck) -> tuple[dict[str, float], list[str]] | None:
        """Each task's figures as metrics.jsonl keys (metrics_record) and the lines that show them
        (summary_lines); None if stop() said so after a batch."""
        try:
            results = [
                evaluate_task(model, self.tokenizer, task, self.cfg.batch_size, limit=self.cfg.items or None, stop=stop)
                for task in self.tasks
            ]
        except EvaluationStopped:
            return None
        return metrics_record(results), summary_lines(results)
