"""Score a model on multiple-choice, cloze, generation and perplexity tasks.

    python eval.py --out-dir out/shakespeare_gpt2 --tasks hellaswag,arc_easy,piqa,lambada
    python eval.py --init-from models/gpt2 --tasks my_items.jsonl --json out.json --device cpu
    python eval.py --checkpoint out/run/ckpt.pt --tasks hellaswag=hellaswag_val.jsonl,notes.txt

--tasks takes built-in names (hellaswag, arc_easy, arc_challenge, piqa, lambada, gsm8k: read from
the Hugging Face hub through `datasets`, prepared as lm-evaluation-harness prepares them), NAME=FILE
(a built-in task from a local JSON-lines copy of the hub's records, for a machine offline), or
local files: a .jsonl of {"ctx": ..., "endings": [...], "label": i} (multiple choice),
{"text": ...} (cloze: the last word), {"prompt": ..., "answer": ...} or {"messages": [...],
"answer": ...} (generation), or any other file as text (perplexity and bits per byte).
An entry that is an existing file is that file, even with `=` in its name.

Each ending is scored by its summed log-likelihood after the context and one space: acc picks the
highest, acc_norm the highest per character of the ending. Cloze: acc is the share of last words
that greedy decoding gets exactly, ppl their perplexity. Generation: acc is the share of greedy
replies (ended by the end-of-text token, a newline after a plain prompt, or --max-new-tokens) equal
to the answer once both are stripped and their runs of whitespace made one space; gsm8k compares
the final numbers as the harness does (acc: its strict-match, acc_flexible: its flexible-extract).
Text: ppl per token, bpb bits per UTF-8 byte. Each accuracy is also given centred,
(acc - chance) / (1 - chance), and the last line is their mean over the tasks. --json writes the
figures only once every task is scored; a perplexity past the largest float prints as inf and is
null there. --json replaces only an earlier results file of eval.py, never another
file (checked before the model is loaded).
"""

import argparse
import json
import sys
from pathlib import Path

from data.files import check_output_file, is_json_object_with, write_output
from errors import ArgumentParser, UserError, run_cli
from evals.evaluate import evaluate_task, load_tasks, results_json, summary_lines
from inference.decode_step import PRECISION_CHOICES, check_precision, prepare_decoding
from inference.load import load_model
from trainer.checkpoint import CHECKPOINT_NAME
from trainer.config import task_specs
from trainer.runtime import DTYPES, resolve_device, resolve_dtype


def parse_args() -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_source = parser.add_mutually_exclusive_group()
    model_source.add_argument(
        "--out-dir", help="run directory holding ckpt.pt (default: the most recent run under out/)"
    )
    model_source.add_argument("--checkpoint", help="a checkpoint file written by train.py")
    model_source.add_argument(
        "--init-from", help="a Hugging Face model directory or a GGUF file (as sample.py --init-from)"
    )
    parser.add_argument(
        "--tasks", required=True, nargs="+", help="tasks, comma- or space-separated: NAME, NAME=FILE or FILE"
    )
    parser.add_argument("--limit", type=int, help="score the first N items of each task (text: N windows)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="endings (text windows, generation prompts) in one forward pass (default: 32)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help="generation tasks: the longest reply in tokens (default: 64 for a local file, 256 for gsm8k)",
    )
    parser.add_argument(
        "--json", metavar="OUT.json", help="write the figures to this file (new, or an earlier results file of eval.py)"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default: auto)")
    dtype_help = "the model is cast to this (default: float32; auto: bfloat16 or float16 on a GPU)"
    parser.add_argument("--dtype", default="float32", choices=("auto", *DTYPES), help=dtype_help)
    parser.add_argument(
        "--precision",
        default="auto",
        choices=PRECISION_CHOICES,
        help="on an x86-64 CPU, the linear layers' weights in float32, float16, bfloat16 or int8, for every task, "
        "as sample.py's --precision (auto: the model's dtype; docs/sampling.md)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    args.tasks = task_specs(args.tasks)
    if not args.tasks:
        raise UserError("--tasks names no task (give NAME, NAME=FILE or FILE, comma- or space-separated)")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit={args.limit} is not allowed (use 1 or more)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens={args.max_new_tokens} is not allowed (use 1 or more)")
    if args.batch_size < 1:
        raise UserError(f"--batch-size={args.batch_size} is not allowed (use 1 or more)")
    return args


def check_json_output(args: argparse.Namespace) -> None:
    """--json may replace only an earlier results file of eval.py, never a file this command reads
    (a task file, the checkpoint) or any other (data/files.py's rule for every output)."""
    named = [part for spec in args.tasks for part in (spec, spec.partition("=")[2]) if part]  # FILE, NAME=FILE
    checkpoint = args.checkpoint or (args.out_dir and Path(args.out_dir) / CHECKPOINT_NAME)
    inputs = [Path(name) for name in [*named, checkpoint] if name and Path(name).is_file()]
    check_output_file(
        Path(args.json),
        "--json",
        lambda path: is_json_object_with(path, results_json([])),
        "a results file of eval.py",
        inputs,
    )


def main() -> None:
    args = parse_args()
    if args.json is not None:
        check_json_output(args)
    device = resolve_device(args.device, key="--device")
    dtype = resolve_dtype(args.dtype, device, key="--dtype")
    check_precision(args.precision, device, dtype)  # before a model, perhaps a large download, is loaded
    model, tokenizer, source = load_model(args.out_dir, args.checkpoint, args.init_from)
    tasks = load_tasks(args.tasks, args.limit, tokenizer, model.config.block_size, args.max_new_tokens)
    model.to(device=device, dtype=dtype)
    decoding = prepare_decoding(model, device, args.precision, args.batch_size)
    print(f"evaluating {source} on {device.type}, {decoding.description}", file=sys.stderr)
    results = [
        evaluate_task(model, tokenizer, task, args.batch_size, not args.no_progress, args.limit, step=decoding.step)
        for task in tasks
    ]
    print("\n".join(summary_lines(results)))
    if args.json is not None:
        figures = json.dumps(results_json(results), indent=2, allow_nan=False) + "\n"
        write_output(Path(args.json), figures.encode("utf-8"))


if __name__ == "__main__":
    run_cli(main)
