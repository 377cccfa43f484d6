"""Evaluation speed: eval.py's scoring against lm-evaluation-harness's `hf` model, same weights and items.

    python bench/eval.py            # GPT-2 124M shape, the shipped HellaSwag, ARC, PIQA files (the recorded table)
    python bench/eval.py --small    # 2 layers, 128 dims: checks the script in seconds

Weights are random (speed does not depend on their values): our model is built, exported to a
Hugging Face GPT-2 folder with tokenizer files, and the harness's `hf` model loads that folder. Both
score the same multiple-choice items: the shipped task files in tests/tasks/ (HellaSwag's, ARC's and
PIQA's record formats, 24 questions each, contexts of one line) and `passages`, HellaSwag-shaped
questions with four-line contexts, each repeated --repeat times, read through the harness's own
task definitions and through evals/tasks.py. Same torch thread count, float32, one process,
batch size --batch-size for both (the harness: requests per forward pass; ours: endings per forward
pass). For each item set the two sides take turns, --runs times each, and the table gives each
side's fastest run: the whole call, from items to accuracies (the harness's includes building its task
from the file; ours includes tokenizing). Both sides' acc are printed too: they must agree.
"""

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.arguments import BenchArguments  # noqa: E402
from data.tokenizer import GPT2Tokenizer  # noqa: E402
from errors import run_cli  # noqa: E402
from evals.evaluate import evaluate_task  # noqa: E402
from evals.tasks import Task, load_task  # noqa: E402
from interop.pretrained import export_model  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TASKS = Path(__file__).resolve().parent.parent / "tests" / "tasks"
SHAKESPEARE = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"
# our --tasks name -> (the harness's task definition, the shipped file)
TASK_FILES = {
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag.jsonl"),
    "arc_easy": ("arc/arc_easy.yaml", "arc.jsonl"),
    "piqa": ("piqa/piqa.yaml", "piqa.jsonl"),
}


def parse_args() -> argparse.Namespace:
    parser = BenchArguments(__doc__)
    parser.add_argument("--small", action="store_true", help="2 layers, 2 heads, 128 dims: a quick check")
    parser.add_count("--repeat", default=2, help="copies of each task file's items (default: 2)")
    parser.add_count("--batch-size", default=32, help="both sides' batch size (default: 32)")
    parser.add_count("--runs", default=1, help="timed runs per side and item set; the fastest counts (default: 1)")
    parser.add_count("--threads", default=torch.get_num_threads(), help="torch intra-op threads")
    return parser.parse_args()


def write_task_files(folder: Path, repeat: int) -> dict[str, tuple[str, str]]:
    """Each item set's file (its items repeated) and a harness task definition reading it; returns
    our --tasks entry and the harness's task name of each."""
    from evals.harness import local_task_yaml

    tasks = {}
    for name, (definition, file_name) in TASK_FILES.items():
        lines = (TASKS / file_name).read_text().splitlines()
        (folder / file_name).write_text("\n".join(lines * repeat) + "\n")
        (folder / f"bench_{name}.yaml").write_text(local_task_yaml(f"bench_{name}", folder / file_name, definition))
        tasks[name] = (f"{name}={folder / file_name}", f"bench_{name}")
    (folder / "passages.jsonl").write_text("\n".join(json.dumps(item) for item in passages(24 * repeat)) + "\n")
    (folder / "bench_passages.yaml").write_text(local_task_yaml("bench_passages", folder / "passages.jsonl"))
    tasks["passages"] = (str(folder / "passages.jsonl"), "bench_passages")
    return tasks


def passages(n_items: int) -> list[dict]:
    """HellaSwag-shaped questions: a context of four lines of the play (about 50 tokens, as long as
    HellaSwag's), and as endings the line that follows and three others."""
    lines = [line for line in SHAKESPEARE.read_text().splitlines() if line.strip()]
    rng = random.Random(0)
    items = []
    for _ in range(n_items):
        start = rng.randrange(len(lines) - 5)
        endings = [lines[start + 4]] + rng.sample(lines, 3)
        rng.shuffle(endings)
        items.append(
            {"ctx": " ".join(lines[start : start + 4]), "endings": endings, "label": endings.index(lines[start + 4])}
        )
    return items


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    shape = dict(n_layer=2, n_head=2, n_embd=128) if args.small else dict(n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    tokenizer = GPT2Tokenizer()
    model = GPT(GPTConfig(block_size=1024, vocab_size=tokenizer.vocab_size, **shape)).eval()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        export_model(model, tokenizer, folder / "model")
        item_sets = write_task_files(folder, args.repeat)
        tasks = [load_task(spec) for spec, _ in item_sets.values()]
        n_items = sum(len(task.items) for task in tasks)
        print(
            f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"lm-eval {lm_eval.__version__}, {args.threads} threads; model {model.num_params() / 1e6:.0f}M "
            f"parameters (float32); {n_items} questions, batch size {args.batch_size}",
            file=sys.stderr,
        )
        task_manager = TaskManager(include_path=str(folder), include_defaults=False)
        best = {}
        for task, (_, harness_name) in zip(tasks, item_sets.values(), strict=True):

            def harness(harness_name: str = harness_name) -> float:
                results = lm_eval.simple_evaluate(
                    model="hf",
                    model_args=f"pretrained={folder / 'model'},dtype=float32",
                    tasks=[harness_name],
                    task_manager=task_manager,
                    device="cpu",
                    batch_size=args.batch_size,
                    verbosity="ERROR",
                )["results"]
                return results[harness_name]["acc,none"]

            def ours(task: Task = task) -> float:
                return evaluate_task(model, tokenizer, task, args.batch_size).metrics["acc"]

            # the two sides take turns, so that a machine whose load changes slows both alike
            for _ in range(args.runs):
                for scorer, score in (("lm-evaluation-harness hf", harness), ("eval.py", ours)):
                    start = time.perf_counter()
                    acc = score()
                    seconds = time.perf_counter() - start
                    fastest = min(seconds, best.get((task.name, scorer), (float("inf"),))[0])
                    best[task.name, scorer] = (fastest, acc, len(task.items))
                    print(f"  {task.name}, {scorer}: {seconds:.2f} s, acc {acc:.4f}", file=sys.stderr)
    print(
        "| items | questions | harness hf, s | eval.py, s | harness hf, questions/s | eval.py, questions/s | ratio "
        "| acc (both) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    totals = {"lm-evaluation-harness hf": 0.0, "eval.py": 0.0}
    for task in tasks:
        (reference, reference_acc, n), (candidate, candidate_acc, _) = (
            best[task.name, "lm-evaluation-harness hf"],
            best[task.name, "eval.py"],
        )
        totals["lm-evaluation-harness hf"] += reference
        totals["eval.py"] += candidate
        agree = (
            f"{candidate_acc:.4f}" if candidate_acc == reference_acc else f"{reference_acc:.4f} vs {candidate_acc:.4f}"
        )
        print(
            f"| {task.name} | {n} | {reference:.1f} | {candidate:.1f} | {n / reference:.2f} | {n / candidate:.2f} | "
            f"{reference / candidate:.2f}x | {agree} |"
        )
    best = totals
    ratio = best["lm-evaluation-harness hf"] / best["eval.py"]
    print(f"\nAll {n_items} questions: eval.py scores {ratio:.2f}x as many per second as the harness's hf model.")


if __name__ == "__main__":
    run_cli(main)
