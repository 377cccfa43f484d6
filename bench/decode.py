"""Decoding speed: this project's sampler against transformers' generate and llama.cpp, on the same weights.

    python bench/decode.py                  # GPT-2 124M's shape, batches of 1, 4, 8 and 16 (the recorded table)
    python bench/decode.py --small          # a tiny model and 32 new tokens: checks the script in seconds
    python bench/decode.py --threads 1 --batch-sizes 1 --precisions float32 float16 --gguf-types F32 F16
    python bench/decode.py --threads 2 --batch-sizes 1 8 --step-rows-only --gguf-types F32 F16 Q8_0
    python bench/decode.py --device cuda --dtype bfloat16 --batch-sizes 1 --new-tokens 512 --repeats 3

Weights are random (speed does not depend on their values) and shared: transformers' GPT2LMHeadModel
is built first and its weights are loaded into ours, and, where llama.cpp's Python binding is
installed (docs/shipping.md), written to GGUF files of each --gguf-types type by sample.py's own
export. Every row decodes greedily for exactly --new-tokens tokens from the same random prompts, with
the same torch thread count (llama.cpp: the same number of threads), in one process.

Each row runs once untimed (warm-up, packing, compilation; the progress lines and --json give that
call's time), then the rows run in turn, --repeats rounds, in reverse order every other round, so a
change in the machine's load hits them alike. The table gives each row's median tokens/s (new tokens
over all rows, prompt encoding included) with the slowest and fastest round, ms per decoding step
(wall), the process's CPU ms per step (all threads: steadier than the wall time on a busy machine),
the ratio to transformers and to llama.cpp (F32 for float32, F16 for float16 and bfloat16, Q8_0 for
int8), and whether its tokens equal those of this sampler in float32 (the share of equal tokens if not).
Each round also times the first new token apart (the prompt's encoding and the first sample: "first
token ms"), and the table splits the whole into it and the tokens after it ("tokens/s after the
first": the one-token steps alone, as llama.cpp's llama-bench reports generation apart from the
prompt), with their own ratio to llama.cpp.

The machine's memory reads faster or slower from minute to minute (here: a sum at 26 to 60 GB/s),
which moves whole rounds apart. --alternate also times each of our rows that has a llama.cpp
counterpart token by token against it: --repeats rounds in which the two decode the same prompts
side by side, one step of ours, then one of llama.cpp's (the order swapped at every token and every
round), so both meet the memory in the same state. The second table gives each side's median ms a
step after the first token and the first token's, and their ratio.

Our rows (docs/sampling.md): the decoding step of inference/decode_step.py on products in each of
--precisions, as sample.py decodes on a CPU; the model's own step on the same float32 products (the
sampler before that step), on nn.Linear, compiled as sample.py --compile compiles it (on a CPU, for
one row, the decoding step over its weights streamed in each of --precisions, with no row where
sample.py would decode several rows eagerly; elsewhere the model's step on nn.Linear), and without
the cache (batch 1 only: re-encoding the context for every token grows with the square of the
length). On other devices, or with --dtype other than float32, the products stay the model's dtype
and the precisions other than float32 are left out. The "matrix products only" rows are a floor: the step's 49 weight
products and nothing else, --new-tokens times. Below the table, an estimate of the memory bound at
batch 1: the bytes of all weights over the read bandwidth of a sum over a 1 GiB buffer. --json PATH
also writes the rows and the estimate as JSON, rewritten after each batch size (`complete` false
until the end).
"""

import argparse
import copy
import ctypes
import importlib.util
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments, write_json  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from inference.decode_step import STREAMED, prepare_decoding  # noqa: E402
from inference.packed_linear import PRECISIONS, InferenceLinear, packing_unavailable  # noqa: E402
from interop.families import config_from_hf, state_dict_from_hf  # noqa: E402
from model import GPT  # noqa: E402
from model.generate import generate  # noqa: E402
from trainer.runtime import DTYPES  # noqa: E402

