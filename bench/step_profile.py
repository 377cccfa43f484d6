r"""Where one training step's time goes, ours beside nanoGPT's model.py at the same size and batch,
on a CPU: the CPU time of each part of a step (data, forward by module kind, backward, clipping,
optimizer, what is left: the step's own Python), and torch.profiler's costliest operators.

    python bench/step_profile.py --nanogpt ~/nanoGPT --config configs/shakespeare_char_gpt2.toml --rounds 10

Ours is the config's run built as train.py builds it (overrides as --section.key=value), stepped
by Trainer.train_step; nanoGPT's is its GPT class built from its model.py with the config's model
size and the same optimizer settings (its configure_optimizers), stepped as its train.py steps on
a CPU (get_batch from a memmap, forward, backward, clipping, AdamW). Both run on --threads torch
threads (default 1) in this process, in blocks of 10 steps in turns, ABBA, --rounds rounds, after 5
untimed steps each. Times are the thread's CPU time (time.thread_time), not wall time: on a machine
shared with other work, a step's CPU time barely moves while its wall time doubles. The parts are
timed by wrapping the calls from outside (forward hooks for the modules), in rounds of their own
after the plain ones. --ops N then prints the N operators with the most self time of 5 steps of
each under torch.profiler (wall time: read them on a quiet machine).
"""

import contextlib
import importlib.util
import io
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from bench.speedrun import check_nanogpt  # noqa: E402
from data.corpus import ensure_prepared  # noqa: E402
from errors import run_cli  # noqa: E402
from trainer.config import Config, load_config, override_keys  # noqa: E402
from trainer.loop import Trainer  # noqa: E402

MODULE_KINDS = (
    "CausalSelfAttention",
    "MLP",
    "SwiGLU",
    "LayerNorm",
    "RMSNorm",
    "Embedding",
)  # forward time by these module classes
BLOCK = 10  # steps per timed block
REST = "whole step - the parts (the step's own Python)"


class Parts:
    """CPU seconds spent in labelled calls, per program."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def timed(self, work: Callable, label: str) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return work(*args, **kwargs)
            finally:
                self.seconds[label] += time.thread_time() - start

        return wrapper

    def hook_modules(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            kind = type(module).__name__
            if kind in MODULE_KINDS:
                module.register_forward_pre_hook(lambda m, args: setattr(m, "_start", time.thread_time()))
                label = f"forward: {kind}"
                module.register_forward_hook(
                    lambda m, args, out, label=label: self.seconds.__setitem__(
                        label, self.seconds[label] + time.thread_time() - m._start
                    )
                )


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_argument("--nanogpt", required=True, type=Path, metavar="DIR", help="a checkout of nanoGPT")
    parser.add_argument("--config", default="configs/shakespeare_char_gpt2.toml", help="our TOML config")
    parser.add_count("--rounds", minimum=2, default=10, help="rounds, a block of 10 steps of each per round")
    parser.add_count("--threads", default=1, help="torch threads (default: 1)")
    parser.add_count("--ops", minimum=0, default=0, metavar="N", help="print each one's N costliest operators")
    args, overrides = parser.parse_overrides(override_keys())
    check_nanogpt(args.nanogpt)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_config(
            args.config, [*overrides, f"--train.out_dir={scratch}/run", f"--train.threads={args.threads}"]
        )
        ensure_prepared(cfg.data.dataset, cfg.data.data_dir)
        ours = Trainer(cfg)
        parts = {"ours": Parts(), "nanoGPT": Parts()}
        cfg = ours.cfg  # with the dataset's vocabulary size
        steps = {"ours": lambda: ours.train_step(cfg.optim.learning_rate), "nanoGPT": nanogpt_step(args.nanogpt, cfg)}
        current = {}  # which program is stepping, for the backward's label
        warm_up(steps, current)
        plain = alternate(steps, args.rounds)
        steps["nanoGPT"] = nanogpt_step(args.nanogpt, cfg, parts["nanoGPT"])  # before ours: its own clipping
        backward, clip = torch.Tensor.backward, torch.nn.utils.clip_grad_norm_
        instrument(ours, parts["ours"])
        torch.Tensor.backward = lambda *a, **k: parts[current["name"]].timed(backward, "backward")(*a, **k)
        try:
            warm_up(steps, current)
            for part in parts.values():
                part.seconds.clear()
            labelled = alternate(steps, args.rounds, current)
        finally:
            torch.Tensor.backward, torch.nn.utils.clip_grad_norm_ = backward, clip
        print_table(plain, labelled, parts, args.rounds * BLOCK, args.threads)  # before the profiled steps add to parts
        if args.ops:
            print()
            print_operators(steps, args.ops)
        ours.run_dir.release()


def nanogpt_step(folder: Path, cfg: Config, parts: Parts | None = None) -> Callable[[], torch.Tensor]:
    """One step of nanoGPT's train.py on a CPU, its model and optimizer built from its model.py."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", folder / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    m, optim = cfg.model, cfg.optim
    torch.manual_seed(cfg.train.seed)
    size = dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd, block_size=m.block_size)
    with contextlib.redirect_stdout(io.StringIO()):  # its notes on the parameters and AdamW
        model = module.GPT(module.GPTConfig(**size, vocab_size=m.vocab_size, dropout=m.dropout, bias=m.bias))
        betas = (optim.beta1, optim.beta2)
        optimizer = model.configure_optimizers(optim.weight_decay, optim.learning_rate, betas, "cpu")
    path = Path(cfg.data.data_dir) / cfg.data.dataset / "train.bin"
    B, T = cfg.data.batch_size, m.block_size

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:  # nanoGPT's, for a CPU: a fresh memory map each time
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        starts = torch.randint(len(tokens) - T, (B,))
        x = torch.stack([torch.from_numpy(tokens[i : i + T].astype(np.int64)) for i in starts])
        y = torch.stack([torch.from_numpy(tokens[i + 1 : i + 1 + T].astype(np.int64)) for i in starts])
        return x, y

    label = parts.timed if parts is not None else lambda work, _: work
    if parts is not None:
        parts.hook_modules(model)
    batch = [get_batch()]
    clip = label(torch.nn.utils.clip_grad_norm_, "clipping")
    step_optimizer, zero_grad = label(optimizer.step, "optimizer"), label(optimizer.zero_grad, "zero_grad")
    forward, next_batch = label(model, "forward"), label(get_batch, "data")

    def step() -> torch.Tensor:
        for group in optimizer.param_groups:
            group["lr"] = optim.learning_rate
        _, loss = forward(*batch[0])
        batch[0] = next_batch()  # nanoGPT draws the next batch while the device works
        loss.backward()
        clip(model.parameters(), cfg.train.grad_clip)
        step_optimizer()
        zero_grad(set_to_none=True)
        return loss

    return step


