"""Evaluation speed: eval.py's scoring against lm-evaluation-harness's `hf` model, same weights and items.

    python bench/eval.py            # GPT-2 124M shape, the shipped HellaSwag, ARC, PIQA files (the recorded table)
    python bench/eval.py --small    # 2 layers, 128 dims: checks the script in seconds

Weights are random (speed does not depend on their values): our model is built, exported to a
Hugging Face GPT-2 folder with tokenizer files, and the harness's `hf` model loads that folder. Both
score the same multiple-choice items: the shipped task files in tests/tasks/ (HellaSwag's, ARC's and
PIQA's record formats, 24 questions each), each repeated --repeat times, read through the harness's
own task definitions and through trainer/tasks.py. Same torch thread count, float32, one process,
batch size --batch-size for both (the harness: requests per forward pass; ours: endings per forward
pass). Each side runs once untimed and then --runs times, alternating, and the table gives the
fastest run: the whole call, from items to accuracies (the harness's includes building its task
from the file; ours includes tokenizing). Both sides' acc are printed too: they must agree.
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.tokenizer import GPT2Tokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from trainer.evaluate import evaluate_task  # noqa: E402
from trainer.pretrained import export_gpt2  # noqa: E402
from trainer.tasks import load_task  # noqa: E402

TASKS = Path(__file__).resolve().parent.parent / "tests" / "tasks"
# our --tasks name -> (the harness's task definition, the shipped file)
TASK_FILES = {
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag.jsonl"),
    "arc_easy": ("arc/arc_easy.yaml", "arc.jsonl"),
    "piqa": ("piqa/piqa.yaml", "piqa.jsonl"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="2 layers, 2 heads, 128 dims: a quick check")
    parser.add_argument("--repeat", type=int, default=2, help="copies of each task file's items (default: 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="both sides' batch size (default: 32)")
    parser.add_argument("--runs", type=int, default=2, help="timed runs per side (default: 2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    return parser.parse_args()


def write_task_files(folder: Path, repeat: int) -> None:
    """Each shipped file's items repeated, and a harness task definition reading it."""
    import lm_eval

    harness_tasks = Path(lm_eval.__file__).parent / "tasks"
    for name, (definition, file_name) in TASK_FILES.items():
        lines = (TASKS / file_name).read_text().splitlines()
        (folder / file_name).write_text("\n".join(lines * repeat) + "\n")
        (folder / f"bench_{name}.yaml").write_text(
            f"include: {harness_tasks / definition}\ntask: bench_{name}\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    test: {folder / file_name}\n"
            "test_split: test\nvalidation_split: null\ntraining_split: null\n"
        )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from trainer.harness import write_gpt2_tokenizer

    shape = dict(n_layer=2, n_head=2, n_embd=128) if args.small else dict(n_layer=12, n_head=12, n_embd=768)
    torch.manual_seed(0)
    tokenizer = GPT2Tokenizer()
    model = GPT(GPTConfig(block_size=1024, vocab_size=tokenizer.vocab_size, **shape)).eval()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        export_gpt2(model, tokenizer, folder / "model")
        write_gpt2_tokenizer(folder / "model")
        write_task_files(folder, args.repeat)
        tasks = [load_task(f"{name}={folder / file_name}") for name, (_, file_name) in TASK_FILES.items()]
        n_items = sum(len(task.items) for task in tasks)
        print(
            f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"lm-eval {lm_eval.__version__}, {args.threads} threads; model {model.num_params() / 1e6:.0f}M "
            f"parameters (float32); {n_items} questions, batch size {args.batch_size}",
            file=sys.stderr,
        )
        task_manager = TaskManager(include_path=str(folder), include_defaults=False)

        def harness() -> dict[str, float]:
            results = lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={folder / 'model'},dtype=float32",
                tasks=[f"bench_{name}" for name in TASK_FILES],
                task_manager=task_manager,
                device="cpu",
                batch_size=args.batch_size,
                verbosity="ERROR",
            )["results"]
            return {name: results[f"bench_{name}"]["acc,none"] for name in TASK_FILES}

        def ours() -> dict[str, float]:
            return {task.name: evaluate_task(model, tokenizer, task, args.batch_size).metrics["acc"] for task in tasks}

        best = {"lm-evaluation-harness hf": float("inf"), "eval.py": float("inf")}
        accuracy = {}
        for run in range(args.runs + 1):  # the first run of each side is a warm-up
            for name, score in (("lm-evaluation-harness hf", harness), ("eval.py", ours)):
                start = time.perf_counter()
                accuracy[name] = score()
                seconds = time.perf_counter() - start
                print(f"  {name}: {seconds:.2f} s{' (warm-up)' if run == 0 else ''}", file=sys.stderr)
                if run > 0:
                    best[name] = min(best[name], seconds)
    print("| scorer | questions | seconds | questions/s | acc (hellaswag, arc_easy, piqa) |")
    print("|---|---|---|---|---|")
    for name, seconds in best.items():
        figures = ", ".join(f"{value:.4f}" for value in accuracy[name].values())
        print(f"| {name} | {n_items} | {seconds:.2f} | {n_items / seconds:.1f} | {figures} |")
    ratio = best["lm-evaluation-harness hf"] / best["eval.py"]
    print(f"\neval.py scores {ratio:.2f}x as many questions per second as the harness's hf model.")


if __name__ == "__main__":
    main()