N_POSITIONS = 1024  # GPT-2's context: transformers' model has no positions past it
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0")
COUNTERPARTS = {"float32": "F32", "float16": "F16", "bfloat16": "F16", "int8": "Q8_0"}  # the llama.cpp row to beat


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--small", action="store_true", help="2 layers, 128 dims, 32 new tokens: a quick check")
    parser.add_count("--new-tokens", help="tokens to generate per row (default: 128, --small: 32)")
    parser.add_count("--prompt-len", default=16, help="prompt tokens per row (default: 16)")
    parser.add_count("--batch-sizes", nargs="+", default=[1, 4, 8, 16], help="(default: 1 4 8 16)")
    parser.add_count("--threads", default=torch.get_num_threads(), help="torch's (and llama.cpp's) threads")
    parser.add_count("--repeats", default=3, help="timed rounds over every row (default: 3)")
    parser.add_device()
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="both models' dtype (default: float32)")
    parser.add_argument(
        "--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS, help="our products' precisions"
    )
    parser.add_argument(
        "--gguf-types",
        nargs="*",
        default=list(GGUF_TYPES),
        choices=GGUF_TYPES,
        help="llama.cpp's rows, where llama_cpp is importable (none: no llama.cpp rows)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    parser.add_argument(
        "--alternate",
        action="store_true",
        help="also time our rows and their llama.cpp counterparts token by token, alternating (second table)",
    )
    parser.add_argument(
        "--step-rows-only",
        action="store_true",
        help="of ours, only the decoding step's rows, eager and (without --no-compile) compiled: no model's step, "
        "nn.Linear, no-cache or products-only rows; the comparison with llama.cpp and transformers in a few minutes",
    )
    parser.add_json_output("--json", ("new_tokens", "rows"), help="also write the rows to this JSON file")
    args = parser.parse_args()
    args.new_tokens = args.new_tokens or (32 if args.small else 128)
    if args.prompt_len + args.new_tokens > N_POSITIONS:
        raise UserError(
            f"--prompt-len={args.prompt_len} and --new-tokens={args.new_tokens} make "
            f"{args.prompt_len + args.new_tokens} positions, more than the {N_POSITIONS} that transformers' GPT-2 has"
        )
    return args


@dataclass
class Row:
    """One way of decoding a batch: run(first_token) gives its tokens, (B, new_tokens) as lists, or None
    (products only), and calls first_token() once the first new token of every row is on the host (a
    row that cannot tell does not call it)."""

    implementation: str
    products: str
    run: object
    counterpart: str | None = None  # the llama.cpp type this row is compared with
    tokens: list | None = None
    first_seconds: float = 0.0
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    first_token_seconds: list[float] = field(default_factory=list)  # each round's wait for its first new token
    steps: object = None  # steps() -> an iterator over the new tokens, a step each (the first: the prompt's too)


def build_models(small: bool, device: torch.device, dtype: torch.dtype) -> tuple[GPT, torch.nn.Module]:
    """transformers' model and ours with the same weights."""
    import transformers

    shape = dict(n_layer=2, n_head=2, n_embd=128) if small else dict(n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_positions=N_POSITIONS, vocab_size=50257, **shape)
    reference = transformers.GPT2LMHeadModel(hf_config).eval().to(device=device, dtype=dtype)
    family, config = config_from_hf(hf_config.to_dict(), "the benchmark's GPT2Config")
    ours = GPT(config)
    ours.load_state_dict(state_dict_from_hf(reference.state_dict(), config, family, "the benchmark's model"))
    return ours.eval().to(device=device, dtype=dtype), reference


def our_models(ours: GPT, device: torch.device, precisions: list[str], batch_size: int) -> dict:
    """Our models, each prepared as sample.py prepares it, float32 first (the reference of the others):
    precision -> (model, decoding step, products)."""
    models = {}
    reduced = ours.transformer.wte.weight.dtype == torch.float32 and device.type == "cpu"
    for precision in ["float32", *[p for p in precisions if p != "float32"]] if reduced else []:
        model = copy.deepcopy(ours)
        decoding = prepare_decoding(model, device, precision, batch_size)
        models[precision] = (model, decoding.step, precision)
    if not models:  # another device or dtype: the products in the model's dtype, as sample.py has them there
        model = copy.deepcopy(ours)
        decoding = prepare_decoding(model, device, "auto", batch_size)
        models["float32"] = (model, decoding.step, str(ours.transformer.wte.weight.dtype).removeprefix("torch."))
    return models


