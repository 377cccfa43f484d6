"""Evaluation tasks: what eval.py and training's [eval] section score, read into plain items.

A task is named on the command line in one of three ways:

- a built-in name (`hellaswag`, `arc_easy`, `arc_challenge`, `piqa`, `lambada`): its split is read
  from the Hugging Face hub through `datasets`, and each record turned into an item exactly as
  lm-evaluation-harness's task definition does it (the functions below, one per task);
- `NAME=FILE`: the same built-in task read from a local JSON-lines file holding the hub's records
  (for a machine without network, or a subset);
- a local file: a `.jsonl` whose lines are `{"ctx": ..., "endings": [...], "label": i}` (multiple
  choice: two or more endings, label the index of the right one) or `{"text": ...}` (cloze: the
  last of its two or more words is predicted from the rest), or any other file, read as UTF-8 text
  for perplexity and bits per byte. Its task name is the file's stem.

An entry that is an existing file is that file, whatever its name holds (`my=items.jsonl`); only
another entry is split at its first `=` into NAME=FILE.

Every record is checked before anything is scored, each field by name against the shape its format
gives it (`Shape`: text, a list of endings, an index): a bad one is a UserError naming the file, the
item, the field, the value and what the field takes.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from errors import UserError


@dataclass
class Item:
    """One question: each continuation is scored by its log-likelihood after context. Multiple
    choice: the continuations are " " + each ending (the harness's target delimiter), choices the
    endings themselves (acc_norm divides by their length in characters), label the right one.
    Cloze: one continuation, the last word with its space; it is right when greedy."""

    context: str
    continuations: list[str]
    choices: list[str]
    label: int
    where: str  # "FILE item N", for error messages


@dataclass
class Task:
    name: str
    kind: str  # "choice", "cloze" or "text"
    source: str  # the file or hub dataset it came from
    items: list[Item]
    text: str = ""  # kind "text": the whole file


def multiple_choice(context: str, endings: list[str], label: int, where: str, label_field: str = "label") -> Item:
    """A question whose right ending is endings[label]; label_field names where the label came from.
    The endings are checked again as prepared (a HellaSwag ending of only bracketed marks is empty
    once they are dropped): an empty one would have no log-likelihood and no length to divide by."""
    for number, ending in enumerate(endings):
        if not ending.strip():
            raise UserError(
                f"{where}: field 'endings': ending {number} is empty once prepared for scoring (nothing is left "
                f"to score: give it text, or drop the item)"
            )
    if not 0 <= label < len(endings):
        raise UserError(
            f"{where}: field {label_field!r}={label} is out of range (it has {len(endings)} endings: use 0 .. "
            f"{len(endings) - 1})"
        )
    return Item(context, [" " + ending for ending in endings], endings, label, where)


def cloze(text: str, where: str) -> Item:
    """The last space-separated word of text after the rest, as lambada_openai splits it."""
    words = text.split(" ")
    return Item(" ".join(words[:-1]), [" " + words[-1]], [words[-1]], 0, where)


# What each field of a record must hold, checked by name before an item is made of it: a string where
# a list belongs would otherwise be read as a list of characters, and an object as its keys.


@dataclass(frozen=True)
class Shape:
    """What one field takes: the error line says `accepts` after naming the field, its value and `problem`."""

    accepts: str  # what the field takes, in words, for the error line
    problem: Callable[[object], str | None]  # what is wrong with a value (after the field's name), or None


def _kind(value: object) -> str:
    """A value's JSON type in words."""
    kinds = ((bool, "true or false"), (int, "a whole number"), (float, "a decimal number"), (str, "text"))
    kinds += ((list, "a list"), (dict, "an object"), (type(None), "null"))
    return next((words for kind, words in kinds if isinstance(value, kind)), type(value).__name__)


def _shown(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _any_text_problem(value: object) -> str | None:
    return None if isinstance(value, str) else f"={_shown(value)} is {_kind(value)}, not text"


def _text_problem(value: object) -> str | None:
    problem = _any_text_problem(value)
    if problem is None and not value.strip():
        return f"={_shown(value)} is empty"
    return problem


def _texts_problem(value: object, part: str = "ending") -> str | None:
    """A list of two or more non-empty texts: a question needs something to choose between."""
    if not isinstance(value, list):
        return f"={_shown(value)} is {_kind(value)}, not a list"
    if len(value) < 2:
        return "=[] is an empty list" if not value else f"={_shown(value)} has one {part}"
    problems = (f": {part} {number}{problem}" for number, text in enumerate(value) if (problem := _text_problem(text)))
    return next(problems, None)


def _index_problem(value: object) -> str | None:
    # bool is an int in Python, but true is no index
    return None if type(value) is int else f"={_shown(value)} is {_kind(value)}, not a whole number"


def _index_or_digits_problem(value: object) -> str | None:
    """hellaswag's hub records give their label as digits ("2"); a copy may give the number."""
    if isinstance(value, str) and value.isdecimal():
        return None
    return _index_problem(value)


def _cloze_problem(value: object) -> str | None:
    problem = _text_problem(value)
    if problem is not None:
        return problem
    context, _, word = value.rpartition(" ")
    if not context.strip():
        return f"={_shown(value)} is one word"
    return None if word else f"={_shown(value)} ends in a space, so the word to predict is empty"


def _arc_choices_problem(value: object) -> str | None:
    if not isinstance(value, dict):
        return f"={_shown(value)} is {_kind(value)}, not an object"
    for key in ("text", "label"):
        if key not in value:
            return f": its {key!r} is missing"
        found = _texts_problem(value[key], "choice")
        if found is not None:
            return f": its {key!r}{found}"
    if len(value["text"]) != len(value["label"]):
        return f": its {len(value['text'])} texts and {len(value['label'])} labels do not pair up"
    return None


TEXT = Shape("non-empty text", _text_problem)
ANY_TEXT = Shape("text", _any_text_problem)
ENDINGS = Shape("a list of 2 or more non-empty texts", _texts_problem)
INDEX = Shape("a whole number: the index of the right ending, from 0", _index_problem)
INDEX_OR_DIGITS = Shape("the index of the right ending, from 0, as a number or digits", _index_or_digits_problem)
CLOZE_TEXT = Shape("text of two or more words: the last is predicted from the rest", _cloze_problem)
ARC_CHOICES = Shape(
    '{"text": [...], "label": [...]}: two lists of 2 or more non-empty texts, of one length', _arc_choices_problem
)


# Each built-in task's record -> item, as lm-evaluation-harness's task YAML and utils.py do it; the
# record's fields have their shapes (checked first).


def _hellaswag_text(text: str) -> str:
    # WikiHow's records carry bracketed section marks ("[header]", "[title]"): the harness drops them
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(record: dict, where: str) -> Item:
    context = record["ctx_a"] + " " + record["ctx_b"].capitalize()
    context = _hellaswag_text(record["activity_label"] + ": " + context)
    endings = [_hellaswag_text(ending) for ending in record["endings"]]
    return multiple_choice(context, endings, int(record["label"]), where)


def arc_item(record: dict, where: str) -> Item:
    choices = record["choices"]
    if record["answerKey"] not in choices["label"]:
        raise UserError(
            f"{where}: field 'answerKey'={_shown(record['answerKey'])} is none of the choices' labels "
            f"({', '.join(choices['label'])})"
        )
    label = choices["label"].index(record["answerKey"])
    question = f"Question: {record['question']}\nAnswer:"
    return multiple_choice(question, list(choices["text"]), label, where, "answerKey")


def piqa_item(record: dict, where: str) -> Item:
    return multiple_choice(
        f"Question: {record['goal']}\nAnswer:", [record["sol1"], record["sol2"]], record["label"], where
    )


def lambada_item(record: dict, where: str) -> Item:
    return cloze(record["text"], where)


def local_choice_item(record: dict, where: str) -> Item:
    return multiple_choice(record["ctx"], list(record["endings"]), record["label"], where)


def local_cloze_item(record: dict, where: str) -> Item:
    return cloze(record["text"], where)


@dataclass(frozen=True)
class BuiltinTask:
    path: str  # the hub dataset
    name: str | None  # its configuration
    split: str  # the split the harness evaluates
    kind: str
    fields: dict[str, Shape]  # what each record needs
    item: Callable[[dict, str], Item]


ARC_FIELDS = {"question": TEXT, "choices": ARC_CHOICES, "answerKey": TEXT}
BUILTIN_TASKS = {
    "hellaswag": BuiltinTask(
        "Rowan/hellaswag",
        None,
        "validation",
        "choice",
        {"activity_label": TEXT, "ctx_a": ANY_TEXT, "ctx_b": ANY_TEXT, "endings": ENDINGS, "label": INDEX_OR_DIGITS},
        hellaswag_item,
    ),
    "arc_easy": BuiltinTask("allenai/ai2_arc", "ARC-Easy", "test", "choice", ARC_FIELDS, arc_item),
    "arc_challenge": BuiltinTask("allenai/ai2_arc", "ARC-Challenge", "test", "choice", ARC_FIELDS, arc_item),
    "piqa": BuiltinTask(
        "baber/piqa",
        None,
        "validation",
        "choice",
        {"goal": TEXT, "sol1": TEXT, "sol2": TEXT, "label": INDEX},
        piqa_item,
    ),
    "lambada": BuiltinTask("EleutherAI/lambada_openai", "default", "test", "cloze", {"text": CLOZE_TEXT}, lambada_item),
}
LOCAL_FIELDS = {"choice": {"ctx": TEXT, "endings": ENDINGS, "label": INDEX}, "cloze": {"text": CLOZE_TEXT}}


def task_specs(entries: list[str]) -> list[str]:
    """The --tasks entries (eval.py's arguments, or [eval] tasks), each split at its commas; blanks
    between commas name nothing."""
    return [spec.strip() for entry in entries for spec in entry.split(",") if spec.strip()]


def load_task(spec: str, limit: int | None = None) -> Task:
    """The task a --tasks entry names (see the module's docstring), its first `limit` items (text:
    scoring windows) or all."""
    name, _, path = spec.partition("=")
    if path and not Path(spec).is_file():
        if name not in BUILTIN_TASKS:
            raise UserError(
                f"--tasks {spec!r} is no file, and {name!r} is not a built-in task (NAME=FILE reads one of "
                f"{', '.join(BUILTIN_TASKS)} from a local file)"
            )
        builtin = BUILTIN_TASKS[name]
        return _task(name, builtin.kind, path, _read_jsonl(Path(path)), builtin.fields, builtin.item, limit)
    if spec in BUILTIN_TASKS:
        builtin = BUILTIN_TASKS[spec]
        source = f"{builtin.path}" + (f" ({builtin.name})" if builtin.name else "")
        records = _read_hub(spec, builtin)
        return _task(spec, builtin.kind, source, records, builtin.fields, builtin.item, limit)
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"--tasks {spec!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a file "
            f"(give a .jsonl of multiple-choice or cloze items, or a text file)"
        )
    if path.suffix != ".jsonl":
        return Task(path.stem, "text", spec, [], _read_text(path))
    records = _read_jsonl(path)
    kind = "cloze" if "text" in records[0] and "endings" not in records[0] else "choice"
    item = local_cloze_item if kind == "cloze" else local_choice_item
    return _task(path.stem, kind, spec, records, LOCAL_FIELDS[kind], item, limit)


def _task(
    name: str,
    kind: str,
    source: str,
    records: list[dict],
    fields: dict[str, Shape],
    make_item: Callable[[dict, str], Item],
    limit: int | None,
) -> Task:
    items = []
    for number, record in enumerate(records[:limit], start=1):
        where = f"{source} item {number}"
        _check_fields(record, fields, where)
        items.append(make_item(record, where))
    return Task(name, kind, source, items)


def _check_fields(record: dict, fields: dict[str, Shape], where: str) -> None:
    """Each field of the record is there and has its shape, or a UserError names the first that has not."""
    for field, shape in fields.items():
        if field not in record:
            raise UserError(f"{where}: field {field!r} is missing (each item needs {', '.join(fields)})")
        problem = shape.problem(record[field])
        if problem is not None:
            raise UserError(f"{where}: field {field!r}{problem} (give {shape.accepts})")


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} line {number} is not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise UserError(f"{path} line {number} is not a JSON object (write one {{...}} per line)")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no items (write one JSON object per line)")
    return records


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text:
        raise UserError(f"{path} is empty (give a file with text or items)")
    return text


def _read_hub(spec: str, builtin: BuiltinTask) -> list[dict]:
    """The task's split from the Hugging Face hub (or datasets' cache)."""
    import datasets  # imported here: reading it sets up its cache and reads HF_* variables

    try:
        dataset = datasets.load_dataset(builtin.path, builtin.name, split=builtin.split)
    except (ConnectionError, OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--tasks {spec}: {builtin.path} cannot be read from the Hugging Face hub ({first_line}); offline, "
            f"give a local copy of its {builtin.split} split as {spec}=FILE.jsonl"
        ) from None
    return list(dataset)
