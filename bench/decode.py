"""Decoding speed: this project's sampler against transformers' generate, on the same weights.

    python bench/decode.py                  # GPT-2 124M shape, prompt 16, 256 new tokens (the recorded table)
    python bench/decode.py --small          # a tiny model and 32 new tokens: checks the script in seconds
    python bench/decode.py --device cuda --dtype bfloat16 --batch-sizes 1 --new-tokens 512 --repeats 3

Weights are random (speed does not depend on their values) and shared: transformers' GPT2LMHeadModel
is built first and its weights are loaded into ours. Both decode greedily for exactly --new-tokens
tokens from the same random prompts, with the same torch thread count and dtype, in one process. A
row's time covers the whole call, prompt encoding included; tokens/s counts new tokens over all rows,
ms/token is the time per decoding step. Each configuration runs once untimed (for warm-up and
compilation) and then --repeats times; the table gives the fastest run, and the progress lines and
--json the first call's time too (for the compiled row, how long its compilation makes one wait).

On a CPU our sampler runs as sample.py runs it: with its linear layers packed for oneDNN
(inference/packed_linear.py). The same sampler with plain nn.Linear layers (as under --compile) is
timed too, so the table shows what the packing does and what the rest of the sampler does.

The no-cache path re-encodes the whole context for every token, so its cost grows with the square
of the length: it is measured at batch 1 only (at batch 8 it would take most of the time budget).

The "matrix products only" rows are a floor for a sampler using those products: the step's 49
weight products (4 per block and the output layer), and nothing else, --new-tokens times. Below the
table, an estimate of the memory bound at batch 1: the bytes of all weights over the read bandwidth
of a sum over a 1 GiB buffer (far larger than the caches). Well-tuned products can read faster than
that sum does, so compare with the products-only row too. --json PATH also writes the rows and
the estimate as JSON, rewritten after each row (`complete` false until the estimate is in), so a
run stopped early leaves the rows it timed.
"""

import argparse
import copy
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments, write_json  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from inference.packed_linear import PackedLinear, pack_linears, packing_unavailable  # noqa: E402
from interop.families import config_from_hf, state_dict_from_hf  # noqa: E402
from model import GPT  # noqa: E402
from model.generate import generate  # noqa: E402
from trainer.runtime import DTYPES  # noqa: E402

N_POSITIONS = 1024  # GPT-2's context: transformers' model has no positions past it


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--small", action="store_true", help="2 layers, 128 dims, 32 new tokens: a quick check")
    parser.add_count("--new-tokens", help="tokens to generate per row (default: 256, --small: 32)")
    parser.add_count("--prompt-len", default=16, help="prompt tokens per row (default: 16)")
    parser.add_count("--batch-sizes", nargs="+", default=[1, 8], help="(default: 1 8)")
    parser.add_count("--threads", default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_count("--repeats", default=1, help="timed runs per configuration (default: 1)")
    parser.add_device()
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="both models' dtype (default: float32)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_json_output("--json", ("new_tokens", "rows"), help="also write the rows to this JSON file")
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or (32 if args.small else 256)
    if args.prompt_len + args.new_tokens > N_POSITIONS:
        raise UserError(
            f"--prompt-len={args.prompt_len} and --new-tokens={args.new_tokens} make "
            f"{args.prompt_len + args.new_tokens} positions, more than the {N_POSITIONS} that transformers' GPT-2 has"
        )
    return args


def build_models(small: bool, device: torch.device, dtype: torch.dtype) -> tuple[GPT, GPT | None, torch.nn.Module]:
    """transformers' model, ours with the same weights, and ours with its linear layers packed (None
    where packing does not apply)."""
    import transformers

    shape = dict(n_layer=2, n_head=2, n_embd=128) if small else dict(n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_positions=N_POSITIONS, vocab_size=50257, **shape)
    reference = transformers.GPT2LMHeadModel(hf_config).eval().to(device=device, dtype=dtype)
    family, config = config_from_hf(hf_config.to_dict(), "the benchmark's GPT2Config")
    ours = GPT(config)
    ours.load_state_dict(state_dict_from_hf(reference.state_dict(), config, family, "the benchmark's model"))
    ours.eval().to(device=device, dtype=dtype)
    packed = None if packing_unavailable(device, dtype) else pack_linears(copy.deepcopy(ours))
    return ours, packed, reference


def time_call(run, device: torch.device, repeats: int) -> tuple[float, float]:
    """The fastest of repeats calls, after an untimed first one (allocator, kernels, compilation),
    and how long that first call took."""
    first, best = timed(run, device), float("inf")
    for _ in range(repeats):
        best = min(best, timed(run, device))
    return best, first


def timed(run, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def read_bandwidth(device: torch.device, small: bool) -> float:
    """Bytes per second that a sum over a 1 GiB buffer (64 MiB with --small) reads (fastest of 5)."""
    buffer = torch.ones(2**24 if small else 2**28, device=device)
    return buffer.numel() * buffer.element_size() / time_call(buffer.sum, device, repeats=5)[0]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device, dtype, new_tokens = args.device, DTYPES[args.dtype], args.new_tokens
    ours, packed, reference = build_models(args.small, device, dtype)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads, device {device}; model {ours.num_params() / 1e6:.0f}M parameters ({args.dtype}), "
        f"prompt {args.prompt_len} tokens, {new_tokens} new tokens",
        file=sys.stderr,
    )
    rows, firsts = [], []  # each row's figures, and its first call's seconds (a compiled row's compilation)
    for batch_size in args.batch_sizes:
        prompt = torch.randint(0, 50257, (batch_size, args.prompt_len), generator=torch.Generator().manual_seed(1))
        runs = configurations(ours, packed, reference, prompt.to(device), new_tokens, args.no_compile)
        for name, cache, mode, products, run in runs:
            seconds, first = time_call(run, device, args.repeats)
            rows.append((name, batch_size, cache, mode, products, seconds))
            firsts.append(first)
            print(
                f"  {name}, batch {batch_size}, cache {cache}, {mode}, {products}: {seconds:.2f} s "
                f"(the untimed first call: {first:.2f} s)",
                file=sys.stderr,
            )
            if args.json:
                write_json(
                    args.json, dict(new_tokens=new_tokens, rows=json_rows(rows, firsts, new_tokens), complete=False)
                )
    print_table(rows, new_tokens)
    tables = sum(p.nbytes for p in ours.transformer.wpe.parameters())  # the position table, if any
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters()) - tables
    bandwidth = read_bandwidth(device, args.small)
    bound_ms = 1000 * weight_bytes / bandwidth
    print(
        f"\nMemory bound at batch 1 (estimate): {weight_bytes / 1e6:.0f} MB of weights per step at the "
        f"{bandwidth / 1e9:.1f} GB/s that a sum reads = {bound_ms:.1f} ms/token, {1000 / bound_ms:.1f} tokens/s."
    )
    if args.json:
        estimate = dict(weight_bytes=weight_bytes, read_bytes_per_sec=bandwidth, bound_tokens_per_sec=1000 / bound_ms)
        rows_json = json_rows(rows, firsts, new_tokens)
        write_json(args.json, dict(new_tokens=new_tokens, rows=rows_json, complete=True) | estimate)


