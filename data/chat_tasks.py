"""A small conversation set whose answers a program can check, made from the bundled Shakespeare.

    python data/chat_tasks.py --out data/chat_tasks

Each conversation is one user turn that asks one thing about a word of the play (reverse it, spell
it, its first or last letter, it in capitals, how many letters it has) and the assistant's turn that
answers it. Only characters of data/tinyshakespeare.txt are used (it has letters but of the digits
only 3, so counts are written as words), so a character-level model of that text can read and write
every conversation once a chat template's special tokens are added to its vocabulary.

The conversations are made for the quickstart's model, whose context is 64 characters: the built-in
template spends 21 tokens on a turn's markers and roles, so the longest question and its answer
(`how many letters in` a word of 8 letters, `eight`) render to 55 tokens, and a second turn would
not fit.

Writes to --out:

- train.jsonl and val.jsonl: conversations `{"messages": [{"role": "user", ...}, {"role":
  "assistant", ...}]}`;
- heldout.jsonl: eval.py generation items `{"messages": [one user turn], "answer": ...}`;
- questions.jsonl: questions left to training (--questions of them, drawn without repeats), as
  generation items too: what an [rl] run samples answers to and rewards
  (configs/chat_shakespeare_rl.toml).

Every (task, word) pair is one question. The pairs are shuffled by --seed and dealt out: the
held-out items first, then the validation conversations, the rest to training, so no held out
question is ever asked in training or validation (the same word may be, under another task).
The same seed writes the same files.
"""

import argparse
import json
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/chat_tasks.py`: make the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from data.files import atomic_open, check_writable_dir, make_dir, read_text  # noqa: E402
from errors import UserError, run_cli  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "tinyshakespeare.txt"
WORD_LENGTHS = range(3, 9)  # letters in a word asked about: short enough to spell in one line
NUMBER_WORDS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight"}
FILES = ("train.jsonl", "val.jsonl", "heldout.jsonl", "questions.jsonl")
OUT = "data/chat_tasks"  # the default --out: where the chat quickstart (README.md) reads them


@dataclass(frozen=True)
class ChatTask:
    question: str  # the user's turn, with {word}
    answer: Callable[[str], str]  # the word -> the assistant's reply


TASKS = {
    "reverse": ChatTask("reverse: {word}", lambda word: word[::-1]),
    "spell": ChatTask("spell: {word}", lambda word: " ".join(word)),
    "first": ChatTask("first letter of {word}?", lambda word: word[0]),
    "last": ChatTask("last letter of {word}?", lambda word: word[-1]),
    "upper": ChatTask("uppercase: {word}", lambda word: word.upper()),
    "count": ChatTask("how many letters in {word}?", lambda word: NUMBER_WORDS[len(word)]),
}


def corpus_words(text: str) -> list[str]:
    """The distinct lowercase words of the text of WORD_LENGTHS letters, sorted."""
    words = set(re.findall(r"\b[a-z]+\b", text))
    return sorted(word for word in words if len(word) in WORD_LENGTHS)


def turn(task: str, word: str) -> list[dict]:
    """One question and its answer, as messages."""
    return [
        {"role": "user", "content": TASKS[task].question.format(word=word)},
        {"role": "assistant", "content": TASKS[task].answer(word)},
    ]


def make_sets(
    words: list[str], seed: int, n_train: int, n_val: int, n_heldout: int, n_questions: int = 2000
) -> dict[str, list[dict]]:
    """The three files' records (see the module's docstring)."""
    rng = random.Random(seed)
    pairs = [(task, word) for word in words for task in TASKS]
    rng.shuffle(pairs)
    needed = n_heldout + n_val + 1  # and at least one question left to train on
    if needed > len(pairs):
        raise UserError(
            f"--heldout={n_heldout} and --val={n_val} need {needed:,} questions, but the corpus gives "
            f"{len(pairs):,} (ask for fewer)"
        )
    heldout, val, rest = pairs[:n_heldout], pairs[n_heldout : n_heldout + n_val], pairs[n_heldout + n_val :]
    train = [{"messages": turn(*rng.choice(rest))} for _ in range(n_train)]
    held = [question(task, word) for task, word in heldout]
    questions = [question(task, word) for task, word in rest[:n_questions]]  # rest is shuffled already
    return {
        "train.jsonl": train,
        "val.jsonl": [{"messages": turn(*pair)} for pair in val],
        "heldout.jsonl": held,
        "questions.jsonl": questions,
    }


def question(task: str, word: str) -> dict:
    """One question as an eval.py generation item: the user's turn and the answer a reply must equal."""
    return {"messages": turn(task, word)[:1], "answer": TASKS[task].answer(word)}


def write_sets(out: Path, sets: dict[str, list[dict]]) -> None:
    make_dir(out)
    for name, records in sets.items():
        with atomic_open(out / name) as f:
            f.write("".join(json.dumps(record) + "\n" for record in records).encode("utf-8"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=OUT, help=f"output folder (default: {OUT})")
    parser.add_argument("--seed", type=int, default=1337, help="deals the questions out (default: 1337)")
    parser.add_argument("--train", type=int, default=20000, help="training conversations (default: 20000)")
    parser.add_argument("--val", type=int, default=500, help="validation conversations (default: 500)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out eval.py items (default: 200)")
    parser.add_argument(
        "--questions", type=int, default=2000, help="training questions for an [rl] run, at most (default: 2000)"
    )
    args = parser.parse_args()
    for key in ("train", "val", "heldout", "questions"):
        if getattr(args, key) < 1:
            raise UserError(f"--{key}={getattr(args, key)} is not allowed (use 1 or more)")
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    check_writable_dir(out, "--out")
    present = [name for name in FILES if (out / name).exists()]
    if present:
        raise UserError(f"{out} already holds {', '.join(present)} (delete them or choose another --out)")
    sets = make_sets(corpus_words(read_text(CORPUS)), args.seed, args.train, args.val, args.heldout, args.questions)
    write_sets(out, sets)
    counts = ", ".join(f"{len(records):,} in {name}" for name, records in sets.items())
    print(f"wrote {counts} to {out}")


if __name__ == "__main__":
    run_cli(main)
