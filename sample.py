"""Generate text from a trained model or a Hugging Face model folder, or export a model to one.

    python sample.py --prompt "ROMEO:"
    python sample.py --out-dir out/shakespeare_char --num-samples 3 --temperature 0.7
    python sample.py --init-from models/gpt2 --prompt-file prompts.txt --stop "\n\n"
    python sample.py --init-from HuggingFaceTB/SmolLM2-135M --prompt "The"   # a hub id, through the cache
    python sample.py --init-from SmolLM2-135M-Instruct.Q4_1.gguf --chat   # a GGUF file of llama.cpp
    python sample.py --out-dir out/shakespeare_char --export exported/   # for transformers
    python sample.py --out-dir out/shakespeare_char --export-gguf shakespeare.gguf   # for llama.cpp

The first line on stderr says what was loaded: for a run, its checkpoint, whether it was picked as
the newest, its step of train.max_iters (interrupted if it stopped before them) and its last val
loss.

--export writes the folder of the Hugging Face family that computes the model (GPT-2, Llama, Qwen3,
StableLM or Mistral: docs/models.md), with its tokenizer as tokenizer.json; a model no family
computes is refused, naming the switch. The folder must be new, or hold none of the files the
export writes and no other model: nothing in it is replaced.
--export-gguf writes one GGUF file of the llama.cpp architecture that computes the model (gpt2,
llama, qwen3 or stablelm), with its tokenizer and chat template (docs/shipping.md); --gguf-type Q8_0
or Q4_0 writes its matrices quantized.

The prompt is encoded in one forward pass, then each new token costs one step over the KV cache.
On an x86-64 CPU the linear layers are first packed for oneDNN, which makes the steps 2 to 3 times
faster in float32, and each step runs the model's arithmetic in fewer operations
(inference/decode_step.py); the start-up line says which products and which step are used. There,
--compile compiles that step over the weights unpacked (in --precision), whose loops read them faster
still at one row, after some seconds of compiling (docs/sampling.md). --precision stores the linear
layers' weights in fewer bytes, which read faster: float16 (about half float32's time a token,
greedy text mostly unchanged), bfloat16 or int8, while the rest of the model stays in --dtype
(docs/sampling.md says what each costs).
The model sees at most block_size tokens: once a sample grows past that, the context slides, the
last block_size // 2 tokens are encoded afresh and generation goes on, so each new token sees
between block_size // 2 and block_size tokens. A prompt longer than block_size is an error.

All samples (every prompt, --num-samples times) are drawn in batches of --batch-size rows, left
padded to a common length; each row is generated exactly as it would be alone: sample number i
(counting from 0 over the whole run) draws from its own generator seeded with --seed + i, so it
equals the first sample of a run with --seed SEED+i and that prompt alone. A lone sample is
streamed token by token; a batch is written when it is done. A sample ends at <|endoftext|> (GPT-2
BPE models) or just before the first --stop string.

Options may also be spelled with underscores, as config keys are (--max_new_tokens); an unknown one
is named with the nearest known one.

A model trained with an attention pattern samples with it (docs/patterns.md): a
prefix-LM model reads the prompt as its prefix, in both directions; a sliding-window model keeps a
rolling cache of its window; a block-causal model draws each block from the complete block before
it, so its prompt needs at least model.attn_block tokens, and --compile does not apply to it; a
document-masked model reads the prompt's last document only, from its last <|endoftext|>, which
with model.attn_document_positions is position 0. --export refuses every pattern but a sliding
window (Mistral).
"""

import argparse
import functools
import sys
from pathlib import Path

import torch

from data.files import read_text
from data.tokenizer import StreamDecoder, Tokenizer
from errors import ArgumentParser, UserError, run_cli, text_argument
from inference.decode_step import DecodeStep, Decoding, check_precision, prepare_decoding
from inference.load import RUNS_ROOT, add_model_arguments, check_prompt, latest_run, load_model
from model import GPT, generate, left_pad
from trainer.config import MAX_THREADS
from trainer.runtime import check_fits_in_memory, resolve_device, resolve_dtype, set_threads