def json_rows(rows: list[tuple], firsts: list[float], new_tokens: int) -> list[dict]:
    columns = ("implementation", "batch", "cache", "mode", "products", "seconds")
    return [
        dict(zip(columns, row, strict=True), tokens_per_sec=row[1] * new_tokens / row[-1], first_call_seconds=first)
        for row, first in zip(rows, firsts, strict=True)
    ]


def configurations(
    ours: GPT, packed: GPT | None, reference: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, no_compile: bool
) -> list:
    """(implementation, KV cache, mode, matrix products, function to time) for one batch of prompts."""

    def ours_run(model: GPT, use_cache: bool = True, compile: bool = False):
        return lambda: list(generate(model, prompt, new_tokens, temperature=0, use_cache=use_cache, compile=compile))

    def reference_run():
        with torch.no_grad():
            reference.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
            )  # fmt: skip

    def products_only(model: GPT):
        layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
        dtype = model.transformer.wte.weight.dtype
        widths = {layer.in_features for layer in layers}
        inputs = {n: torch.randn(prompt.size(0), 1, n, device=prompt.device, dtype=dtype) for n in widths}

        def run():
            with torch.no_grad():
                for _ in range(new_tokens):
                    for layer in layers:
                        layer(inputs[layer.in_features])

        return run

    fastest = packed if packed is not None else ours  # what sample.py decodes with on this device
    fastest_products = "nn.Linear" if packed is None else "oneDNN packed"
    runs = [
        ("transformers generate", "yes", "eager", "transformers", reference_run),
        ("ours", "yes", "eager", fastest_products, ours_run(fastest)),
    ]
    if packed is not None:
        runs.append(("ours", "yes", "eager", "nn.Linear", ours_run(ours)))
    if not no_compile:
        runs.append(("ours", "yes", "compiled", "nn.Linear", ours_run(ours, compile=True)))
    if prompt.size(0) == 1:
        runs.append(("ours", "no", "eager", fastest_products, ours_run(fastest, use_cache=False)))
    runs.append(("matrix products only (floor)", "-", "eager", fastest_products, products_only(fastest)))
    if packed is not None:
        runs.append(("matrix products only (floor)", "-", "eager", "nn.Linear", products_only(ours)))
    return runs


def print_table(rows, new_tokens: int) -> None:
    columns = ["implementation", "batch", "KV cache", "mode", "matrix products", f"seconds for {new_tokens} tokens"]
    columns += ["tokens/s", "ms/token", "vs transformers"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    reference = {row[1]: row[-1] for row in rows if row[0].startswith("transformers")}
    for name, batch, cache, mode, products, seconds in rows:
        tokens_per_sec, ms_per_token = batch * new_tokens / seconds, 1000 * seconds / new_tokens
        print(
            f"| {name} | {batch} | {cache} | {mode} | {products} | {seconds:.2f} | {tokens_per_sec:.1f} | "
            f"{ms_per_token:.1f} | {reference[batch] / seconds:.2f}x |"
        )
    eager = {(row[1], row[4]): row[-1] for row in rows if row[0] == "ours" and row[3] == "eager" and row[2] == "yes"}
    for name, batch, cache, _, products, seconds in rows:
        if name == "ours" and cache == "no":
            speedup = seconds / eager[batch, products]
            print(f"\nWith the KV cache ({products}, batch {batch}): {speedup:.1f}x the tokens/s without it.")


if __name__ == "__main__":
    run_cli(main)