def instrument(trainer: Trainer, parts: Parts) -> None:
    """Time the parts of Trainer.train_step from outside, without changing what it computes."""
    trainer.batches.next_batch = parts.timed(trainer.batches.next_batch, "data")
    trainer.forward = parts.timed(trainer.forward, "forward")
    trainer.optimizer.step = parts.timed(trainer.optimizer.step, "optimizer")
    trainer.optimizer.zero_grad = parts.timed(trainer.optimizer.zero_grad, "zero_grad")
    clip = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = parts.timed(clip, "clipping")  # train_step reads it at each call
    parts.hook_modules(trainer.model)


def warm_up(steps: dict, current: dict) -> None:
    """5 untimed steps of each program: first allocations."""
    for name, step in steps.items():
        current["name"] = name
        for _ in range(5):
            step().item()


def alternate(steps: dict, rounds: int, current: dict | None = None) -> dict[str, list[float]]:
    """CPU seconds per step of each program, per block, the blocks in turns (ABBA)."""
    seconds = {name: [] for name in steps}
    for round_ in range(rounds):
        for name in list(steps) if round_ % 2 == 0 else list(reversed(steps)):
            if current is not None:
                current["name"] = name
            start = time.thread_time()
            for _ in range(BLOCK):
                loss = steps[name]()
            loss.item()
            seconds[name].append((time.thread_time() - start) / BLOCK)
    return seconds


def print_operators(steps: dict, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step().item()
        print(f"{name}, 5 steps:")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50))


def print_table(plain: dict, labelled: dict, parts: dict[str, Parts], steps: int, threads: int) -> None:
    medians = {name: 1000 * statistics.median(seconds) for name, seconds in plain.items()}
    ratios = [ours / theirs for ours, theirs in zip(plain["ours"], plain["nanoGPT"], strict=True)]
    print(
        f"CPU ms per step ({threads} thread(s), medians of {len(ratios)} blocks of {BLOCK}, in turns): ours "
        f"{medians['ours']:.2f}, nanoGPT {medians['nanoGPT']:.2f}; ours / nanoGPT {statistics.median(ratios):.3f} "
        f"(median of the blocks' ratios, {min(ratios):.3f} to {max(ratios):.3f})"
    )
    print()
    print("| part of a step (CPU ms per step) | ours | nanoGPT | ours - nanoGPT |")
    print("| --- | ---: | ---: | ---: |")
    totals = {name: 1000 * sum(seconds) / len(seconds) for name, seconds in labelled.items()}
    labels = ["data", "forward", *(f"forward: {kind}" for kind in MODULE_KINDS), "backward", "clipping"]
    per_step = {name: {k: 1000 * v / steps for k, v in parts[name].seconds.items()} for name in parts}
    for name in per_step:  # what no part holds: the step's own Python
        top = ("data", "forward", "backward", "clipping", "optimizer", "zero_grad")
        per_step[name][REST] = totals[name] - sum(per_step[name].get(k, 0.0) for k in top)
        per_step[name]["whole step"] = totals[name]
    for label in [*labels, "optimizer", "zero_grad", REST, "whole step"]:
        ours, theirs = per_step["ours"].get(label, 0.0), per_step["nanoGPT"].get(label, 0.0)
        if label not in per_step["ours"] and label not in per_step["nanoGPT"]:
            continue  # a module kind neither model has
        print(f"| {label} | {ours:.2f} | {theirs:.2f} | {ours - theirs:+.2f} |")


if __name__ == "__main__":
    run_cli(main)