def rows_for(ours: GPT, reference, llama: dict, prompt: torch.Tensor, args: argparse.Namespace) -> list[Row]:
    """Every row for one batch of prompts."""
    new_tokens, device, batch = args.new_tokens, prompt.device, prompt.size(0)

    def ours_steps(model: GPT, step=None, use_cache: bool = True, compile: bool = False):
        options = dict(temperature=0, use_cache=use_cache, compile=compile, step=step)
        return lambda: generate(model, prompt, new_tokens, **options)

    def ours_run(model: GPT, step=None, use_cache: bool = True, compile: bool = False):
        def run(first_token):
            steps = ours_steps(model, step, use_cache, compile)()
            tokens = [next(steps)]  # on the host: a step's one wait for the device
            first_token()
            return torch.stack(tokens + list(steps), dim=1).tolist()

        return run

    def reference_run(first_token):
        with torch.no_grad():
            out = reference.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
                streamer=FirstToken(first_token),
            )  # fmt: skip
        return out[:, prompt.size(1) :].tolist()

    rows = [Row("transformers generate", "transformers", reference_run)]
    models = our_models(ours, device, args.precisions, batch)
    for precision, (model, step, products) in models.items():
        name = "ours, decoding step" if step is not None else "ours, model's step"
        counterpart = COUNTERPARTS.get(precision)
        rows.append(Row(name, products, ours_run(model, step), counterpart, steps=ours_steps(model, step)))
    # sample.py --compile: on a CPU the compiled decoding step in each precision, elsewhere the model's step
    for precision in models if not args.no_compile else ():
        compiled = copy.deepcopy(ours)
        chosen = "auto" if precision == "float32" else precision  # auto: the model's dtype, on every device
        decoding = prepare_decoding(compiled, device, chosen, batch, compile=True)
        if decoding.description == STREAMED.get(precision):
            run, steps = ours_run(compiled, decoding.step), ours_steps(compiled, decoding.step)
            products = f"{precision} streamed"
            rows.append(Row("ours, compiled decoding step", products, run, COUNTERPARTS[precision], steps=steps))
        elif decoding.step is None and precision == "float32" and not args.step_rows_only:
            rows.append(Row("ours, compiled step", "nn.Linear", ours_run(ours, compile=True)))
    if args.step_rows_only:
        return [*rows, *llama_rows(llama, prompt, new_tokens)]
    packed = None if packing_unavailable(device, ours.transformer.wte.weight.dtype) else models["float32"][0]
    if packed is not None:
        rows.append(Row("ours, model's step", "packed", ours_run(packed)))
    rows.append(Row("ours, model's step", "nn.Linear", ours_run(ours)))
    if batch == 1:
        rows.append(
            Row(
                "ours, no cache",
                "packed" if packed is not None else "nn.Linear",
                ours_run(packed or ours, use_cache=False),
            )
        )
    if packed is not None:
        rows.append(Row("matrix products only (floor)", "packed", products_only(packed, batch, new_tokens)))
    rows.append(Row("matrix products only (floor)", "nn.Linear", products_only(ours, batch, new_tokens)))
    return [*rows, *llama_rows(llama, prompt, new_tokens)]


def llama_rows(llama: dict, prompt: torch.Tensor, new_tokens: int) -> list[Row]:
    """llama.cpp's rows, one for each GGUF type loaded."""
    return [
        Row(
            "llama.cpp",
            file_type,
            lambda first_token, greedy=greedy: greedy.generate(prompt.tolist(), new_tokens, first_token),
            steps=lambda greedy=greedy: greedy.steps(prompt.tolist(), new_tokens),
        )
        for file_type, greedy in llama.items()
    ]


