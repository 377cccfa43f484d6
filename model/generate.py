"""Autoregressive generation: sample one token, append it, repeat.

With the KV cache the prompt is encoded in one forward pass (prefill) and every later step feeds
only the newest token. Without it each step re-encodes the whole context; both paths see the same
context and give the same tokens.

Context policy: the model has learned positions 0 .. block_size - 1 only. When a sequence grows past
block_size tokens, the context slides: the model re-encodes the last block_size // 2 tokens from
position 0 (a fresh prefill) and carries on, so each new token sees between block_size // 2 and
block_size tokens of context and the re-encoding happens once every block_size // 2 tokens.

Batches: prompts of different lengths are left padded to one width. Each row keeps its own context
start (its padding, then wherever its context slid to); a forward pass covers the window from the
earliest start, and the later-starting rows treat the tokens before their start as padding, which
the mask hides and the positions skip. So each row sees exactly the context it would see alone.

Attention patterns: a prefix-LM model reads each row's prompt as its prefix, encoded in both
directions in one pass, and decodes causally after it (when the context slides, the re-encoded
context is the new prefix). A block-causal model predicts each block from the complete blocks before
it (see trainer/objective.py): the logits of a block, encoded once it is complete, give the next
block's K tokens, so the cache only ever holds complete blocks. Rows complete their blocks at
different steps, so a block-causal batch generates row by row, each as it would alone; its prompts
need at least one complete block. Other patterns need nothing here: the model's mask and cache
apply them.
"""

from collections.abc import Callable, Iterator

import torch

from .gpt import GPT

