"""Write the small evaluation task files the tests read, from the bundled Shakespeare, in every
format evals/tasks.py reads: the local multiple-choice, cloze and generation formats, a text file,
and the hub's record formats of the built-in tasks. Each multiple-choice question asks which line
follows a line of the play; the wrong endings are other lines. A generation item asks for the rest
of a line; GSM8K's records sum a character's ducats. Deterministic: running it again writes the
same files.

    python tests/tasks/make_tasks.py
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAKESPEARE = HERE.parent.parent / "data" / "tinyshakespeare.txt"
N_ITEMS = 24


def lines() -> list[str]:
    text = SHAKESPEARE.read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if len(line.strip().split()) >= 4]


def questions(rng: random.Random, pool: list[str], n_endings: int) -> list[tuple[str, list[str], int]]:
    """(a line, n_endings candidate next lines, index of the true one)."""
    result = []
    for _ in range(N_ITEMS):
        start = rng.randrange(len(pool) - 1)
        endings = [pool[start + 1]] + rng.sample(pool, n_endings - 1)
        rng.shuffle(endings)
        result.append((pool[start], endings, endings.index(pool[start + 1])))
    return result


def write_jsonl(name: str, records: list[dict]) -> None:
    with open(HERE / name, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def main() -> None:
    rng = random.Random(0)
    pool = lines()
    write_jsonl("next_line.jsonl", [{"ctx": c, "endings": e, "label": i} for c, e, i in questions(rng, pool, 4)])
    write_jsonl("last_word.jsonl", [{"text": pool[rng.randrange(len(pool))]} for _ in range(N_ITEMS)])
    hellaswag = []
    for ctx, endings, label in questions(rng, pool, 4):
        words = ctx.split(" ")
        half = len(words) // 2
        hellaswag.append(
            {
                "activity_label": "Shakespeare",
                "ctx_a": " ".join(words[:half]),
                "ctx_b": " ".join(words[half:]).lower(),
                "ctx": ctx,
                "endings": [e + " [title] Act" if n == 0 else e for n, e in enumerate(endings)],
                "label": str(label),
            }
        )
    write_jsonl("hellaswag.jsonl", hellaswag)
    arc = []
    for number, (ctx, endings, label) in enumerate(questions(rng, pool, rng.choice([3, 4, 5]))):
        keys = list("ABCDE") if number % 2 else ["1", "2", "3", "4", "5"]
        keys = keys[: len(endings)]
        arc.append(
            {
                "id": f"shakespeare-{number}",
                "question": f'Which line follows "{ctx}"?',
                "choices": {"text": endings, "label": keys},
                "answerKey": keys[label],
            }
        )
    write_jsonl("arc.jsonl", arc)
    piqa = [{"goal": c, "sol1": e[0], "sol2": e[1], "label": i} for c, e, i in questions(rng, pool, 2)]
    write_jsonl("piqa.jsonl", piqa)
    write_jsonl("lambada.jsonl", [{"text": pool[rng.randrange(len(pool))]} for _ in range(N_ITEMS)])
    start = rng.randrange(len(pool) - 40)
    (HERE / "passage.txt").write_text("\n".join(pool[start : start + 40]) + "\n", encoding="utf-8")
    rng = random.Random(1)  # the generation tasks' own: the files above stay as they were
    halves = [line.split(" ") for line in rng.sample(pool, N_ITEMS)]
    write_jsonl(
        "line_end.jsonl",
        [{"prompt": " ".join(w[: len(w) // 2]), "answer": " ".join(w[len(w) // 2 :])} for w in halves],
    )
    gsm8k = []
    for name in rng.sample(["ROMEO", "JULIET", "MENENIUS", "VOLUMNIA", "GLOUCESTER", "PETRUCHIO"] * 4, N_ITEMS):
        have, given = rng.randrange(2, 60), rng.randrange(2, 1200)
        gsm8k.append(
            {
                "question": f"{name} has {have} ducats and is given {given:,} more. How many ducats has {name} now?",
                "answer": f"{name} has {have} + {given} = <<{have}+{given}={have + given}>>{have + given} ducats.\n"
                f"#### {have + given}",
            }
        )
    write_jsonl("gsm8k.jsonl", gsm8k)


if __name__ == "__main__":
    main()
