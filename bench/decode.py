"""Decoding speed: this project's sampler against transformers' generate, on the same weights.

    python bench/decode.py                  # GPT-2 124M shape, prompt 16, 256 new tokens (the recorded table)
    python bench/decode.py --small          # a tiny model and 32 new tokens: checks the script in seconds

Weights are random (speed does not depend on their values) and shared: transformers' GPT2LMHeadModel
is built first and its weights are loaded into ours. Both decode greedily for exactly --new-tokens
tokens from the same random prompts, with the same torch thread count, in one process. A row's time
covers the whole call, prompt encoding included; tokens/s counts new tokens over all rows, ms/token
is the time per decoding step. Each configuration runs once untimed (for warm-up and compilation)
and then --repeats times; the table gives the fastest run.

The no-cache path re-encodes the whole context for every token, so its cost grows with the square
of the length: it is measured at batch 1 only (at batch 8 it would take most of the time budget).

The "matrix products only" row is a floor for any sampler on these weights: the step's 49 weight
products (4 per block and the output layer), and nothing else, --new-tokens times.
"""

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model import GPT  # noqa: E402
from model.generate import generate  # noqa: E402
from model.hf_gpt2 import gpt_config_from_hf, state_dict_from_hf  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="2 layers, 128 dims, 32 new tokens: a quick check")
    parser.add_argument("--new-tokens", type=int, help="tokens to generate per row (default: 256, --small: 32)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row (default: 16)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="(default: 1 8)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per configuration (default: 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    return parser.parse_args()


def build_models(small: bool, device: torch.device):
    import transformers

    shape = dict(n_layer=2, n_head=2, n_embd=128) if small else dict(n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_positions=1024, vocab_size=50257, **shape)
    reference = transformers.GPT2LMHeadModel(hf_config).eval().to(device)
    config = gpt_config_from_hf(hf_config.to_dict(), "the benchmark's GPT2Config")
    ours = GPT(config)
    ours.load_state_dict(state_dict_from_hf(reference.state_dict(), config, "the benchmark's model"))
    return ours.eval().to(device), reference


def time_call(run, device: torch.device, repeats: int) -> float:
    run()  # warm-up: allocator, kernels, compilation
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    new_tokens = args.new_tokens or (32 if args.small else 256)
    ours, reference = build_models(args.small, device)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads, device {device}; model {ours.num_params() / 1e6:.0f}M parameters (fp32), "
        f"prompt {args.prompt_len} tokens, {new_tokens} new tokens",
        file=sys.stderr,
    )
    rows = []
    for batch_size in args.batch_sizes:
        prompt = torch.randint(0, 50257, (batch_size, args.prompt_len), generator=torch.Generator().manual_seed(1))
        for name, cache, mode, run in configurations(ours, reference, prompt.to(device), new_tokens, args.no_compile):
            seconds = time_call(run, device, args.repeats)
            rows.append((name, batch_size, cache, mode, seconds))
            print(f"  {name}, batch {batch_size}, cache {cache}, {mode}: {seconds:.2f} s", file=sys.stderr)
    print_table(rows, new_tokens)


def configurations(ours: GPT, reference, prompt: torch.Tensor, new_tokens: int, no_compile: bool) -> list:
    """(implementation, KV cache, mode, function to time) for one batch of prompts."""

    def ours_run(use_cache: bool, compile: bool = False):
        return lambda: list(generate(ours, prompt, new_tokens, temperature=0, use_cache=use_cache, compile=compile))

    def reference_run():
        with torch.no_grad():
            reference.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
            )  # fmt: skip

    linears = [module for module in ours.modules() if isinstance(module, torch.nn.Linear)]
    inputs = {n: torch.randn(prompt.size(0), n, device=prompt.device) for n in {m.in_features for m in linears}}

    def products_only():
        with torch.no_grad():
            for _ in range(new_tokens):
                for linear in linears:
                    linear(inputs[linear.in_features])

    runs = [("transformers generate", "yes", "eager", reference_run), ("ours", "yes", "eager", ours_run(True))]
    if not no_compile:
        runs.append(("ours", "yes", "compiled", ours_run(True, compile=True)))
    if prompt.size(0) == 1:
        runs.append(("ours", "no", "eager", ours_run(False)))
    runs.append(("matrix products only (floor)", "-", "eager", products_only))
    return runs


def print_table(rows, new_tokens: int) -> None:
    columns = ["implementation", "batch", "KV cache", "mode", f"seconds for {new_tokens} tokens", "tokens/s"]
    columns += ["ms/token", "vs transformers"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    reference = {batch: seconds for name, batch, _, _, seconds in rows if name.startswith("transformers")}
    for name, batch, cache, mode, seconds in rows:
        tokens_per_sec, ms_per_token = batch * new_tokens / seconds, 1000 * seconds / new_tokens
        print(
            f"| {name} | {batch} | {cache} | {mode} | {seconds:.2f} | {tokens_per_sec:.1f} | {ms_per_token:.1f} | "
            f"{reference[batch] / seconds:.2f}x |"
        )


if __name__ == "__main__":
    main()
