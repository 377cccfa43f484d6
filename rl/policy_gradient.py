"""The policy-gradient objective of an [rl] run (docs/rl.md states it in full): trainer/loop.py asks it
for a step's micro-batches and their loss, as it asks trainer/objective.py's Objective for windows of
text and theirs.

A step samples rl.samples answers to each of rl.questions questions (rl/rollout.py), each process
answering its own share of them, rewards each answer with rl.reward's checker (rl/rewards.py), and
gives each the advantage

    A = reward - mean of its group's rewards        (/ (the group's standard deviation + 1e-4): rl.std_advantage)

Every token of every answer (its end-of-turn token too, where it has one; none of the prompt, none of
the padding) adds

    -min(ratio * A, clip(ratio, 1 - rl.clip, 1 + rl.clip) * A) + rl.kl * (exp(ref - new) - (ref - new) - 1)

where ratio = exp(new - old), new being the token's log-probability under the model being trained and
old its log-probability when it was sampled, both under the sampling distribution (the logits divided
by rl.temperature, renormalised over the rl.top_k most likely tokens); in the KL term (Schulman's k3
estimator, as TRL's GRPO uses it) new and ref, the starting model's, are taken at that temperature
untruncated, so that a token one of them would no longer sample is a finite penalty.

The step's loss is the sum of these terms over the answer tokens of all its micro-batches, in all
processes, divided by their number (per-token normalisation over the whole step, as nanochat and TRL's
default do it; not a mean per answer, which would weigh a short answer's tokens more than a long
one's): each micro-batch's mean is weighted by its share of them, as the trainer weights a chat step's
micro-batches. With rl.updates above 1 the same answers serve that many optimizer steps, the first at
ratio 1.
"""

import dataclasses
from dataclasses import dataclass, fields

import torch

from data.loader import TokenDataset
from data.tokenizer import Tokenizer
from errors import UserError
from finetune.init_from import FineTune, crop_positions
from model import GPT
from model.generate import truncated_logits
from rl.rollout import Answer, Questions, Sampling, load_questions
from trainer.config import Config, LoraConfig
from trainer.distributed import World
from trainer.runtime import autocast

# the seeds of a run's questions and answers are the run's seed plus these, apart from its windows' draws
QUESTION_SEED_OFFSET = 2_000_003
SAMPLE_SEED_OFFSET = 3_000_017
SEEDS = 2**62  # an answer's generator seed is drawn below this
STD_EPSILON = 1e-4  # added to a group's standard deviation before dividing by it (TRL's value)
MOSTLY_EQUAL = 0.5  # a step whose groups are more often all-equal than this gets a note, once


@dataclass
class MicroBatch:
    """Sampled answers after their prompts, as the loss reads them. Rows are left padded to one width,
    so every answer ends in the last column; an answer of A tokens is predicted by the last A positions."""

    inputs: torch.Tensor  # (B, W): each row's prompt and answer but its last token
    pad: torch.Tensor | None  # (B,) left padding of each row; None when there is none
    targets: torch.Tensor  # (B, L): each answer right-aligned, -1 before it (L: the longest answer)
    sampled_log_probs: torch.Tensor  # (B, L): each answer token's log-probability when it was sampled
    advantages: torch.Tensor  # (B,)
    reference_log_probs: torch.Tensor | None = None  # (B, L) under the starting model, with rl.kl

    def to(self, device: torch.device) -> "MicroBatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return MicroBatch(**{name: None if value is None else value.to(device) for name, value in moved.items()})

    def state(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Sampled:
    """A step's answers in this process, question by question (rl.samples rows each)."""

    prompts: list[list[int]]  # per row: its prompt ids
    answers: list[Answer]
    rewards: torch.Tensor  # (questions, samples)
    seconds: float  # the sampling's wall time


def group_advantages(rewards: torch.Tensor, std_advantage: bool) -> torch.Tensor:
    """(questions, samples) rewards -> their advantages: each less its group's mean, and divided by the
    group's (unbiased) standard deviation + STD_EPSILON with std_advantage."""
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if std_advantage:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + STD_EPSILON)
    return advantages


def answer_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int | None
) -> torch.Tensor:
    """(B, L, V) logits and (B, L) targets (-1: none) -> each target's log-probability under the
    distribution the sampler draws from at this temperature and top_k (0 where there is no target)."""
    B, L, V = logits.shape
    flat = truncated_logits(logits.reshape(B * L, V), temperature, top_k).log_softmax(dim=-1)  # (B * L, V)
    picked = flat.gather(-1, targets.clamp(min=0).reshape(B * L, 1)).reshape(B, L)
    return picked.masked_fill(targets == -1, 0.0)