MAX_SAMPLES = 1_000_000  # samples in one run (prompts x --num-samples); a larger job is several runs
SEEDS = 2**64  # a torch generator takes seeds 0 .. 2**64 - 1
MAX_TEMPERATURE = 100.0  # logits divided by more than this are all within a few hundredths: uniform noise


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--prompt",
        type=text_argument,
        help="text to continue; empty or left out: the start of a document, the tokenizer's end-of-text token "
        "(<|endoftext|> for GPT-2 BPE) or a newline where it has none (with --chat: the one message to answer)",
    )
    source.add_argument("--prompt-file", help="read prompts from this UTF-8 file, one per line (blank lines skipped)")
    add_model_arguments(parser)
    parser.add_argument(
        "--export",
        metavar="DIR",
        help="write the model to DIR as a Hugging Face folder (config.json, model.safetensors, tokenizer.json) "
        "that transformers' AutoModelForCausalLM and AutoTokenizer load, and sample nothing",
    )
    parser.add_argument(
        "--export-adapter",
        metavar="DIR",
        help="write the LoRA adapters of the run to DIR as a PEFT folder (adapter_config.json, "
        "adapter_model.safetensors) for its Hugging Face base model, and sample nothing; DIR is new or holds no "
        "model or adapter (docs/finetuning.md)",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="talk to a model fine-tuned on conversations, turn by turn, through its chat template (docs/chat.md); "
        "with --prompt, answer that one message and exit",
    )
    parser.add_argument(
        "--system", metavar="TEXT", type=text_argument, help="--chat: the system message that opens the conversation"
    )
    parser.add_argument(
        "--export-gguf",
        metavar="FILE.gguf",
        help="write the model and its tokenizer to FILE.gguf for llama.cpp, Ollama or LM Studio (matrices in "
        "--dtype: float32 for auto, float16 or bfloat16, or --gguf-type), and sample nothing; docs/shipping.md",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help=f"samples to draw per prompt, at most {MAX_SAMPLES:,} in all (default: 1)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="samples generated together (default: 8)")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        type=text_argument,
        help="end a sample just before this text, which may not be empty; repeat for several (escapes such as \\n "
        "are read)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=500, help="tokens to generate per sample (default: 500)")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help=f"below 1 sharpens, above 1 flattens; 0 is greedy; at most {MAX_TEMPERATURE:g} (default: 0.8)",
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
    parser.add_argument(
        "--seed", type=int, default=1337, help="random seed, 0 .. 2**64 - 1; sample i uses seed + i (default: 1337)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch's operators; 0: one per core that other work leaves free, as train.threads=0 "
        "(default: one per physical core)",
    )
    parser.add_argument(
        "--gguf-type",
        metavar="TYPE",
        help="--export-gguf: the type of the file's matrices, F32, F16, BF16, or Q8_0 or Q4_0 (quantized by the "
        "gguf package); default: --dtype's, F32 for auto (docs/shipping.md)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="re-encode the whole context at every step instead of using the KV cache (slow; shows what it saves)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the one-token step, with torch.compile and CUDA graphs on a GPU: a slow start, then faster "
        "tokens (on an x86-64 CPU, the decoding step's own loops over the weights in --precision, compiled ahead of "
        "time: fastest for one sample at a time)",
    )
    args = parser.parse_args()
    if "" in args.stop:
        raise UserError(
            "--stop='' is empty: a sample would end before its first character (give the text to end samples "
            "at, e.g. --stop '\\n\\n', or leave --stop out)"
        )
    args.stop = [unescape(stop) for stop in args.stop]
    if args.gguf_type is not None and args.export_gguf is None:
        raise UserError(f"--gguf-type={args.gguf_type} applies to --export-gguf only (give --export-gguf FILE.gguf)")
    check_chat_options(args, parser)
    checks = [
        ("--num-samples", args.num_samples, args.num_samples >= 1, "1 or more"),
        ("--batch-size", args.batch_size, args.batch_size >= 1, "1 or more"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "1 or more"),
        (
            "--temperature",
            args.temperature,
            0 <= args.temperature <= MAX_TEMPERATURE,
            f"0 (greedy) up to {MAX_TEMPERATURE:g}, beyond which every token is about as likely as any other",
        ),
        ("--top-k", args.top_k, args.top_k >= 0, "0 (off) or more"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
        ("--threads", args.threads, args.threads is None or 0 <= args.threads <= MAX_THREADS, f"0 up to {MAX_THREADS}"),
    ]
    for flag, value, ok, accepted in checks:
        if not ok:
            raise UserError(f"{flag}={value} is not allowed (use {accepted})")
    return args


def check_chat_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--chat holds one conversation, streamed: the options of batch sampling and export do not apply."""
    if args.system is not None and not args.chat:
        raise UserError("--system applies to --chat only (give --chat to talk to the model, or leave --system out)")
    if not args.chat:
        return
    for option in ("export", "prompt_file", "num_samples", "stop"):
        if getattr(args, option) != parser.get_default(option):
            flag = "--" + option.replace("_", "-")
            raise UserError(f"{flag} does not apply to --chat, which holds one conversation (leave {flag} out)")


def read_prompts(args: argparse.Namespace, default: str) -> list[str]:
    if args.prompt_file is None:
        return [args.prompt or default]
    try:
        lines = read_text(Path(args.prompt_file)).splitlines()
    except FileNotFoundError:
        raise UserError(f"--prompt-file={args.prompt_file!r} does not exist") from None
    except OSError as e:
        raise UserError(f"--prompt-file={args.prompt_file!r} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise UserError(
            f"--prompt-file={args.prompt_file!r} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file={args.prompt_file!r} holds no prompt (write one per line)")
    return prompts


def check_sample_counts(args: argparse.Namespace, samples: int, block_size: int, device: torch.device) -> None:
    """Refuse counts this run cannot honour before generating anything: more samples than one run
    draws, seeds past a generator's range (sample i is drawn with --seed + i), token ids that do
    not fit in memory."""
    if samples > MAX_SAMPLES:
        raise UserError(
            f"--num-samples={args.num_samples} asks for more than {MAX_SAMPLES:,} samples in one run "
            f"(draw them over several runs, each with its own --seed)"
        )
    if not 0 <= args.seed <= SEEDS - samples:
        raise UserError(
            f"--seed={args.seed} is not allowed: sample i is drawn with seed + i, and a seed is 0 .. 2**64 - 1 "
            f"(use 0 .. {SEEDS - samples})"
        )
    batch = min(args.batch_size, samples)
    ids_bytes = batch * (block_size + args.max_new_tokens) * 8  # the int64 ids of a batch, prompt and sample
    check_fits_in_memory(
        ids_bytes,
        device,
        f"--max-new-tokens={args.max_new_tokens}: the token ids of {batch} sample(s)",
        "ask for fewer tokens, or a smaller --batch-size",
    )


def unescape(text: str) -> str:
    """Backslash escapes typed on the command line ("\\n", "\\t") become the characters; every other
    character, ASCII or not, stands for itself."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        raise UserError(
            f"--stop={text!r} ends in a lone backslash or holds an incomplete escape (escapes are \\n, \\t, "
            f"\\xHH, \\uXXXX and \\N{{name}}; write \\\\ for a backslash itself)"
        ) from None


def main() -> None:
    args = parse_args()
    if args.export_gguf is not None or args.export_adapter is not None or args.export is not None:
        return export(args)
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    check_precision(args.precision, device, dtype)  # before a model, perhaps a large download, is loaded
    if args.chat:  # the terminal chat's room (inference/chat.py): plain sampling never reads it
        from inference.chat import chat_in_terminal, check_messages

        check_messages(args.system, args.prompt)
    threads = None if args.threads is None else set_threads(args.threads, "--threads")
    model, tokenizer, source = load_model(args.out_dir, init_from=args.init_from)
    model.to(device=device, dtype=dtype)
    if args.chat:
        decoding = prepare(model, device, args, batch_size=1)
        return chat_in_terminal(model, tokenizer, args, source, describe(decoding, threads), decoding.step)

    prompts = read_prompts(
        args, default="\n" if tokenizer.eot_token is None else tokenizer.decode([tokenizer.eot_token])
    )
    block_size = model.config.block_size
    check_sample_counts(args, len(prompts) * args.num_samples, block_size, device)
    rows = []
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt)
        check_prompt(prompt, prompt_ids, model.config)
        rows += [(prompt, prompt_ids)] * args.num_samples
    decoding = prepare(model, device, args, batch_size=min(args.batch_size, len(rows)))
    print(f"sampling from {source} on {device.type}, {describe(decoding, threads)}", file=sys.stderr)
    for first in range(0, len(rows), args.batch_size):
        batch = rows[first : first + args.batch_size]
        generators = [torch.Generator(device=device).manual_seed(args.seed + first + i) for i in range(len(batch))]
        write_samples(model, tokenizer, batch, args, generators, separate=first > 0, step=decoding.step)


