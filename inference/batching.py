"""Continuous batching: sequences decoded together, each joining the batch when it comes and leaving
it when it ends, each computed as `generate` computes it alone (model/generate.py).

A sequence starts alone: its context is encoded in one forward pass of its own (the prefill, as
`generate` encodes a prompt) and its first token is drawn from the logits. Its keys and values then
join the batch's KV cache, one row per sequence, and from there every step feeds the newest token of
every row in one forward pass. The rows end at the same slot of the cache, each with its own padding
before its first key (as left-padded prompts in `generate`): the model hides the padding and counts
each row's positions from its own first token, so a row sees exactly its own context. A row that
ends gives its place to the last row; a row whose context has grown past block_size slides as
`generate` slides it (its last block_size // 2 tokens encoded afresh, alone) and joins again.

The cache holds block_size slots a row. A row that joins is written to end at the batch's slot
(every row moves later to make room when its context is longer than the others'); when the slots run
out, every row moves earlier by the padding they all have, which a row that has not slid always has.

Each row draws its tokens from its own generator with its own temperature, top-k and top-p, through
`sample_next_token`, as `generate` draws a row's. The batch's products sum in another order than a
lone row's, so a row's logits may differ from its lone run in the last bits of float32 (as they do
between a batch of `generate` and its rows alone); its greedy tokens are the lone run's
(tests/test_batching.py). A lone row with no padding computes exactly what `generate` computes.

With a one-token step (a CPU's inference/decode_step.py, which computes what the model computes in
fewer operations) the batch's steps call it instead of the model; the prefills stay on the model.

A block-causal model draws each block from the complete block before it, and its rows complete
their blocks at different steps: its sequences are each decoded by `generate` alone, in turn.
"""

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from model import GPT, KVCache, generate, sample_next_token
from model.generate import slide_context
from model.kv_cache import RollingKVCache


@dataclass
class Sequence:
    """One sequence to generate. `accept` is called with each new token and returns True when the
    sequence ends there (an end-of-text token, a stop string, its length); `cancelled` may be set from
    another thread, and the sequence leaves at the next step."""

    prompt: list[int]
    accept: Callable[[int], bool]
    max_tokens: int  # the most tokens `accept` lets it draw (a block-causal model's generate needs it)
    temperature: float = 1.0  # 0 is greedy
    top_k: int | None = None
    top_p: float = 1.0
    generator: torch.Generator | None = None
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list, repr=False)  # the prompt and what was drawn
    start: int = 0  # where its context starts in tokens (it slides past block_size)
    prefix: int = 0  # prefix-LM: the length of the context last encoded, read both ways
    steps: Iterator[torch.Tensor] | None = field(default=None, repr=False)  # a block-causal model's generate