def token_losses(new: torch.Tensor, batch: MicroBatch, clip: float, kl: float, untruncated: torch.Tensor | None):
    """(B, L) log-probabilities of the answers under the model being trained, under the sampling
    distribution (new) and, with kl, at its temperature untruncated -> each answer token's term of the loss
    (the module's docstring), 0 where there is no token."""
    ratio = torch.exp(new - batch.sampled_log_probs)
    advantages = batch.advantages[:, None]  # (B, 1)
    losses = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    if kl:
        to_reference = batch.reference_log_probs - untruncated
        losses = losses + kl * (torch.exp(to_reference) - to_reference - 1)
    return losses.masked_fill(batch.targets == -1, 0.0)


def micro_batches(
    sampled: Sampled, advantages: torch.Tensor, count: int, drop_equal_groups: bool = False
) -> list[MicroBatch]:
    """The rows (prompt, answer, advantage) dealt into `count` micro-batches of consecutive rows, as
    even as they can be. With drop_equal_groups the rows of a group whose rewards are all equal are left
    out; where fewer than `count` rows are left, dropped ones fill the empty micro-batches with no answer
    token to train on (every process runs the same number of forward passes)."""
    rows = list(range(len(sampled.answers)))
    trained = set(rows)
    if drop_equal_groups:
        samples = sampled.rewards.size(1)
        equal = (sampled.rewards == sampled.rewards[:, :1]).all(dim=1).tolist()
        trained = {row for row in rows if not equal[row // samples]}
        fillers = [row for row in rows if row not in trained][: max(count - len(trained), 0)]
        rows = sorted(trained | set(fillers))
    flat_advantages = advantages.flatten()
    batches = []
    for chunk in (rows[i * len(rows) // count : (i + 1) * len(rows) // count] for i in range(count)):
        answers = [sampled.answers[row] for row in chunk]
        sequences = [sampled.prompts[row] + answer.tokens[:-1] for row, answer in zip(chunk, answers, strict=True)]
        width = max(map(len, sequences))
        longest = max(len(answer.tokens) for answer in answers)
        inputs = torch.zeros(len(chunk), width, dtype=torch.long)
        targets = torch.full((len(chunk), longest), -1, dtype=torch.long)
        sampled_log_probs = torch.zeros(len(chunk), longest)
        pad = []
        for i, (sequence, answer) in enumerate(zip(sequences, answers, strict=True)):
            inputs[i, width - len(sequence) :] = torch.tensor(sequence)
            targets[i, longest - len(answer.tokens) :] = torch.tensor(answer.tokens)
            sampled_log_probs[i, longest - len(answer.tokens) :] = answer.log_probs
            if chunk[i] not in trained:  # a filler: its tokens are read but none is trained on
                targets[i] = -1
            pad.append(width - len(sequence))
        batches.append(
            MicroBatch(
                inputs,
                torch.tensor(pad) if any(pad) else None,
                targets,
                sampled_log_probs,
                flat_advantages[chunk].float(),
            )
        )
    return batches


def reference_model(cfg: Config, dataset: TokenDataset, checkpoint: dict | None, device: torch.device) -> GPT:
    """The starting model, frozen, for rl.kl: the weights of the run's train.init_from, read as a
    fine-tuning run reads them (finetune/init_from.py; a LoRA run's: its base, which its adapters
    start equal to). A resumed run reads them again from where its first start read them (its
    checkpoint's objective state names it)."""
    source = cfg.train.init_from if checkpoint is None else checkpoint["rng"][0]["train_objective"]["reference"]
    start = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=source), lora=LoraConfig())
    model = GPT(cfg.model)
    model.load_state_dict(crop_positions(FineTune(start, dataset, None).weights, cfg.model.block_size))
    return model.to(device).eval().requires_grad_(False)


def check_shares(cfg: Config, world_size: int) -> None:
    """Refuse rl.questions that do not divide among the processes torchrun started (each answers an equal
    share), and more micro-batches a process than it samples answers."""
    rl = cfg.rl
    if rl.questions % world_size:
        raise UserError(
            f"rl.questions={rl.questions} does not divide among the {world_size} processes torchrun started: "
            f"each answers an equal share of a step's questions (use a multiple of {world_size})"
        )
    micro_batches_each = cfg.train.gradient_accumulation_steps // world_size
    rows = rl.questions // world_size * rl.samples
    if rows < micro_batches_each:
        raise UserError(
            f"train.gradient_accumulation_steps={cfg.train.gradient_accumulation_steps} gives each process "
            f"{micro_batches_each} micro-batches, but it samples {rows} answers a step (rl.questions / "
            f"processes x rl.samples): lower it, or sample more"
        )


class PolicyGradient:
    """An [rl] run's objective: draws a step's micro-batches by sampling and rewarding answers, and
    gives each micro-batch's loss (its mean over its answer tokens). Holds the generator that draws
    every answer's seed, the same in every process; its state, and the answers still to be trained on
    with rl.updates above 1, are what a checkpoint keeps of it."""

    windows = False  # its steps train on sampled answers, not on windows of the dataset

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        model: GPT,
        world: World,
        device: torch.device,
        dtype: torch.dtype,
        lockstep: bool,
        reference: GPT | None,
        seed: int,
    ):
        rl = cfg.rl
        self.rl, self.seed = rl, cfg.train.seed
        self.tokenizer, self.model, self.world, self.device, self.dtype = tokenizer, model, world, device, dtype
        self.lockstep, self.reference = lockstep, reference
        # where the starting model came from, which a resumed run reads again for rl.kl (reference_model)
        self.reference_source = cfg.train.init_from
        self.sampling = Sampling(rl.temperature, rl.top_k or None, rl.max_new_tokens, tokenizer.vocab_size)
        self.questions = load_questions(
            rl.task, "rl.task", tokenizer, cfg.model.block_size, self.sampling, rl.reward, rl.tolerance
        )
        self.order_cache: dict[int, torch.Tensor] = {}
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Draw the answers' seeds from seed on, with no answers pending."""
        self.generator = torch.Generator().manual_seed(seed + SAMPLE_SEED_OFFSET)
        self.pending: list[MicroBatch] = []  # answers still to be trained on (rl.updates above 1)
        self.uses_left = 0
        self.figures: dict[str, float] = {}
        self.noted = False

    def describe(self) -> str:
        rl = self.rl
        return (
            f"RL: {rl.questions} questions x {rl.samples} answers a step from {self.questions.task.source} "
            f"({len(self.questions.prompts):,} questions), rewarded by {self.questions.checker.name}; "
            f"temperature {rl.temperature}, top_k {rl.top_k or 'all'}, at most {rl.max_new_tokens} tokens an answer"
            + (f", {rl.updates} updates a batch" if rl.updates > 1 else "")
        )

    def draw(self, step: int, count: int, windows=None, shape=None, stop=None):
        """This process's `count` micro-batches of the step and each one's number of answer tokens; None
        if stop() said so between two batches of sampling. windows and shape (the dataset's) are not read."""
        if self.uses_left == 0:
            sampled = self._sample(step, stop)
            if sampled is None:
                return None
            self.pending = self._micro_batches(sampled, count)
            self.uses_left = self.rl.updates
        self.uses_left -= 1
        return self.pending, [(batch.targets != -1).sum() for batch in self.pending]

    def loss(self, forward, batch: MicroBatch) -> torch.Tensor:
        """The micro-batch's loss: its tokens' terms (token_losses) summed, over its number of answer tokens."""
        batch = batch.to(self.device)
        logits, _ = forward(batch.inputs, pad=batch.pad, logits_to_keep=batch.targets.size(1))
        logits = logits[..., : self.sampling.vocab_size]
        temperature = self.sampling.temperature
        new = answer_log_probs(logits, batch.targets, temperature, self.sampling.top_k)
        untruncated = answer_log_probs(logits, batch.targets, temperature, None) if self.rl.kl else None
        losses = token_losses(new, batch, self.rl.clip, self.rl.kl, untruncated)
        return losses.sum() / (batch.targets != -1).sum().clamp(min=1)

    def report(self) -> tuple[dict[str, float], str | None]:
        """The figures of the answers the last step trained on, for its metrics.jsonl record, and a note
        the first time most of a step's groups had equal rewards."""
        note = None
        if not self.noted and self.figures.get("rl/equal_groups", 0.0) > MOSTLY_EQUAL:
            self.noted = True
            remedy = (
                "they are left out of the update (rl.drop_equal_groups): ask more rl.questions a step to train on more"
                if self.rl.drop_equal_groups
                else "set rl.drop_equal_groups = true and ask more rl.questions a step"
            )
            note = (
                f"{self.figures['rl/equal_groups']:.0%} of this step's questions got the same reward for all their "
                f"{self.rl.samples} answers, which gives them no gradient (too easy or too hard for the model: "
                f"sample more answers, raise rl.temperature, or choose questions nearer its level; or {remedy})"
            )
        return dict(self.figures), note

    def state_dict(self) -> dict:
        return {
            "generator": self.generator.get_state(),
            "pending": [batch.state() for batch in self.pending],
            "uses_left": self.uses_left,
            "figures": dict(self.figures),
            "reference": self.reference_source,
        }

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.pending = [MicroBatch(**batch) for batch in state["pending"]]
        self.uses_left = state["uses_left"]
        self.figures = dict(state["figures"])
        self.reference_source = state["reference"]

    def _question_order(self, epoch: int) -> torch.Tensor:
        """The questions of one pass over the task, shuffled by the run's seed: the same in every process."""
        if epoch not in self.order_cache:
            generator = torch.Generator().manual_seed(self.seed + QUESTION_SEED_OFFSET + epoch)
            self.order_cache = {epoch: torch.randperm(len(self.questions.prompts), generator=generator)}
        return self.order_cache[epoch]

    def _sample(self, step: int, stop) -> Sampled | None:
        """This process's questions of the step (its share of the run's stream of questions, pass after
        pass over the task), rl.samples answers to each, and their rewards."""
        rl, world = self.rl, self.world
        seeds = torch.randint(0, SEEDS, (rl.questions, rl.samples), generator=self.generator)  # every process alike
        share = rl.questions // world.size
        first = (step // rl.updates) * rl.questions + world.rank * share  # in the stream of questions
        total = len(self.questions.prompts)
        picked = [int(self._question_order(slot // total)[slot % total]) for slot in range(first, first + share)]
        mine = seeds[world.rank * share : (world.rank + 1) * share]  # (share, samples)
        with autocast(self.device, self.dtype):
            asked = self.questions.ask(
                self.model,
                self.tokenizer,
                picked,
                mine.tolist(),
                self.sampling,
                rl.sample_batch_size,
                self.lockstep,
                stop,
            )
        if asked is None:
            return None
        answers, rewards, seconds = asked
        prompts = [self.questions.prompts[q] for q in picked for _ in range(rl.samples)]
        return Sampled([prompt.ids for prompt in prompts], answers, rewards, seconds)

    def _micro_batches(self, sampled: Sampled, count: int) -> list[MicroBatch]:
        """The sampled answers as `count` micro-batches (with the starting model's log-probabilities, with
        rl.kl), and the step's figures over all processes."""
        advantages = group_advantages(sampled.rewards, self.rl.std_advantage)
        batches = micro_batches(sampled, advantages, count, self.rl.drop_equal_groups)
        if self.reference is not None:
            for batch in batches:
                batch.reference_log_probs = self._reference_log_probs(batch)
        self.figures = self._figures(sampled)
        return batches

    @torch.no_grad()
    def _reference_log_probs(self, batch: MicroBatch) -> torch.Tensor:
        on_device = batch.to(self.device)
        with autocast(self.device, self.dtype):
            logits, _ = self.reference(on_device.inputs, pad=on_device.pad, logits_to_keep=batch.targets.size(1))
        vocab_size = self.sampling.vocab_size
        return answer_log_probs(logits[..., :vocab_size], on_device.targets, self.sampling.temperature, None).cpu()

    def _figures(self, sampled: Sampled) -> dict[str, float]:
        """The step's answers in figures, over every process: one all-reduce of their sums."""
        lengths = [len(answer.tokens) for answer in sampled.answers]
        rewards = sampled.rewards
        sums = torch.tensor(
            [
                float(rewards.sum()),
                float(rewards.numel()),
                float(sum(lengths)),
                float(sum(not answer.ended for answer in sampled.answers)),
                float((rewards == rewards[:, :1]).all(dim=1).sum()),
                float(rewards.size(0)),
            ],
            dtype=torch.float64,
        )
        reward, answers, tokens, cut, equal, groups = self.world.sum(sums.to(self.device)).tolist()
        (seconds,) = self.world.max([sampled.seconds], self.device)
        return {
            "rl/reward": reward / answers,
            "rl/answer_tokens": tokens / answers,
            "rl/cut_off": cut / answers,
            "rl/equal_groups": equal / groups,
            "rl/sampled_tokens_per_sec": tokens / max(seconds, 1e-9),
        }


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from n answers of which c are right (k <= n): the chance that k
    answers drawn from the n without replacement hold a right one, 1 - C(n - c, k) / C(n, k), computed
    as a product so that no binomial coefficient is ever formed."""
    if n - c < k:  # every draw of k holds a right answer
        return 1.0
    missed = 1.0
    for i in range(n - c + 1, n + 1):
        missed *= 1.0 - k / i
    return 1.0 - missed


def pass_ks(n: int) -> list[int]:
    """The k that a held-out scoring of n answers a question reports: 1, 2, 4, ... below n, and n."""
    return [2**i for i in range(n.bit_length()) if 2**i < n] + [n]


def pass_at(rewards: torch.Tensor) -> dict[int, float]:
    """(items, n) rewards of 0 and 1 -> {k: pass@k} for each k of pass_ks(n): the mean over the items of
    the unbiased estimate from their n answers (pass@1 is the mean share of right answers)."""
    n = rewards.size(1)
    rights = (rewards > 0).sum(dim=1).tolist()
    return {k: sum(pass_at_k(n, c, k) for c in rights) / len(rights) for k in pass_ks(n)}


def held_out_seed(seed: int, item: int, sample: int, n: int) -> int:
    """The seed of sample `sample` of held-out item `item`: the same at every evaluation, so that
    successive figures compare like for like."""
    return (seed + SAMPLE_SEED_OFFSET + 1 + item * n + sample) % SEEDS


class HeldOut:
    """The held-out questions of rl.heldout, scored at the run's [eval] scorings: n = rl.eval_samples answers
    each, sampled as the training answers are, with seeds fixed for the whole run; pass@k (pass_at) for
    k = 1, 2, 4, ... up to n.
    Under torchrun each process answers its own share of the questions (an answer's seed is its question's
    and its own, so a share's answers are those one process would draw), and the rewards are summed over
    the processes: every process logs the same figures, those of one process scoring them all."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, lockstep: bool, world: World):
        rl = cfg.rl
        self.rl, self.seed, self.tokenizer, self.lockstep, self.world = rl, cfg.train.seed, tokenizer, lockstep, world
        self.sampling = Sampling(rl.temperature, rl.top_k or None, rl.max_new_tokens, tokenizer.vocab_size)
        self.questions: Questions = load_questions(
            rl.heldout, "rl.heldout", tokenizer, cfg.model.block_size, self.sampling, rl.reward, rl.tolerance
        )
        self.items = (
            len(self.questions.prompts) if not rl.eval_items else min(rl.eval_items, len(self.questions.prompts))
        )

    def score(self, model: GPT, stop) -> tuple[dict[str, float], list[str]] | None:
        """pass@k for k = 1, 2, 4, ... up to rl.eval_samples as metrics.jsonl keys (rl/pass@1, rl/pass@2, ...)
        and the line that shows them; None if stop() said so after a batch."""
        n, world = self.rl.eval_samples, self.world
        # every process asks as many questions, in as many batches (a stop is agreed on, and a sharded model
        # runs, batch by batch in step): a share short of the others' repeats its first question, unscored
        share = -(-self.items // world.size)
        mine = list(range(world.rank * share, min((world.rank + 1) * share, self.items)))
        asked_items = mine + [mine[0] if mine else 0] * (share - len(mine))
        seeds = [[held_out_seed(self.seed, item, sample, n) for sample in range(n)] for item in asked_items]
        asked = self.questions.ask(
            model, self.tokenizer, asked_items, seeds, self.sampling, self.rl.sample_batch_size,
            self.lockstep, stop,
        )  # fmt: skip
        if asked is None:
            return None
        _, rewards, _ = asked
        device = next(model.parameters()).device
        every = torch.zeros(self.items, n, dtype=torch.float64, device=device)
        every[mine] = rewards[: len(mine)].to(device, torch.float64)
        passes = pass_at(world.sum(every).cpu())  # each row filled by the one process that asked it
        figures = {f"rl/pass@{k}": value for k, value in passes.items()}
        shown = "  ".join(f"pass@{k} {value:.4f}" for k, value in passes.items())
        return figures, [f"{self.questions.task.name} {shown}  n {self.items}"]