def prepare(model: GPT, device: torch.device, args: argparse.Namespace, batch_size: int) -> Decoding:
    """The model made ready to decode batch_size rows at a time as the options ask (inference/decode_step.py)."""
    return prepare_decoding(model, device, args.precision, batch_size, args.compile, use_cache=not args.no_cache)


def describe(decoding: Decoding, threads: str | None) -> str:
    """How decoding runs, and the threads --threads=0 chose, for the start-up line."""
    return decoding.description + ("" if threads is None else f"; {threads}")


def export(args: argparse.Namespace) -> None:
    """--export-gguf, --export-adapter or --export: write the model for another program, sample nothing.
    The writers are interop/'s: sampling never reads them (and needs no gguf package: a bare CUDA
    image has none)."""
    if args.export_gguf is not None:  # a file written on no device: --dtype is the type its weights are stored in
        from interop.gguf import write_gguf

        load = functools.partial(load_model, args.out_dir, init_from=args.init_from)  # after the path's checks
        write_gguf(Path(args.export_gguf), args.dtype, args.gguf_type, load, also=args.export)
        return
    resolve_dtype(args.dtype, resolve_device(args.device, key="--device"), key="--dtype")  # refused as when sampling
    if args.export_adapter is not None:
        from interop.peft import export_run_adapter

        source = args.init_from or args.out_dir or latest_run(RUNS_ROOT)
        print(export_run_adapter(source, Path(args.export_adapter)), file=sys.stderr)
        return
    from interop.pretrained import check_export_folder, export_model

    check_export_folder(Path(args.export))  # before a model, perhaps a large download, is loaded
    model, tokenizer, source = load_model(args.out_dir, init_from=args.init_from)
    family = export_model(model, tokenizer, Path(args.export))
    print(f"wrote {source} as a Hugging Face {family.architecture} to {args.export}", file=sys.stderr)