FLOAT32_TINY = torch.finfo(torch.float32).tiny


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
        if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
            # numpy's argmax (numpy: a dependency of this project) is the faster on a CPU: GPT-2's 50,257 logits
            # in 4 against PyTorch's 51 us, a token; the same answer, the first largest (a NaN the largest)
            return torch.as_tensor(logits.numpy(force=True).argmax(axis=-1))
        return logits.argmax(dim=-1)
    probs = truncated_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def truncated_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The (B, V) float32 logits of the distribution sample_next_token draws from at a temperature
    above 0: their softmax is that distribution, their log_softmax its log-probabilities (-inf for
    the tokens top_k and top_p leave out)."""
    # Shifted so the largest logit is 0, the scaled logits never overflow to +inf (whose softmax is
    # NaN); a temperature below float32's smallest normal number (1e-45 rounds to 0) divides as that
    # number does: every token but the most likely ones gets probability 0.
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / max(temperature, FLOAT32_TINY)
    if top_k is not None and top_k < logits.size(-1):
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)
    return logits


def slide_context(start: int, length: int, block_size: int) -> int:
    """First position of the context the model sees, given the previous one and the sequence length
    so far (see the context policy above)."""
    if length - start > block_size:
        return length - max(1, block_size // 2)
    return start


def left_pad(prompts: list[list[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, list[int]]:
    """Prompts of different lengths as one (B, T) batch, each row right-aligned, and the padding
    each row starts with (filled with token 0, which no query attends to)."""
    width = max(len(ids) for ids in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, ids in enumerate(prompts):
        batch[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
    return batch.to(device), [width - len(ids) for ids in prompts]


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
    generators: list[torch.Generator] | None = None,
    use_cache: bool = True,
    pad: list[int] | None = None,
    compile: bool = False,
    log_probs: list[torch.Tensor] | None = None,
    step: Callable | None = None,
) -> Iterator[torch.Tensor]:
    """Yield (B,) new token ids, on the CPU, one step at a time, for a (B, T) prompt.

    pad: row b's prompt is prompt[b, pad[b]:] (left padding, see `left_pad`); each row holds 1 to
    block_size real tokens and is generated exactly as it would be alone: its own positions from 0,
    its own context window, padding hidden from every query. stop_token: a row that samples it is
    finished (and repeats it); generation ends when every row has finished. vocab_size: sample only
    ids below it (a model may pad its vocabulary for speed). generators: one per row, so a row's
    samples do not depend on the other rows; None draws from torch's global generator.
    compile: run the one-token step through torch.compile (CUDA graphs on a GPU); the prompt and
    every re-encoding after the context slides run eagerly.
    step: the one-token step to call instead of the model (a CPU's inference/decode_step.py, which
    computes what the model computes in fewer operations), called as the model is: step(idx (B, 1),
    cache=, pad=, prefix=) -> (logits, _). The prompt and every re-encoding stay on the model; without
    the cache, or for a block-causal model, there are no one-token steps and it is not called.

    The KV cache is preallocated and written in place (static, read whole and masked, when
    compiling), and the loop's only wait for the device is copying each step's (B,) tokens to the
    host. Sampling still makes small per-step tensors (per row when each row has its own generator).
    A compiled step is specialised to the batch size (its cache always holds block_size positions):
    a call with another batch size compiles again.

    log_probs: a list to which each step appends, before it yields its tokens, their (B,)
    log-probabilities under the distribution they were drawn from (truncated_logits; on the model's
    device): what a policy-gradient loss needs of the sampler. Not for a block-causal model.
    """
    block_size = model.config.block_size
    B, width = prompt.shape
    starts = list(pad) if pad is not None else [0] * B  # per row: the first token of its context
    for row, start in enumerate(starts):
        if not 1 <= width - start <= block_size:
            raise ValueError(
                f"prompt row {row} has {width - start} tokens: it must hold 1 to block_size={block_size} tokens"
            )
    if compile and step is not None:
        raise ValueError("compile and step both replace the one-token step: give one of them")
    if generators is not None and len(generators) != B:
        raise ValueError(f"{len(generators)} generators for {B} prompt rows: pass one per row")
    if model.config.attn_block:
        if log_probs is not None:
            raise ValueError("log_probs: a block-causal model's samples record none")
        sampling = (temperature, top_k, top_p, vocab_size, generators)
        yield from _generate_by_blocks(model, prompt, starts, max_new_tokens, sampling, stop_token, use_cache)
        return
    tokens = torch.empty(B, width + max_new_tokens, dtype=torch.long, device=prompt.device)
    tokens[:, :width] = prompt
    length = width
    window = width - min(starts)  # the longest context
    # a compiled step is specialised to the cache's shape: one at block_size serves every call of this batch size
    max_len = block_size if compile else min(block_size, window + max_new_tokens)
    cache = model.new_cache(B, max_len, static=compile) if use_cache else None
    # the one-token step: CUDA graphs replay it without launching each kernel from Python
    mode = "reduce-overhead" if prompt.device.type == "cuda" else None
    if step is None:
        step = torch.compile(model, mode=mode, dynamic=False) if compile and use_cache else model
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    # prefix-LM: each row's prompt is its prefix (None: the model has no prefix)
    prefixes = [width - start for start in starts]
    prefix = _prefix_tensor(model, prefixes, prompt.device)
    logits, window_pad = _encode(model, tokens, starts, length, cache, prefix)
    for i in range(max_new_tokens):
        next_token = _sample_rows(logits[:, -1, :vocab_size], temperature, top_k, top_p, generators)  # (B,)
        if log_probs is not None:
            sampled = truncated_logits(logits[:, -1, :vocab_size], temperature, top_k, top_p).log_softmax(dim=-1)
            log_probs.append(sampled.gather(-1, next_token[:, None]).squeeze(-1))  # (B,)
        if stop_token is not None:
            next_token = next_token.masked_fill(finished, stop_token)
            finished |= next_token == stop_token
        tokens[:, length] = next_token
        length += 1
        next_on_host = next_token.cpu()  # the step's one wait for the device
        yield next_on_host
        if i == max_new_tokens - 1 or (stop_token is not None and bool((next_on_host == stop_token).all())):
            return
        new_starts = [slide_context(start, length, block_size) for start in starts]
        if cache is not None and new_starts == starts:
            logits, _ = step(next_token.view(B, 1), cache=cache, pad=window_pad, prefix=prefix)
        else:
            # a row whose context slid starts afresh: its whole re-encoded context is its prefix
            prefixes = [
                length - new if new != start else old
                for old, new, start in zip(prefixes, new_starts, starts, strict=True)
            ]
            prefix = _prefix_tensor(model, prefixes, prompt.device)
            starts = new_starts
            logits, window_pad = _encode(model, tokens, starts, length, cache, prefix)


def _prefix_tensor(model: GPT, prefixes: list[int], device: torch.device) -> torch.Tensor | None:
    return torch.tensor(prefixes, device=device) if model.config.attn_prefix_lm else None


def _encode(
    model: GPT, tokens: torch.Tensor, starts: list[int], length: int, cache, prefix: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Encode every row's context from position 0 in one forward pass: the window from the earliest
    row start to `length`, with each row's earlier tokens as padding. Returns the last position's
    logits (B, 1, V): the output layer, the largest product, is computed for it alone; and that padding
    (None when there is none), which the following one-token steps pass on."""
    first = min(starts)
    pad = None
    if any(start > first for start in starts):
        pad = torch.tensor([start - first for start in starts], device=tokens.device)  # (B,)
    if cache is not None:
        cache.reset()
    logits, _ = model(tokens[:, first:length], cache=cache, pad=pad, prefix=prefix, logits_to_keep=1)
    return logits, pad


