"""How fast one row's product reads a weight in each precision the compiled decoding step stores,
against what the memory gives: GB/s of weight read, at each thread count.

    python bench/products.py --threads 1 2

The weight is GPT-2's output layer by default (50,257 x 768, the largest product of a token), held
as the compiled step holds it (inference/packed_linear.py: StreamedLinear in float32, bfloat16 and
float16, Int8Linear in int8) and multiplied by one float32 row in a graph compiled with the step's
options (inference/decode_step.py COMPILE_OPTIONS). Beside them: a compiled sum over as many bytes
as the float32 weight (the memory's pace, no arithmetic to speak of), and, where PyTorch has fbgemm,
its product of int8 weights by 8-bit activations (the row rounded at each call to uint8 with one
scale; llama.cpp's Q8_0 rounds it to int8 in blocks of 32; not what --precision int8 computes).
--copies weights of each, used in turn, keep the weight out of the cache; --repeats rounds, every
other one in reverse order; the median of each.
"""

import statistics
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from errors import run_cli  # noqa: E402
from inference.decode_step import COMPILE_OPTIONS  # noqa: E402
from inference.packed_linear import INT8_WIDTH_MULTIPLE, Int8Linear, StreamedLinear, in_huge_pages  # noqa: E402


def products(rows: int, cols: int, copies: int) -> dict[str, tuple[int, list[Callable[[], object]]]]:
    """For each row of the table, the bytes one call reads and `copies` calls, each over its own weight."""
    torch.manual_seed(0)
    linears = [nn.Linear(cols, rows, bias=False).requires_grad_(False) for _ in range(copies)]
    x = torch.randn(1, cols)
    table = {}
    for name in ("float32", "bfloat16", "float16"):
        layers = [StreamedLinear(linear, getattr(torch, name)) for linear in linears]
        table[f"{name} weights"] = (rows * cols * layers[0].weight.element_size(), _compiled(layers, "weight", x))
    layers = [Int8Linear(linear) for linear in linears]
    table["int8 weights (--precision int8)"] = (rows * cols, _compiled(layers, "weight_int8", x))
    flat = in_huge_pages([linear.weight.view(-1) for linear in linears])
    total = torch.compile(lambda w: w.sum(), dynamic=False, options=dict(COMPILE_OPTIONS))
    table["a sum over the float32 weight's bytes"] = (rows * cols * 4, [partial(total, w) for w in flat])
    if "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch, "quantize_per_channel"):
        torch.backends.quantized.engine = "fbgemm"
        packed = [torch.ops.quantized.linear_prepack(_per_row_int8(linear.weight), None) for linear in linears]
        calls = [partial(torch.ops.quantized.linear_dynamic, x, p) for p in packed]
        table["fbgemm: int8 weights by uint8 activations"] = (rows * cols, calls)
    return table


def _compiled(layers: list[nn.Module], name: str, x: torch.Tensor) -> list[Callable[[], object]]:
    """A call of each layer's one-row product of x, compiled as the decoding step compiles it, its
    weight (the buffer `name`) where the step's weights lie (stream_linears: in huge pages)."""
    for layer, weight in zip(layers, in_huge_pages([getattr(layer, name) for layer in layers]), strict=True):
        setattr(layer, name, weight)
    return [partial(torch.compile(layer.product, dynamic=False, options=dict(COMPILE_OPTIONS)), x) for layer in layers]


def _per_row_int8(weight: torch.Tensor) -> torch.Tensor:
    """weight quantized to int8 with a scale per output row, as Int8Linear's."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated in PyTorch; fbgemm's packing still takes them
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(weight, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)


def main() -> None:
    parser = BenchArguments(__doc__)
    parser.add_count("--rows", default=50257, help="the weight's output rows (default: 50257)")
    parser.add_count(
        "--cols", default=768, help=f"its input columns, a multiple of {INT8_WIDTH_MULTIPLE} (default: 768)"
    )
    parser.add_count("--threads", nargs="+", default=[1, 2], help="torch's threads, each in turn (default: 1 2)")
    parser.add_count("--copies", default=8, help="weights of each kind, used in turn (default: 8)")
    parser.add_count("--repeats", default=20, help="timed rounds (default: 20)")
    args = parser.parse_args()
    if args.cols % INT8_WIDTH_MULTIPLE:
        parser.error(f"--cols={args.cols}: give a multiple of {INT8_WIDTH_MULTIPLE} (int8 layers pad other widths)")
    table = products(args.rows, args.cols, args.copies)
    shape = f"{args.rows:,} x {args.cols:,}"
    print(f"one row times a {shape} weight, {args.copies} copies of each, torch {torch.__version__}")
    print("| threads | product | ms | GB/s of weight |")
    print("| --- | --- | --- | --- |")
    for threads in args.threads:
        torch.set_num_threads(threads)
        seconds = {name: [] for name in table}
        for _, calls in table.values():
            for call in calls:
                call()  # compiled at the first call, untimed
        for round_ in range(args.repeats):
            for name in table if round_ % 2 == 0 else reversed(table):
                calls = table[name][1]
                start = time.perf_counter()
                for call in calls:
                    call()
                seconds[name].append((time.perf_counter() - start) / len(calls))
        for name, (nbytes, _) in table.items():
            median = statistics.median(seconds[name])
            print(f"| {threads} | {name} | {median * 1e3:.3f} | {nbytes / median / 1e9:.1f} |")


if __name__ == "__main__":
    run_cli(main)
