"""Attention patterns at long context: one training step with full causal attention, a sliding window
of T/8 and document masking, side by side; the same for attention alone (forward and backward); and
the KV cache memory of a sliding window's rolling cache against the full cache.

    python bench/attention.py                                 # CPU: T = 1024, a small model
    python bench/attention.py --device cuda --dtype bfloat16 --block-size 4096 --n-layer 12 --n-head 12 --n-embd 768

Each pattern trains the same model (random weights, AdamW) on the same random tokens, in which an
end-of-text token every --document-length tokens on average cuts documents of random lengths; the
step is timed over --steps steps after --warmup untimed ones. The attention path says how the mask is
applied: SDPA's fused causal kernel (no mask), SDPA with a dense boolean (B, 1, T, T) mask, the
weights spelled out (causal or with that mask, where it is the faster: a bfloat16 step on a CPU at
short context) or FlexAttention with a block mask (CUDA). --dtype other than float32 runs the step under autocast.

The second table times attention alone, as the model calls it (model.attention.attention), forward
and backward, on random (B, H, T, D) queries, keys and values in --dtype with each pattern's mask as
the model builds it for the same tokens: this is where a window's skipped blocks show, undiluted by
the rest of the step. The mask is built once, outside the timing. Its last column is the most a
pattern can gain on causal attention at this length: the tiles of 128 x 128 scores causal attention
computes (T/128 (T/128 + 1) / 2) over those the block mask leaves, partly masked ones included
(a window of 512 at T = 4096: 528 over 150, at most 3.52x). In bfloat16 on a CPU, where attention
chooses between SDPA's fused kernel and the weights spelled out, a last row times causal attention
by the path not taken, on the same inputs.

The cache table gives the bytes of keys and values that decoding block_size tokens holds, for a
batch of --batch-size rows in float32. --json PATH also writes the three tables as JSON.
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments, write_json  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from model import GPT, GPTConfig, attention  # noqa: E402
from model.attention import spelled_out, spelled_out_is_faster  # noqa: E402
from trainer.runtime import DTYPES, autocast  # noqa: E402

EOT = 0  # the document separator in the random tokens
TILE = 128  # FlexAttention's block of queries and of keys, the unit its block mask skips


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
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="(default: float32)")
    parser.add_json_output("--json", ("step", "attention", "cache"), help="also write the tables to this JSON file")
    args = parser.parse_args()
    try:
        model_config(args, {})
    except ValueError as e:  # a shape the model refuses (n_embd not divisible by n_head)
        raise UserError(f"--n-layer, --n-head, --n-embd and --block-size describe no model: {e}") from None
    return args


def patterns(block_size: int) -> dict[str, tuple[str, dict]]:
    """Each pattern's short name: its name in the tables, and its GPTConfig keys."""
    return {
        "causal": ("causal", {}),
        "window": (f"window T/8 = {block_size // 8}", {"attn_window": block_size // 8}),
        "documents": ("documents", {"attn_documents": True, "eot_token": EOT}),
    }


def random_batch(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, args.vocab_size, (args.batch_size, args.block_size + 1), generator=generator)
    separators = torch.rand(tokens.shape, generator=generator) < 1 / args.document_length
    tokens[separators] = EOT
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def pattern_mask(model: GPT, x: torch.Tensor) -> torch.Tensor | None:
    """The mask the model gives a training step on x: None (fused causal), dense or a BlockMask."""
    slots = torch.arange(x.size(1), device=x.device)
    return model.attention_mask(x, slots[None], slots, None, None, None)


def tiles_computed(mask, T: int) -> float | None:
    """The 128 x 128 tiles of scores attention computes with mask, per row and head: causal's for
    None (the fused kernel skips the tiles above the diagonal), the block mask's (full and partial
    tiles), or None for a dense mask (every tile is computed, then masked)."""
    if mask is None:
        n = -(-T // TILE)
        return n * (n + 1) / 2
    if isinstance(mask, torch.Tensor):
        return None
    rows_and_heads = mask.kv_num_blocks.shape[0] * mask.kv_num_blocks.shape[1]
    full = mask.full_kv_num_blocks.sum().item() if mask.full_kv_num_blocks is not None else 0
    return (mask.kv_num_blocks.sum().item() + full) / rows_and_heads


def attention_path(mask, q: torch.Tensor) -> str:
    """How attention applies the mask to queries like q (a training step's)."""
    if spelled_out_is_faster(q, q):
        return "weights spelled out, " + ("causal" if mask is None else f"dense bool mask {tuple(mask.shape)}")
    if mask is None:
        return "SDPA, fused causal (no mask)"
    if isinstance(mask, torch.Tensor):
        return f"SDPA, dense bool mask {tuple(mask.shape)}"
    return "FlexAttention, block mask"


def seconds_per_call(work, args: argparse.Namespace, device: torch.device) -> float:
    """Mean seconds of work() over --steps calls after --warmup untimed ones, the device finished."""
    for _ in range(args.warmup):
        work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / args.steps


def time_step(args: argparse.Namespace, keys: dict, device: torch.device) -> tuple[float, object]:
    """Seconds per training step of one pattern, and the mask its model gives attention."""
    torch.manual_seed(0)
    model = GPT(model_config(args, keys)).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = random_batch(args, device)

    def step() -> None:
        with autocast(device, DTYPES[args.dtype]):
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return seconds_per_call(step, args, device), pattern_mask(model, x)


def attention_inputs(args: argparse.Namespace, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Random (B, H, T, D) queries, keys and values that want gradients, and the output's gradient."""
    B, T, H, D = args.batch_size, args.block_size, args.n_head, args.n_embd // args.n_head
    generator = torch.Generator(device).manual_seed(0)
    q, k, v, grad = (
        torch.randn(B, H, T, D, generator=generator, device=device, dtype=DTYPES[args.dtype]) for _ in range(4)
    )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def time_attention(args: argparse.Namespace, keys: dict, device: torch.device) -> tuple[float, object]:
    """Seconds for attention's forward and backward pass alone with one pattern's mask, and the mask."""
    mask_model = GPT(dataclasses.replace(model_config(args, keys), n_layer=1)).to(device).train()  # builds the mask
    x, _ = random_batch(args, device)
    mask = pattern_mask(mask_model, x)
    q, k, v, grad = attention_inputs(args, device)

    def forward_backward() -> None:
        attention(q, k, v, mask).backward(grad)

    return seconds_per_call(forward_backward, args, device), mask


def time_causal_not_taken(args: argparse.Namespace, device: torch.device, spelled: bool) -> float:
    """Seconds for causal attention's forward and backward pass by the path attention does not take
    here: SDPA's fused kernel where it spells the weights out (spelled), else the weights spelled out."""
    q, k, v, grad = attention_inputs(args, device)

    def forward_backward() -> None:
        if spelled:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        else:
            spelled_out(q, k, v).backward(grad)

    return seconds_per_call(forward_backward, args, device)


def timed_patterns(time_one, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """time_one(args, keys, device) -> (seconds, mask) for each pattern, causal first, as table rows:
    the pattern's short name and name, its attention path, its seconds and causal's over them, and
    its tiles of scores computed and causal's over them (None for a dense mask)."""
    rows = []
    q = attention_inputs(args, device)[0]
    for short, (name, keys) in patterns(args.block_size).items():
        # each pattern compiles afresh, as in a run of its own: after another pattern's block mask of
        # other shapes, torch.compile could otherwise give it kernels made for dynamic shapes
        torch._dynamo.reset()
        seconds, mask = time_one(args, keys, device)
        tiles = tiles_computed(mask, args.block_size)
        baseline = rows[0] if rows else dict(seconds=seconds, tiles=tiles)
        ceiling = baseline["tiles"] / tiles if tiles and baseline["tiles"] else None
        rows.append(
            dict(
                pattern=short,
                name=name,
                path=attention_path(mask, q),
                seconds=seconds,
                vs_causal=baseline["seconds"] / seconds,
                tiles=tiles,
                tiles_vs_causal=ceiling,
            )
        )
    return rows


def main() -> None:
    args = parse_args()
    device = args.device
    T = args.block_size
    tokens_per_step = args.batch_size * T
    print(
        f"one training step, {args.n_layer} layers x {args.n_head} heads x {args.n_embd} dims, "
        f"batch {args.batch_size} x T = {T}, {device.type}, {args.dtype} ({args.steps} steps after {args.warmup})\n"
    )
    tables = {"step": timed_patterns(time_step, args, device), "attention": [], "cache": []}
    print("| pattern | attention path | ms/step | tokens/s | vs causal |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in tables["step"]:
        speed = f"{1000 * row['seconds']:,.0f} | {tokens_per_step / row['seconds']:,.0f} | {row['vs_causal']:.2f}x"
        print(f"| {row['name']} | {row['path']} | {speed} |")
    print(f"\nattention alone, forward and backward, {args.batch_size} x {args.n_head} heads x T = {T}\n")
    tables["attention"] = timed_patterns(time_attention, args, device)
    print("| pattern | attention path | ms | vs causal | at most (tiles of 128 x 128 computed) |")
    print("| --- | --- | ---: | ---: | --- |")
    for row in tables["attention"]:
        most = "n/a (a dense mask computes every tile)"
        if row["tiles_vs_causal"] is not None:
            most = f"{row['tiles_vs_causal']:.2f}x ({row['tiles']:,.0f} per row and head)"
        print(f"| {row['name']} | {row['path']} | {1000 * row['seconds']:,.2f} | {row['vs_causal']:.2f}x | {most} |")
    causal = tables["attention"][0]
    if device.type == "cpu" and args.dtype == "bfloat16":  # where attention chooses between the two
        spelled = causal["path"].startswith("weights spelled out")
        other = time_causal_not_taken(args, device, spelled)
        path = "SDPA, fused causal (not taken)" if spelled else "weights spelled out, causal (not taken)"
        vs_causal = causal["seconds"] / other
        tables["attention"].append(
            dict(causal, pattern="causal_not_taken", path=path, seconds=other, vs_causal=vs_causal)
        )
        print(f"| causal | {path} | {1000 * other:,.2f} | {vs_causal:.2f}x | |")
    print(f"\nKV cache for decoding {T} tokens, batch {args.batch_size}, float32\n")
    print("| cache | slots per layer | keys + values |")
    print("| --- | ---: | ---: |")
    for name, keys in (("full (causal)", {}), (f"rolling, window {T // 8}", {"attn_window": T // 8})):
        cache = GPT(model_config(args, keys)).new_cache(args.batch_size)
        held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
        tables["cache"].append(dict(cache=name, slots=cache.k[0].size(2), bytes=held))
        print(f"| {name} | {cache.k[0].size(2)} | {held / 2**20:,.1f} MiB |")
    if args.json:
        write_json(args.json, tables)


def model_config(args: argparse.Namespace, keys: dict) -> GPTConfig:
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab_size)
    return GPTConfig(block_size=args.block_size, **shape, **keys)


if __name__ == "__main__":
    run_cli(main)
