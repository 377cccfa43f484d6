"""The built-in checkers that reward a sampled answer: 1 when a program marks it right, else 0.

A checker compares the reply (the answer's text up to the end of its turn, cut at the task's stop
strings, as eval.py cuts a reply) with the item's reference answer, through the judges eval.py scores
generation tasks with (evals/tasks.py), so that a reward and a held-out score are the same comparison:

- `exact`: both texts with leading and trailing whitespace dropped and every run of whitespace inside
  made one space (a local task's `acc`);
- `gsm8k_strict`: the number after the reply's first `#### `, against the reference's final answer, both
  as lm-evaluation-harness's gsm8k task compares them (commas, `$` and a final `.` dropped, case
  ignored): its strict-match;
- `gsm8k_flexible`: the last number anywhere in the reply, compared in the same way: its
  flexible-extract;
- `numeric`: that last number and the reference's final answer (after `#### ` if it has one) read as
  numbers, rewarded when they differ by at most rl.tolerance;
- `task`: the task's own comparison: `exact` for a local file, `gsm8k_strict` for gsm8k.

Nothing a config names runs code of its own: a reward is one of these names.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from errors import UserError
from evals.tasks import GSM8K_JUDGE, LOCAL_JUDGE, Judge, Task

# each name but numeric and task: the judge whose figure compares, and the figure
JUDGED = {
    "exact": (LOCAL_JUDGE, "acc"),
    "gsm8k_strict": (GSM8K_JUDGE, "acc"),
    "gsm8k_flexible": (GSM8K_JUDGE, "acc_flexible"),
}


def number(text: str) -> float | None:
    """text read as a finite number, or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class Checker:
    """A reward: reference(answer) once per item, then score(reply, reference) per sampled answer."""

    name: str
    reference: Callable[[str], object]  # an item's answer -> what replies are compared with
    score: Callable[[str, object], float]  # (reply, reference) -> 1.0 or 0.0


def judged(name: str, judge: Judge, figure: str) -> Checker:
    compared = judge.figures[figure]
    return Checker(name, judge.reference, lambda reply, reference: float(compared(reply) == reference))


def numeric(tolerance: float) -> Checker:
    """The last number of the reply (gsm8k's flexible extraction) within tolerance of the reference's."""
    extract = GSM8K_JUDGE.figures["acc_flexible"]

    def score(reply: str, reference: float) -> float:
        value = number(extract(reply))
        return float(value is not None and abs(value - reference) <= tolerance)

    return Checker("numeric", lambda answer: number(GSM8K_JUDGE.reference(answer)), score)


def checker(name: str, tolerance: float, task: Task) -> Checker:
    """The checker rl.reward names for the task's items; every item's reference is read now, so that a
    reference the checker cannot compare with (numeric: one that is no number) stops the run before
    it starts, naming the item."""
    if name == "task":
        name = "gsm8k_strict" if task.judge is GSM8K_JUDGE else "exact"
    found = numeric(tolerance) if name == "numeric" else judged(name, *JUDGED[name])
    for item in task.items:
        if found.reference(item.answer) is None:
            raise UserError(
                f"{item.where}: field 'answer'={item.answer!r:.40} is no number, and rl.reward='numeric' compares "
                f"numbers (give the number, or its worked solution ending in '#### ' and the number; or choose "
                f"another rl.reward)"
            )
    return found
