"""Attention patterns at long context: one training step with full causal attention, a sliding window
of T/8 and document masking, side by side; and the KV cache memory of a sliding window's rolling
cache against the full cache.

    python bench/attention.py                                 # CPU: T = 1024, a small model
    python bench/attention.py --device cuda --block-size 4096 --n-layer 12 --n-head 12 --n-embd 768

Each pattern trains the same model (random weights, AdamW) on the same random tokens, in which an
end-of-text token every --document-length tokens on average cuts documents of random lengths; the
step is timed over --steps steps after --warmup untimed ones. The attention path says how the mask is
applied: SDPA's fused causal kernel (no mask), SDPA with a dense boolean (B, 1, T, T) mask, or
FlexAttention with a block mask (CUDA). The cache table gives the bytes of keys and values that
decoding block_size tokens holds, for a batch of --batch-size rows in float32.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

EOT = 0  # the document separator in the random tokens


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_device()
    # from 8 on, the window T/8 holds a position at least
    parser.add_count("--block-size", minimum=8, default=1024, help="context T, 8 or more (default: 1024)")
    parser.add_count("--batch-size", default=4, help="rows per step (default: 4)")
    parser.add_count("--n-layer", default=4, help="(default: 4)")
    parser.add_count("--n-head", default=4, help="(default: 4)")
    parser.add_count("--n-embd", default=256, help="(default: 256)")
    parser.add_count("--vocab-size", minimum=2, default=4096, help="(default: 4096; id 0 separates documents)")
    parser.add_count("--document-length", default=256, help="mean document length (default: 256)")
    parser.add_count("--steps", default=5, help="timed steps (default: 5)")
    parser.add_count("--warmup", minimum=0, default=2, help="untimed steps first (default: 2)")
    args = parser.parse_args()
    try:
        model_config(args, {})
    except ValueError as e:  # a shape the model refuses (n_embd not divisible by n_head)
        raise UserError(f"--n-layer, --n-head, --n-embd and --block-size describe no model: {e}") from None
    return args


def patterns(block_size: int) -> dict[str, dict]:
    return {
        "causal": {},
        f"window T/8 = {block_size // 8}": {"attn_window": block_size // 8},
        "documents": {"attn_documents": True, "eot_token": EOT},
    }


def random_batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, args.vocab_size, (args.batch_size, args.block_size + 1), generator=generator)
    separators = torch.rand(tokens.shape, generator=generator) < 1 / args.document_length
    tokens[separators] = EOT
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def attention_path(model: GPT, x: torch.Tensor) -> str:
    if model.plain_causal:
        return "SDPA, fused causal (no mask)"
    slots = torch.arange(x.size(1), device=x.device)
    mask = model.attention_mask(x, slots[None], slots, None, None, None)
    if isinstance(mask, torch.Tensor):
        return f"SDPA, dense bool mask {tuple(mask.shape)}"
    return "FlexAttention, block mask"


def time_step(args: argparse.Namespace, keys: dict, device: torch.device) -> tuple[float, str]:
    """Seconds per training step of one pattern, and its attention path."""
    torch.manual_seed(0)
    model = GPT(model_config(args, keys)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = random_batch(args, device)

    def step() -> None:
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps, attention_path(model, x)


def main() -> None:
    args = parse_args()
    device = args.device
    T = args.block_size
    tokens_per_step = args.batch_size * T
    print(
        f"one training step, {args.n_layer} layers x {args.n_head} heads x {args.n_embd} dims, "
        f"batch {args.batch_size} x T = {T}, {device.type}, float32 ({args.steps} steps after {args.warmup})\n"
    )
    print("| pattern | attention path | ms/step | tokens/s | vs causal |")
    print("| --- | --- | ---: | ---: | ---: |")
    baseline = None
    for name, keys in patterns(T).items():
        seconds, path = time_step(args, keys, device)
        baseline = baseline or seconds
        speed = f"{1000 * seconds:,.0f} | {tokens_per_step / seconds:,.0f} | {baseline / seconds:.2f}x"
        print(f"| {name} | {path} | {speed} |")
    print(f"\nKV cache for decoding {T} tokens, batch {args.batch_size}, float32\n")
    print("| cache | slots per layer | keys + values |")
    print("| --- | ---: | ---: |")
    for name, keys in (("full (causal)", {}), (f"rolling, window {T // 8}", {"attn_window": T // 8})):
        cache = GPT(model_config(args, keys)).new_cache(args.batch_size)
        held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        print(f"| {name} | {cache.k[0].size(2)} | {held / 2**20:,.1f} MiB |")


def model_config(args: argparse.Namespace, keys: dict) -> GPTConfig:
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size)
    return GPTConfig(block_size=args.block_size, **shape, **keys)


if __name__ == "__main__":
    run_cli(main)