def write_samples(
    model: GPT,
    tokenizer: Tokenizer,
    rows: list[tuple[str, list[int]]],
    args: argparse.Namespace,
    generators: list[torch.Generator],
    separate: bool,
    step: DecodeStep | None = None,
) -> None:
    """Generate one sample per row and write each to stdout, after a separator line from the previous
    one; a lone row is streamed token by token. step: the one-token step (None: the model's forward)."""
    device = generators[0].device
    prompt_batch, pad = left_pad([prompt_ids for _, prompt_ids in rows], device)
    decoders = [StreamDecoder(tokenizer, tuple(args.stop)) for _ in rows]
    texts = [[prompt] for prompt, _ in rows]
    stream = len(rows) == 1
    if stream:
        _write(texts[0][0], separate)
    steps = generate(
        model,
        prompt_batch,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        stop_token=tokenizer.eot_token,
        vocab_size=tokenizer.vocab_size,
        generators=generators,
        use_cache=not args.no_cache,
        pad=pad,
        compile=args.compile and step is None,  # a decoding step (compiled or not) replaces generate's compiled model
        step=step,
    )
    done = [False] * len(rows)
    for tokens in steps:
        for row, token_id in enumerate(tokens.tolist()):
            if done[row]:
                continue
            decoder = decoders[row]
            text = "" if token_id == tokenizer.eot_token else decoder.feed(token_id)
            done[row] = token_id == tokenizer.eot_token or decoder.stopped
            texts[row].append(text)
            if stream:
                _write(text)
        if all(done):
            break
    for row, decoder in enumerate(decoders):
        texts[row].append(decoder.flush() + "\n")
        if stream:
            _write(texts[row][-1])
        else:
            _write("".join(texts[row]), separate=separate or row > 0)


def _write(text: str, separate: bool = False) -> None:
    if separate:
        sys.stdout.write("\n" + "-" * 40 + "\n")
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    run_cli(main)
