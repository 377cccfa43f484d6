"""Autoregressive generation: sample one token, append it, repeat.

With the KV cache the prompt is encoded in one forward pass (prefill) and every later step feeds
only the newest token. Without it each step re-encodes the whole context; both paths see the same
context and give the same tokens.

Context policy: the model has learned positions 0 .. block_size - 1 only. When a sequence grows past
block_size tokens, the context slides: the model re-encodes the last block_size // 2 tokens from
position 0 (a fresh prefill) and carries on, so each new token sees between block_size // 2 and
block_size tokens of context and the re-encoding happens once every block_size // 2 tokens.
"""

from collections.abc import Iterator

import torch

from .gpt import GPT


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick the next token from (B, V) logits; returns (B,) token ids.

    temperature 0 is greedy (argmax); top_k keeps the k most likely tokens; top_p keeps the
    smallest set of most likely tokens whose probabilities add up to at least top_p.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def slide_context(start: int, length: int, block_size: int) -> int:
    """First position of the context the model sees, given the previous one and the sequence length
    so far (see the context policy above)."""
    if length - start > block_size:
        return length - max(1, block_size // 2)
    return start


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token: int | None = None,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Yield (B,) new token ids, one step at a time, for a (B, T) prompt of T <= block_size tokens.

    stop_token: a row that samples it is finished (and repeats it); generation ends when every row
    has finished. vocab_size: sample only ids below it (a model may pad its vocabulary for speed).
    """
    block_size = model.config.block_size
    B, prompt_len = prompt.shape
    if not 1 <= prompt_len <= block_size:
        raise ValueError(f"prompt of {prompt_len} tokens: it must hold 1 to block_size={block_size} tokens")
    tokens = torch.empty(B, prompt_len + max_new_tokens, dtype=torch.long, device=prompt.device)
    tokens[:, :prompt_len] = prompt
    length = prompt_len
    cache = model.new_cache(B) if use_cache else None
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    start = 0
    new_input = tokens[:, :prompt_len]  # the first step encodes the whole prompt
    for _ in range(max_new_tokens):
        logits, _ = model(new_input, cache=cache)
        logits = logits[:, -1, :vocab_size]  # (B, V): the prediction after the last position
        next_token = sample_next_token(logits, temperature, top_k, top_p, generator)
        if stop_token is not None:
            next_token = next_token.masked_fill(finished, stop_token)
            finished |= next_token == stop_token
        tokens[:, length] = next_token
        length += 1
        yield next_token
        if stop_token is not None and bool(finished.all()):
            return
        new_start = slide_context(start, length, block_size)
        if cache is not None and new_start == start:
            new_input = tokens[:, length - 1 : length]  # the cache holds the rest of the context
        else:
            start = new_start
            new_input = tokens[:, start:length]  # the whole context, from position 0
            if cache is not None:
                cache.reset()