def _sample_rows(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generators: list[torch.Generator] | None,
) -> torch.Tensor:
    """(B,) tokens from (B, V) logits, each row with its own generator when given."""
    if generators is None or temperature == 0:
        return sample_next_token(logits, temperature, top_k, top_p)
    rows = [
        sample_next_token(logits[row : row + 1], temperature, top_k, top_p, generator)
        for row, generator in enumerate(generators)
    ]
    return torch.cat(rows)


def _generate_by_blocks(
    model: GPT,
    prompt: torch.Tensor,
    starts: list[int],
    max_new_tokens: int,
    sampling: tuple,
    stop_token: int | None,
    use_cache: bool,
) -> Iterator[torch.Tensor]:
    """`generate` for a block-causal model: each row on its own, the rows in step. sampling:
    temperature, top_k, top_p, vocab_size and generators, as for `generate`."""
    temperature, top_k, top_p, vocab_size, generators = sampling
    K = model.config.attn_block
    for row, start in enumerate(starts):
        if prompt.size(1) - start < K:
            raise ValueError(
                f"prompt row {row} has {prompt.size(1) - start} tokens: a block-causal model (attn_block={K}) "
                f"predicts each block from the complete block before it, so a prompt needs at least {K} tokens"
            )

    def sampler(row: int):
        row_generators = None if generators is None else [generators[row]]
        return lambda logits: _sample_rows(logits[:, :vocab_size], temperature, top_k, top_p, row_generators)

    rows = [
        _block_row(model, prompt[row : row + 1, start:], max_new_tokens, sampler(row), use_cache)
        for row, start in enumerate(starts)
    ]
    finished = [False] * len(rows)
    for _ in range(max_new_tokens):
        next_tokens = [stop_token if done else next(row).item() for row, done in zip(rows, finished, strict=True)]
        finished = [done or token == stop_token for done, token in zip(finished, next_tokens, strict=True)]
        yield torch.tensor(next_tokens)
        if stop_token is not None and all(finished):
            return


def _block_row(
    model: GPT, prompt: torch.Tensor, max_new_tokens: int, sample, use_cache: bool
) -> Iterator[torch.Tensor]:
    """Yield (1,) new tokens for a (1, L) prompt of a block-causal model. The token at context
    position n is predicted by position n - K, in the last complete block; each block is encoded
    once it is complete (with the cache, on top of the blocks before it)."""
    K, block_size = model.config.attn_block, model.config.block_size
    tokens = torch.empty(1, prompt.size(1) + max_new_tokens, dtype=torch.long, device=prompt.device)
    tokens[:, : prompt.size(1)] = prompt
    length = prompt.size(1)
    cache = model.new_cache(1, min(block_size, length + max_new_tokens)) if use_cache else None
    start = encoded = 0  # the context's first token; how many of its tokens the cache holds (whole blocks)
    for _ in range(max_new_tokens):
        if length - start > block_size:  # slide, keeping at least one complete block
            start = length - max(block_size // 2, K)
            encoded = 0
            if cache is not None:
                cache.reset()
        complete = (length - start) // K * K  # context tokens in complete blocks
        if complete > encoded:
            if cache is not None:
                logits, _ = model(tokens[:, start + encoded : start + complete], cache=cache)
            else:
                logits, _ = model(tokens[:, start : start + complete])
            predictions = logits[0, -K:]  # (K, V): the tokens at context positions complete .. complete + K - 1
            encoded = complete
        next_token = sample(predictions[length - start - complete][None])  # (1,)
        tokens[:, length] = next_token
        length += 1
        yield next_token