def products_only(model: GPT, batch: int, new_tokens: int):
    """The step's weight products and nothing else, new_tokens times, on random inputs of batch rows."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, InferenceLinear))]
    weight = model.transformer.wte.weight
    widths = {layer.in_features for layer in layers}
    inputs = {n: torch.randn(batch, 1, n, device=weight.device, dtype=weight.dtype) for n in widths}

    def run(first_token):
        with torch.no_grad():
            for _ in range(new_tokens):
                for layer in layers:
                    layer(inputs[layer.in_features])

    return run


class LlamaGreedy:
    """llama.cpp's greedy decoding of a batch through its C API: the prompts in one llama_decode, then one
    llama_decode per step for all rows (one sequence each) and the argmax of each row's logits, so
    Python adds a few calls a step, as our sampler's loop does."""

    def __init__(self, path: Path, threads: int, batch_size: int, width: int):
        import llama_cpp

        self.lc = llama_cpp
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = batch_size * width  # each sequence gets n_ctx / n_seq_max positions
        params.n_batch = params.n_ubatch = max(batch_size * width, 512)
        params.n_seq_max = batch_size
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, batch_size)

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """tokens: (token, position, sequence, whether its logits are wanted)."""
        for i, (token, position, sequence, logits) in enumerate(tokens):
            self.batch.token[i], self.batch.pos[i], self.batch.logits[i] = token, position, logits
            self.batch.n_seq_id[i], self.batch.seq_id[i][0] = 1, sequence
        self.batch.n_tokens = len(tokens)
        if self.lc.llama_decode(self.context, self.batch) != 0:
            raise RuntimeError("llama_decode failed")

    def generate(self, prompts: list[list[int]], new_tokens: int, first_token=lambda: None) -> list[list[int]]:
        steps = self.steps(prompts, new_tokens)
        tokens = [next(steps)]
        first_token()
        return [list(row) for row in zip(*tokens, *steps, strict=True)]

    def steps(self, prompts: list[list[int]], new_tokens: int):
        """Yield each step's tokens, one per row: the first after the prompts' decode, then one decode each."""
        import numpy as np

        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.context), True)
        self.decode([(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)])
        width = len(prompts[0])
        for step in range(new_tokens):
            logits = np.ctypeslib.as_array(self.lc.llama_get_logits(self.context), (len(prompts), self.vocab_size))
            tokens = logits.argmax(axis=1).tolist()
            yield tokens
            if step < new_tokens - 1:
                self.decode([(token, width + step, s, True) for s, token in enumerate(tokens)])

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.context)
        self.lc.llama_model_free(self.model)


def llama_runs(ours: GPT, folder: Path, args: argparse.Namespace, batch_size: int) -> dict:
    """A LlamaGreedy per --gguf-types type for batch_size rows; none where llama_cpp is not installed."""
    if not args.gguf_types or importlib.util.find_spec("llama_cpp") is None:
        return {}
    import llama_cpp

    from data.tokenizer import GPT2Tokenizer
    from interop.gguf import export_gguf

    quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    llama_runs.quiet = quiet  # the callback must outlive this call
    runs = {}
    for file_type in args.gguf_types:
        path = folder / f"model-{file_type}.gguf"
        if not path.exists():
            export_gguf(copy.deepcopy(ours).cpu().float(), GPT2Tokenizer(), path, file_type, Path("bench/decode.py"))
        runs[file_type] = LlamaGreedy(path, args.threads, batch_size, args.prompt_len + args.new_tokens + 1)
    return runs


def time_rows(rows: list[Row], device: torch.device, repeats: int, round_done=lambda: None) -> None:
    """Each row once untimed, then `repeats` rounds over all of them, every other round in reverse;
    round_done() after each round (a run stopped midway keeps the rounds it finished)."""
    for row in rows:
        row.first_seconds, row.tokens = timed(row.run, device)[:2]
        print(f"  {row.implementation}, {row.products}: first call {row.first_seconds:.2f} s", file=sys.stderr)
    for round_ in range(repeats):
        for row in rows if round_ % 2 == 0 else reversed(rows):
            seconds, _, cpu_seconds, first_token_seconds = timed(row.run, device)
            row.seconds.append(seconds)
            row.cpu_seconds.append(cpu_seconds)
            if first_token_seconds is not None:
                row.first_token_seconds.append(first_token_seconds)
        round_done()


def timed(run, device: torch.device) -> tuple[float, object, float, float | None]:
    """Wall seconds, the result and the process's CPU seconds of one call of run(first_token), and the
    wall seconds to its first new token (None if run did not call first_token)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = []
    start, cpu_start = time.perf_counter(), time.process_time()
    result = run(lambda: first.append(time.perf_counter()) if not first else None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, result, time.process_time() - cpu_start, first[0] - start if first else None


class FirstToken:
    """A streamer for transformers' generate that calls mark() when the first new tokens come (its
    first call is the prompt's)."""

    def __init__(self, mark):
        self.mark, self.calls = mark, 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.mark()

    def end(self) -> None:
        pass


