"""What each position of a training row learns, given the model's attention pattern.

Batches come as windows x = tokens[i : i + T] and y = tokens[i + 1 : i + T + 1]. Under causal
attention, and with a sliding window, sinks or documents, position t learns y[t], the next token,
which its mask hides from it. Two patterns let a position see later tokens, so their objective
changes, so that no position is ever trained on a target it can see:

- prefix-LM: each row gets a prefix length P, drawn uniformly from 1..T. Positions before P - 1
  see their next token (it is in the prefix), so their targets get no loss (-1); position P - 1
  and later ones learn the next token, which none of them sees.
- block-causal, blocks of K: a position sees up to the end of its block, so it learns the token K
  positions ahead (x[t + K], the same place in the next block), which lies past the end of its
  block. The last K - 1 positions would need tokens past the window: no loss there. Sampling
  follows from it: every token of a block is predicted by the block before, once that is complete.

The prefix lengths come from a generator of their own, seeded and saved with the checkpoint (in its
RNG states), so a resumed run draws the same prefixes as an uninterrupted one.

The trainer asks its objective for a step's micro-batches (`draw`) and for each one's loss (`loss`):
this one's are windows of the dataset and the model's own loss; an [rl] run's objective,
rl/policy_gradient.py's PolicyGradient, answers the same questions with sampled answers and a policy
gradient, and a run without [rl] never reads it.
"""

import torch

from data.loader import RandomWindows
from model import GPTConfig

# the prefix generator's seed is the run's seed plus this, so that its draws are not those of the
# window sampler, which starts from the same seed
PREFIX_SEED_OFFSET = 1_000_003


class Objective:
    """Turns a batch (x, y) of windows into the model's inputs, targets and prefix lengths."""

    windows = True  # its steps train on windows of the dataset, of the shape the trainer's schedules give

    def __init__(self, config: GPTConfig, seed: int):
        self.config = config
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed + PREFIX_SEED_OFFSET)

    def draw(
        self, step: int, count: int, windows: RandomWindows, shape: tuple[int, int], stop=None
    ) -> tuple[list[tuple], list[torch.Tensor]]:
        """`count` micro-batches of windows of the given shape (sequences, tokens), made into inputs,
        targets and prefixes, and each one's number of trained targets. step and stop are not read:
        drawing windows takes no time a stop request should cut short."""
        batches = [self(*windows.next_batch(*shape)) for _ in range(count)]
        return batches, [(y != -1).sum() for _, y, _ in batches]

    def loss(self, forward, batch: tuple) -> torch.Tensor:
        """The micro-batch's loss: the mean cross-entropy over its trained targets."""
        x, y, prefix = batch
        return forward(x, y, prefix=prefix)[1]

    def report(self) -> tuple[dict[str, float], str | None]:
        """What a step adds to its metrics.jsonl record beyond the loss, and a note to show: nothing."""
        return {}, None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x, y: (B, T). Returns x, the targets (B, T) (-1: no loss) and the prefix lengths (B,)
        for attn_prefix_lm, else None."""
        B, T = x.shape
        if self.config.attn_prefix_lm:
            prefix = torch.randint(1, T + 1, (B,), generator=self.generator).to(x.device)  # (B,)
            in_prefix = torch.arange(T, device=x.device) < prefix[:, None] - 1  # (B, T): target inside the prefix
            return x, y.masked_fill(in_prefix, -1), prefix
        if self.config.attn_block:
            K = self.config.attn_block
            targets = torch.full_like(y, -1)
            targets[:, : T - K + 1] = y[:, K - 1 :]  # x[t + K] is y[t + K - 1]
            return x, targets, None
        return x, y, None

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
