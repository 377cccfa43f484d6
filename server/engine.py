"""The server's decoding thread: every request's choices go to one BatchDecoder (inference/batching.py),
which decodes them together, and each choice's text comes back to its request as it is written.

A choice is one sequence: its prompt ids, how it is sampled, and what ends it, as sample.py ends a
sample: one of its stop tokens (the end of text; with a chat template, the end of the turn), a stop
string (the text before it is the reply, matched across tokens by data/tokenizer.py's StreamDecoder,
which also holds back the bytes of a character not yet complete), or max_tokens. A chat reply leaves
out the special tokens of the template's markup, as sample.py --chat does.

The decoding runs in a thread of its own, so that the event loop answering HTTP never waits for the
model; torch releases the interpreter while it computes. Each request reads its choices' text from
an asyncio queue that the thread fills. A request that goes away cancels its choices, which leave the
batch at the next step. `drain` stops taking requests and ends those in progress after a grace period,
as if their max_tokens were reached, so that a server asked to stop stops within seconds.
"""

import asyncio
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from data.tokenizer import StreamDecoder, Tokenizer
from inference.batching import BatchDecoder, Sequence
from model import GPT


@dataclass(frozen=True)
class Choice:
    """What one choice of a request asks for."""

    prompt: list[int]
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float
    seed: int
    stop_tokens: frozenset[int]  # the reply ends at any of them, which is not shown
    stops: tuple[str, ...]  # the reply ends just before the first of these strings
    markup: frozenset[int] = frozenset()  # special tokens a reply leaves out of its text


class Event(NamedTuple):
    """New text of choice `index`; with finish_reason ("stop" or "length"), its last, and then tokens is
    how many it drew in all (the token that ended it included)."""

    index: int
    text: str
    finish_reason: str | None = None
    tokens: int = 0


class EngineFailure(Exception):
    """The decoding thread failed while this request's choices were in the batch (its log says why)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class Job:
    """A request's choices in the engine; `events` yields their text as it comes."""

    def __init__(self, choices: int, loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sequences: list[Sequence] = []

    def send(self, item: Event | EngineFailure | None) -> None:
        """From the decoding thread: hand an event to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: the request is gone, and so is its reader
            self.cancel_sequences()

    def cancel_sequences(self) -> None:
        for sequence in self.sequences:
            sequence.cancelled = True

    def cancel(self) -> None:
        """From the request's event loop: its choices leave the batch, and `events` ends."""
        self.cancel_sequences()
        self.queue.put_nowait(None)

    async def events(self) -> AsyncIterator[Event]:
        """Each choice's text until every choice has finished (or the job is cancelled); raises
        EngineFailure if decoding failed."""
        unfinished = self.choices
        while unfinished:
            item = await self.queue.get()
            if item is None:
                return
            if isinstance(item, EngineFailure):
                raise item
            if item.finish_reason is not None:
                unfinished -= 1
            yield item


class Reply:
    """One choice's text as its tokens come: accept(token) returns True when the choice ends there."""

    def __init__(self, choice: Choice, index: int, tokenizer: Tokenizer, job: Job):
        self.choice, self.index, self.job = choice, index, job
        self.decoder = StreamDecoder(tokenizer, choice.stops)
        self.tokens = 0
        self.finished = False
        self.sequence: Sequence | None = None  # the decoder's sequence of this choice

    def accept(self, token: int) -> bool:
        self.tokens += 1
        if token in self.choice.stop_tokens:
            return self.finish("", "stop")
        text = "" if token in self.choice.markup else self.decoder.feed(token)
        if self.decoder.stopped:
            return self.finish(text, "stop")
        if self.tokens == self.choice.max_tokens:
            return self.finish(text, "length")
        if text:
            self.job.send(Event(self.index, text))
        return False

    def finish(self, text: str, reason: str) -> bool:
        """Send the last of the text, with what the decoder still held back, and the finish reason."""
        self.finished = True
        self.job.send(Event(self.index, text + self.decoder.flush(), reason, self.tokens))
        return True


class Engine:
    """Owns the model and decodes every request's choices together, in a thread of its own."""

    def __init__(self, model: GPT, tokenizer: Tokenizer, max_rows: int, one_token_step: Callable | None = None):
        self.model, self.tokenizer, self.max_rows = model, tokenizer, max_rows
        self.one_token_step = one_token_step  # a CPU's DecodeStep (inference/decode_step.py); None: the model
        self.device = model.transformer.wte.weight.device
        self.inbox: queue.Queue[tuple[Job, list[Choice]]] = queue.Queue()
        self.decoder = BatchDecoder(model, tokenizer.vocab_size, max_rows, one_token_step)
        self.replies: list[Reply] = []  # the choices in the batch or waiting for it
        self.deadline: float | None = None  # while draining: when the replies in progress end
        self.stopping = threading.Event()
        # how many choices are being decoded, and how many wait for a row: as of the last step's end
        self.load = {"running": 0, "waiting": 0}
        self.thread = threading.Thread(target=self._run, name="decoding", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, choices: list[Choice]) -> Job:
        """Queue a request's choices; their text comes through the returned Job's events."""
        if self.deadline is not None:
            raise ShuttingDown
        job = Job(len(choices), asyncio.get_running_loop())
        self.inbox.put((job, choices))
        return job

    def drain(self, seconds: float) -> None:
        """Take no more requests, and end the replies still running `seconds` from now."""
        if self.deadline is None:
            self.deadline = time.monotonic() + seconds

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._take(wait=not self.decoder.busy)
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self._end_all("length")
            self.replies = [r for r in self.replies if not r.finished and not r.sequence.cancelled]
            if not self.decoder.busy:
                continue
            try:
                self.decoder.step()
            except Exception as e:  # noqa: BLE001 — each request in flight is told, the log shows the traceback
                traceback.print_exc(file=sys.stderr)
                self._fail_all(e)
            self.load = {"running": len(self.decoder.rows), "waiting": len(self.decoder.waiting)}

    def _take(self, wait: bool) -> None:
        """Move the requests that came in to the decoder; when idle, wait up to a second for one."""
        try:
            job, choices = self.inbox.get(timeout=1.0) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._add(job, choices)
            try:
                job, choices = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, job: Job, choices: list[Choice]) -> None:
        for index, choice in enumerate(choices):
            reply = Reply(choice, index, self.tokenizer, job)
            generator = torch.Generator(device=self.device).manual_seed(choice.seed)
            sampling = {"temperature": choice.temperature, "top_k": choice.top_k, "top_p": choice.top_p}
            sequence = Sequence(choice.prompt, reply.accept, choice.max_tokens, **sampling, generator=generator)
            reply.sequence = sequence
            job.sequences.append(sequence)
            self.replies.append(reply)
            self.decoder.add(sequence)

    def _end_all(self, reason: str) -> None:
        for reply in self.replies:
            if not reply.finished:
                reply.finish("", reason)
            reply.job.cancel_sequences()

    def _fail_all(self, error: Exception) -> None:
        """Tell every request in flight that decoding failed, and start afresh."""
        jobs = {id(reply.job): reply.job for reply in self.replies}
        for job in jobs.values():
            job.cancel_sequences()
            job.send(EngineFailure(f"{type(error).__name__}: {error}"))
        self.replies = []
        self.decoder = BatchDecoder(self.model, self.tokenizer.vocab_size, self.max_rows, self.one_token_step)