def read_bandwidth(device: torch.device, small: bool) -> float:
    """Bytes per second that a sum over a 1 GiB buffer (64 MiB with --small) reads (fastest of 5)."""
    buffer = torch.ones(2**24 if small else 2**28, device=device)

    def read(first_token):
        return buffer.sum()

    timed(read, device)
    return buffer.numel() * buffer.element_size() / min(timed(read, device)[0] for _ in range(5))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = args.device, DTYPES[args.dtype]
    ours, reference = build_models(args.small, device, dtype)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads, device {device}; model {ours.num_params() / 1e6:.0f}M parameters ({args.dtype}), "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    table, alternated = [], []
    with tempfile.TemporaryDirectory() as folder:
        for batch_size in args.batch_sizes:
            prompt = torch.randint(0, 50257, (batch_size, args.prompt_len), generator=torch.Generator().manual_seed(1))
            llama = llama_runs(ours, Path(folder), args, batch_size)
            rows = rows_for(ours, reference, llama, prompt.to(device), args)
            print(f"batch {batch_size}:", file=sys.stderr)

            def save(timed_so_far=table + [(batch_size, row) for row in rows]) -> None:
                """The rows timed so far, for a run stopped at a deadline (bench/gpu.py's parts)."""
                if args.json:
                    rows_json = json_rows(timed_so_far, args.new_tokens)
                    write_json(args.json, dict(new_tokens=args.new_tokens, rows=rows_json, complete=False))

            time_rows(rows, device, args.repeats, round_done=save)
            if args.alternate:
                alternated += [(batch_size, *pair) for pair in alternate(rows, args.repeats)]
            for greedy in llama.values():
                greedy.close()
            table += [(batch_size, row) for row in rows]
    print_table(table, args.new_tokens)
    if alternated:
        print_alternated(alternated)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    tables = sum(p.nbytes for p in ours.transformer.wpe.parameters())  # the position table
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters()) - tables
    bandwidth = read_bandwidth(device, args.small)
    bound_ms = 1000 * weight_bytes / bandwidth
    print(
        f"\nMemory bound at batch 1 (estimate): {weight_bytes / 1e6:.0f} MB of {args.dtype} weights per step at the "
        f"{bandwidth / 1e9:.1f} GB/s that a sum reads = {bound_ms:.1f} ms/token, {1000 / bound_ms:.1f} tokens/s."
    )
    if args.json:
        estimate = dict(weight_bytes=weight_bytes, read_bytes_per_sec=bandwidth, bound_tokens_per_sec=1000 / bound_ms)
        rows_json = json_rows(table, args.new_tokens)
        write_json(args.json, dict(new_tokens=args.new_tokens, rows=rows_json, complete=True) | estimate)


def alternate(rows: list[Row], repeats: int) -> list[tuple[Row, Row, dict]]:
    """Each of our rows with a llama.cpp counterpart among rows, timed step by step against it: `repeats`
    rounds in which the two decode side by side, a step of one then a step of the other, the order
    swapped at every step and every round. Returns (ours, theirs, seconds) with seconds' "first" (the
    first steps, the prompt's included) and "after" (every later step) for "ours" and "theirs"."""
    pairs = []
    for row in rows:
        theirs = next((r for r in rows if r.implementation == "llama.cpp" and r.products == row.counterpart), None)
        if row.steps is None or theirs is None or row is theirs:
            continue
        seconds = {(side, part): [] for side in ("ours", "theirs") for part in ("first", "after")}
        for round_ in range(repeats):
            steps = {"ours": row.steps(), "theirs": theirs.steps()}
            for index in itertools.count():
                order = ("ours", "theirs") if (index + round_) % 2 == 0 else ("theirs", "ours")
                try:
                    for side in order:
                        start = time.perf_counter()
                        next(steps[side])
                        seconds[side, "first" if index == 0 else "after"].append(time.perf_counter() - start)
                except StopIteration:
                    break
        pairs.append((row, theirs, seconds))
        print(f"  {row.implementation}, {row.products}: alternated with llama.cpp {theirs.products}", file=sys.stderr)
    return pairs


