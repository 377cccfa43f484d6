"""Stop requests: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption) end a run after the
micro-batch, or evaluation batch, in progress, at the same one in every process."""

import signal
import time

import torch

from trainer.distributed import World

STOP_POLL_SECONDS = 2.0  # under torchrun, how often the processes agree on a stop request (Ctrl-C, SIGTERM)


class StopSignals:
    """While active, SIGINT (Ctrl-C) and SIGTERM (preemption; torchrun passes it on) ask the run to
    stop: the handler only sets a flag, which the loop reads after every step and between the
    micro-batches of a step (`requested`), an evaluation after every batch (`during_evaluation`), and
    an [rl] step's sampling after every batch of answers (`during_sampling`); the run then drops the
    step it was in the middle of, writes the checkpoint of its last finished
    step and returns. A step of a large model made of many micro-batches thus never delays a stop by
    more than one micro-batch. A second Ctrl-C interrupts at once.

    An evaluation that a stop interrupts is left unfinished (no record): a preemption's grace period
    (often 30 s) may be shorter than the evaluation of a large model. A resumed run does it first.

    A single process reads its own flag, a Python attribute: free. Under torchrun the processes must
    stop at the same step, or evaluation batch, and agreeing takes an all-reduce (on CUDA a host
    sync, which would stall the queue of GPU work if done every step). So they agree about every
    STOP_POLL_SECONDS (`_Agreement`), counting micro-batches: every process runs the same number of
    them per step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, world: World, device: torch.device, step: int, micro_batches: int = 1):
        self.world, self.device = world, device
        self.micro_batches = micro_batches  # this process's micro-batches in one step
        self.signal: int | None = None
        self.agreed: int | None = None  # the signal the processes last agreed to stop on
        self.training = _Agreement(self, step * micro_batches)

    def __enter__(self) -> "StopSignals":
        self.previous = {signum: signal.signal(signum, self._request) for signum in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def requested(self, step: int, micro_batches_done: int = 0) -> int | None:
        """The signal to stop on after `step` steps and micro_batches_done micro-batches of the next
        (the same in every process), or None to go on."""
        return self.training.requested(step * self.micro_batches + micro_batches_done)

    def during_evaluation(self) -> "_Agreement":
        """The agreement for one evaluation: its `requested(batches)` after each batch."""
        return _Agreement(self, 0)

    def during_sampling(self) -> "_Agreement":
        """The agreement for sampling one step's answers (an [rl] run): its `requested(batches)` after each
        batch of answers; a stop there drops the step, as between its micro-batches."""
        return _Agreement(self, 0)

    def _request(self, signum: int, frame) -> None:
        # no printing here: the signal may arrive in the middle of another write to the terminal
        self.signal = signum
        signal.signal(signal.SIGINT, self.previous[signal.SIGINT])


class _Agreement:
    """When the processes under torchrun next share their stop flags, counting micro-batches (or evaluation
    batches): each all-reduce also shares the slowest process's time per unit, from which every
    process computes the same next count to meet at, about STOP_POLL_SECONDS later (the next one,
    while a unit takes longer than that)."""

    def __init__(self, stop: StopSignals, count: int):
        self.stop = stop
        self.next_poll = self.last_poll = count
        self.last_poll_time = time.monotonic()

    def requested(self, count: int) -> int | None:
        """The signal to stop on after `count` units (the same in every process), or None to go on."""
        stop = self.stop
        if not stop.world.launched:
            stop.agreed = stop.signal
            return stop.agreed
        if count < self.next_poll:
            return None
        now = time.monotonic()
        seconds_per_unit = (now - self.last_poll_time) / max(count - self.last_poll, 1)
        signum, seconds_per_unit = stop.world.max([float(stop.signal or 0), seconds_per_unit], stop.device)
        self.next_poll = count + max(1, round(STOP_POLL_SECONDS / max(seconds_per_unit, 1e-9)))
        self.last_poll, self.last_poll_time = count, now
        stop.agreed = int(signum) or None  # SIGTERM wins over SIGINT if processes got different ones
        return stop.agreed
