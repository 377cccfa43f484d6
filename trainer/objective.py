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
"""

import torch

from model import GPTConfig

# the prefix generator's seed is the run's seed plus this, so that its draws are not those of the
# window sampler, which starts from the same seed
PREFIX_SEED_OFFSET = 1_000_003


class Objective:
    """Turns a batch (x, y) of windows into the model's inputs, targets and prefix lengths."""

    def __init__(self, config: GPTConfig, seed: int):
        self.config = config
        self.generator = torch.Generator().manual_seed(seed + PREFIX_SEED_OFFSET)

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