class BatchDecoder:
    """Decodes the sequences given to `add`, up to max_rows of them at a time (the others wait, first
    come first served), one token each per `step`. one_token_step: what computes the batch's one-token
    steps, called as the model is (a DecodeStep); None: the model."""

    def __init__(self, model: GPT, vocab_size: int, max_rows: int, one_token_step: Callable | None = None):
        self.model = model
        self.one_token_step = model if one_token_step is None else one_token_step
        self.vocab_size = vocab_size  # tokens drawn are below it (a model may pad its vocabulary)
        self.max_rows = max_rows
        self.block_size = model.config.block_size
        self.device = model.transformer.wte.weight.device
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # row i of the cache holds rows[i]
        self.pads: list[int] = []  # row i's padding: its first key is at slot pads[i]
        self.cache: KVCache | None = None  # allocated for the rows in use, grown as more join
        self.prefill_cache: KVCache | None = None

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def add(self, sequence: Sequence) -> None:
        sequence.tokens = list(sequence.prompt)
        self.waiting.append(sequence)

    @torch.no_grad()
    def step(self) -> None:
        """Let waiting sequences join while there is room, then draw one token for every row."""
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        self._remove([i for i, row in enumerate(self.rows) if row.cancelled])
        while self.waiting and len(self.rows) < self.max_rows:
            self._encode(self.waiting.popleft())
        if self.model.config.attn_block:
            self._step_alone()
        elif self.rows:
            self._step_together()

    def _encode(self, sequence: Sequence) -> None:
        """Encode the sequence's context alone, draw its next token from it, and let it join the batch
        unless it ended there (sliding again if its context is still too long)."""
        if self.model.config.attn_block:
            return self._start_alone(sequence)
        if self.prefill_cache is None:
            self.prefill_cache = self.model.new_cache(1)
        while True:
            context = sequence.tokens[sequence.start :]
            sequence.prefix = len(context)
            self.prefill_cache.reset()
            ids, prefix = self._ids([context]), self._prefix([sequence])
            logits, _ = self.model(ids, cache=self.prefill_cache, prefix=prefix, logits_to_keep=1)  # as generate
            if self._accept(sequence, self._sample(sequence, logits[:, -1])):
                return
            start = slide_context(sequence.start, len(sequence.tokens), self.block_size)
            if start == sequence.start:
                break
            sequence.start = start
        self._join(sequence)

    def _join(self, sequence: Sequence) -> None:
        """Make the prefill cache's row the batch's last, ending at the batch's slot."""
        length = self.prefill_cache.pos
        self._fit(len(self.rows) + 1, max(length, self.cache.pos if self.cache is not None else 0))
        if self.cache.pos < length:  # every row moves later, to make room for this one's keys
            self.pads = [pad + length - self.cache.pos for pad in self.pads]
            self.cache.shift(length - self.cache.pos)
        self.cache.place(len(self.rows), self.prefill_cache, offset=self.cache.pos - length)
        self.rows.append(sequence)
        self.pads.append(self.cache.pos - length)

    def _fit(self, rows: int, slots: int) -> None:
        """A cache with room for `rows` rows of `slots` slots: the one there is, or a larger one (twice the
        rows, at most max_rows; twice the slots, at most block_size) holding the rows there are. So the
        memory follows the rows and contexts in use, and a long run of steps copies the cache a few times.
        A rolling cache (a sliding window) always has block_size slots: its memory is the window's."""
        cache = self.cache
        have_rows, have_slots = (0, 0) if cache is None else (cache.k[0].size(0), cache.max_len)
        if rows <= have_rows and slots <= have_slots:
            return
        if rows > have_rows:
            have_rows = min(self.max_rows, max(rows, 2 * have_rows))
        if slots > have_slots:
            have_slots = min(self.block_size, max(slots, 2 * have_slots))
        if isinstance(self.prefill_cache, RollingKVCache):
            have_slots = self.block_size
        self.cache = self.model.new_cache(have_rows, have_slots)
        if cache is not None:
            for row in range(len(self.rows)):
                self.cache.place(row, cache.rows(row, row + 1), offset=0)
            self.cache.pos = cache.pos

    def _step_together(self) -> None:
        """One forward pass over the newest token of every row, and each row's next token."""
        if self.cache.pos == self.cache.max_len < self.block_size:
            self._fit(len(self.rows), self.cache.pos + 1)
        elif self.cache.pos == self.cache.max_len:  # the slots ran out: every row moves earlier
            least = min(self.pads)
            self.pads = [pad - least for pad in self.pads]
            self.cache.shift(-least)
        batch = self.cache.rows(0, len(self.rows))
        pad = None if not any(self.pads) else torch.tensor(self.pads, device=self.device)
        ids = self._ids([[row.tokens[-1]] for row in self.rows])
        logits, _ = self.one_token_step(ids, cache=batch, pad=pad, prefix=self._prefix(self.rows))
        self.cache.pos = batch.pos
        logits = logits[:, -1, : self.vocab_size]  # (B, V)
        greedy = logits.argmax(dim=-1).tolist()  # the greedy rows' tokens, in one pass for all
        ended, sliding = [], []
        for i, row in enumerate(self.rows):
            token = greedy[i] if row.temperature == 0 else self._sample(row, logits[i : i + 1])
            if self._accept(row, token):
                ended.append(i)
                continue
            start = slide_context(row.start, len(row.tokens), self.block_size)
            if start != row.start:  # its context is encoded afresh, alone, and it joins again
                row.start = start
                ended.append(i)
                sliding.append(row)
        self._remove(ended)
        for row in sliding:
            self._encode(row)

    def _sample(self, sequence: Sequence, logits: torch.Tensor) -> int:
        """The sequence's next token drawn from its (1, V) logits, as `generate` draws a row's."""
        sampling = (sequence.temperature, sequence.top_k, sequence.top_p)
        return int(sample_next_token(logits[:, : self.vocab_size], *sampling, sequence.generator))

    def _accept(self, sequence: Sequence, token: int) -> bool:
        """Add the token to the sequence; True when the sequence ends there."""
        sequence.tokens.append(token)
        return sequence.accept(token)

    def _remove(self, ended: list[int]) -> None:
        """Take these rows out of the batch; the last rows move into their places."""
        if not ended:
            return
        for i in ended:
            if self.rows[i].steps is not None:
                self.rows[i].steps.close()
        kept = [i for i in range(len(self.rows)) if i not in ended]
        holes = [i for i in range(len(kept)) if i in ended]
        movers = [i for i in kept if i >= len(kept)]
        for hole, mover in zip(holes, movers, strict=True):
            if self.cache is not None:
                self.cache.place(hole, self.cache.rows(mover, mover + 1), offset=0)
                self.pads[hole] = self.pads[mover]
            self.rows[hole] = self.rows[mover]
        del self.rows[len(kept) :], self.pads[len(kept) :]
        if not self.rows and self.cache is not None:
            self.cache.pos = 0

    def _start_alone(self, sequence: Sequence) -> None:
        """A block-causal model's sequence: decoded by `generate`, as sample.py decodes it."""
        sequence.steps = generate(
            self.model,
            self._ids([sequence.prompt]),
            sequence.max_tokens,
            temperature=sequence.temperature,
            top_k=sequence.top_k,
            top_p=sequence.top_p,
            vocab_size=self.vocab_size,
            generators=None if sequence.generator is None else [sequence.generator],
        )
        self.rows.append(sequence)

    def _step_alone(self) -> None:
        ended = []
        for i, row in enumerate(self.rows):
            token = int(next(row.steps)[0])
            row.tokens.append(token)
            if row.accept(token):
                ended.append(i)
        self._remove(ended)

    def _ids(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _prefix(self, rows: list[Sequence]) -> torch.Tensor | None:
        """prefix-LM: each row's context as last encoded is its prefix (None: the model has no prefix)."""
        if not self.model.config.attn_prefix_lm:
            return None
        return torch.tensor([row.prefix for row in rows], device=self.device)
