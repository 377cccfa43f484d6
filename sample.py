"""Generate text from a trained model, streamed token by token.

    python sample.py --prompt "ROMEO:"
    python sample.py --out-dir out/shakespeare_char --num-samples 3 --temperature 0.7

The prompt is encoded in one forward pass, then each new token costs one step over the KV cache.
The model sees at most block_size tokens: once a sample grows past that, the context slides, the
last block_size // 2 tokens are encoded afresh and generation goes on, so each new token sees
between block_size // 2 and block_size tokens. A prompt longer than block_size is an error.
GPT-2 BPE models stop a sample at <|endoftext|>.
"""

import argparse
import sys
from pathlib import Path

import torch

from data.tokenizer import StreamDecoder, Tokenizer
from errors import UserError, run_cli
from model import GPT, generate
from trainer.checkpoint import CHECKPOINT_NAME, latest_run, load_checkpoint, model_from_checkpoint
from trainer.runtime import resolve_device, resolve_dtype

RUNS_ROOT = Path("out")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt",
        default="",
        help="text to continue (default: a newline for character models, <|endoftext|> for GPT-2 BPE)",
    )
    source.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    parser.add_argument(
        "--out-dir", help=f"run directory holding {CHECKPOINT_NAME} (default: the most recent run under {RUNS_ROOT}/)"
    )
    parser.add_argument("--num-samples", type=int, default=1, help="samples to draw, one after another (default: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=500, help="tokens to generate per sample (default: 500)")
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="below 1 sharpens, above 1 flattens; 0 is greedy (default: 0.8)"
    )
    parser.add_argument(
        "--top-k", type=int, default=200, help="sample among the k most likely tokens; 0 = all (default: 200)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the most likely tokens holding this much probability; 1 = all (default: 1)",
    )
    parser.add_argument("--seed", type=int, default=1337, help="random seed (default: 1337)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the model is cast to this; auto: bfloat16 on GPUs from Ampere on, float16 on older ones, else float32",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="re-encode the whole context at every step instead of using the KV cache (slow; shows what it saves)",
    )
    args = parser.parse_args()
    checks = [
        ("--num-samples", args.num_samples, args.num_samples >= 1, "1 or more"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "1 or more"),
        ("--temperature", args.temperature, args.temperature >= 0, "0 (greedy) or more"),
        ("--top-k", args.top_k, args.top_k >= 0, "0 (off) or more"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
    ]
    for flag, value, ok, accepted in checks:
        if not ok:
            raise UserError(f"{flag}={value} is not allowed (use {accepted})")
    return args


def read_prompt(args: argparse.Namespace, default: str) -> str:
    if args.prompt_file is None:
        return args.prompt or default
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8") or default
    except FileNotFoundError:
        raise UserError(f"--prompt-file={args.prompt_file!r} does not exist") from None
    except OSError as e:
        raise UserError(f"--prompt-file={args.prompt_file!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file={args.prompt_file!r} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    run_dir = Path(args.out_dir) if args.out_dir else latest_run(RUNS_ROOT)
    checkpoint_path = run_dir / CHECKPOINT_NAME
    model, tokenizer = model_from_checkpoint(load_checkpoint(checkpoint_path), checkpoint_path)
    model.to(device=device, dtype=dtype)

    prompt = read_prompt(args, default="<|endoftext|>" if tokenizer.eot_token is not None else "\n")
    prompt_ids = tokenizer.encode(prompt)
    block_size = model.config.block_size
    if len(prompt_ids) > block_size:
        raise UserError(
            f"the prompt is {len(prompt_ids)} tokens but the model's context is block_size={block_size} "
            f"tokens (shorten the prompt)"
        )
    print(f"sampling from {checkpoint_path} on {device.type}", file=sys.stderr)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for i in range(args.num_samples):
        if i > 0:
            print("\n" + "-" * 40)
        write_sample(model, tokenizer, prompt, prompt_ids, args, generator)


def write_sample(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    prompt_ids: list[int],
    args: argparse.Namespace,
    generator: torch.Generator,
) -> None:
    """Generate one sample and write it to stdout token by token, ending at <|endoftext|> if any."""
    sys.stdout.write(prompt)
    decoder = StreamDecoder(tokenizer)
    tokens = generate(
        model,
        torch.tensor([prompt_ids], dtype=torch.long, device=generator.device),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        stop_token=tokenizer.eot_token,
        vocab_size=tokenizer.vocab_size,
        generator=generator,
        use_cache=not args.no_cache,
    )
    for token in tokens:
        token_id = int(token[0])
        if token_id == tokenizer.eot_token:
            break
        sys.stdout.write(decoder.feed(token_id))
        sys.stdout.flush()
    sys.stdout.write(decoder.flush() + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    run_cli(main)