def print_alternated(alternated: list[tuple[int, Row, Row, dict]]) -> None:
    print("\nToken by token, alternating with llama.cpp (medians over every round's steps):\n")
    columns = ["ours", "batch", "llama.cpp", "ms a step after the first, ours", "llama.cpp's", "ours vs llama.cpp"]
    columns += ["first token ms, ours", "llama.cpp's"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for batch, row, theirs, seconds in alternated:
        ms = {key: 1000 * statistics.median(values) for key, values in seconds.items()}
        print(
            f"| {row.implementation}, {row.products} | {batch} | {theirs.products} | {ms['ours', 'after']:.2f} | "
            f"{ms['theirs', 'after']:.2f} | {ms['theirs', 'after'] / ms['ours', 'after']:.2f}x | "
            f"{ms['ours', 'first']:.1f} | {ms['theirs', 'first']:.1f} |"
        )


def tokens_per_sec(batch: int, new_tokens: int, seconds: list[float]) -> list[float]:
    return [batch * new_tokens / s for s in seconds]


def json_rows(table: list[tuple[int, Row]], new_tokens: int) -> list[dict]:
    return [
        dict(
            implementation=row.implementation,
            products=row.products,
            batch=batch,
            seconds=row.seconds,
            cpu_seconds=row.cpu_seconds,
            first_call_seconds=row.first_seconds,
            tokens_per_sec=statistics.median(tokens_per_sec(batch, new_tokens, row.seconds)),
            first_token_seconds=row.first_token_seconds,
            tokens_per_sec_after_first=after_first(row, batch, new_tokens),
        )  # fmt: skip
        for batch, row in table
    ]


def after_first(row: Row, batch: int, new_tokens: int) -> float | None:
    """The median over rounds of the tokens after the first over their seconds (None: not timed apart)."""
    if len(row.first_token_seconds) != len(row.seconds) or not row.seconds or new_tokens < 2:
        return None
    pairs = zip(row.seconds, row.first_token_seconds, strict=True)
    return statistics.median(batch * (new_tokens - 1) / (whole - first) for whole, first in pairs)


def same_tokens(row: Row, reference: Row | None) -> str:
    """Whether the row's tokens equal the reference's, or the share that does."""
    if row.tokens is None or reference is None or reference.tokens is None:
        return "-"
    if row.tokens == reference.tokens:
        return "yes"
    rows = zip(row.tokens, reference.tokens, strict=True)
    pairs = [(a, b) for ours, theirs in rows for a, b in zip(ours, theirs, strict=True)]
    return f"no ({sum(a == b for a, b in pairs) / len(pairs):.0%})"


def ratio(speed: float, other: Row, batch: int, new_tokens: int) -> str:
    """speed (tokens/s) over the other row's median, as the table writes it."""
    return f"{speed / statistics.median(tokens_per_sec(batch, new_tokens, other.seconds)):.2f}x"


def print_table(table: list[tuple[int, Row]], new_tokens: int) -> None:
    columns = ["implementation", "batch", "products", "tokens/s median [min..max]", "ms/step", "CPU ms/step"]
    columns += ["vs transformers", "vs llama.cpp", "first token ms", "tokens/s after the first"]
    columns += ["after the first vs llama.cpp"]
    columns += ["same tokens as ours float32"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for batch, row in table:
        mates = [r for b, r in table if b == batch]
        speed = statistics.median(tokens_per_sec(batch, new_tokens, row.seconds))
        transformers = next(r for r in mates if r.implementation == "transformers generate")
        llama = next((r for r in mates if r.implementation == "llama.cpp" and r.products == row.counterpart), None)
        reference = next(
            (r for r in mates if r.implementation == "ours, decoding step" and r.products == "float32"), None
        )
        spread = tokens_per_sec(batch, new_tokens, row.seconds)
        first = f"{1000 * statistics.median(row.first_token_seconds):.1f}" if row.first_token_seconds else "-"
        after, llama_after = after_first(row, batch, new_tokens), llama and after_first(llama, batch, new_tokens)
        print(
            f"| {row.implementation} | {batch} | {row.products} | {speed:.1f} [{min(spread):.1f}..{max(spread):.1f}] | "
            f"{1000 * statistics.median(row.seconds) / new_tokens:.1f} | "
            f"{1000 * statistics.median(row.cpu_seconds) / new_tokens:.1f} | "
            f"{ratio(speed, transformers, batch, new_tokens)} | "
            f"{ratio(speed, llama, batch, new_tokens) if llama else '-'} | {first} | "
            f"{f'{after:.1f}' if after else '-'} | {f'{after / llama_after:.2f}x' if after and llama_after else '-'} | "
            f"{same_tokens(row, reference)} |"
        )
    cached = {b: r for b, r in table if r.implementation == "ours, model's step" and r.products != "nn.Linear"}
    for batch, row in table:
        if row.implementation == "ours, no cache" and batch in cached:
            speedup = statistics.median(row.seconds) / statistics.median(cached[batch].seconds)
            print(f"\nWith the KV cache ({row.products}, batch {batch}): {speedup:.1f}x the tokens/s without it.")


if __name__ == "__main__":
    run_cli(main)
