"""Evaluation tasks: what eval.py and training's [eval] section score, read into plain items.

A task is named on the command line in one of three ways:

- a built-in name (`hellaswag`, `arc_easy`, `arc_challenge`, `piqa`, `lambada`): its split is read
  from the Hugging Face hub through `datasets`, and each record turned into an item exactly as
  lm-evaluation-harness's task definition does it (the functions below, one per task);
- `NAME=FILE`: the same built-in task read from a local JSON-lines file holding the hub's records
  (for a machine without network, or a subset);
- a local file: a `.jsonl` whose lines are `{"ctx": ..., "endings": [...], "label": i}` (multiple
  choice) or `{"text": ...}` (cloze: the last word is predicted from the rest), or any other file,
  read as UTF-8 text for perplexity and bits per byte. Its task name is the file's stem.

Every record is checked before anything is scored; a bad one is a UserError naming the file, the
item and the field.
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


def multiple_choice(context: str, endings: list[str], label: int, where: str) -> Item:
    return Item(context, [" " + ending for ending in endings], endings, label, where)


def cloze(text: str, where: str) -> Item:
    """The last space-separated word of text after the rest, as lambada_openai splits it."""
    words = text.split(" ")
    return Item(" ".join(words[:-1]), [" " + words[-1]], [words[-1]], 0, where)


# Each built-in task's record -> item, as lm-evaluation-harness's task YAML and utils.py do it.


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
    label = choices["label"].index(record["answerKey"])
    return multiple_choice(f"Question: {record['question']}\nAnswer:", list(choices["text"]), label, where)


def piqa_item(record: dict, where: str) -> Item:
    return multiple_choice(
        f"Question: {record['goal']}\nAnswer:", [record["sol1"], record["sol2"]], int(record["label"]), where
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
    fields: tuple[str, ...]  # what each record needs
    item: Callable[[dict, str], Item]


BUILTIN_TASKS = {
    "hellaswag": BuiltinTask(
        "Rowan/hellaswag",
        None,
        "validation",
        "choice",
        ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
        hellaswag_item,
    ),
    "arc_easy": BuiltinTask(
        "allenai/ai2_arc", "ARC-Easy", "test", "choice", ("question", "choices", "answerKey"), arc_item
    ),
    "arc_challenge": BuiltinTask(
        "allenai/ai2_arc", "ARC-Challenge", "test", "choice", ("question", "choices", "answerKey"), arc_item
    ),
    "piqa": BuiltinTask("baber/piqa", None, "validation", "choice", ("goal", "sol1", "sol2", "label"), piqa_item),
    "lambada": BuiltinTask("EleutherAI/lambada_openai", "default", "test", "cloze", ("text",), lambada_item),
}
LOCAL_FIELDS = {"choice": ("ctx", "endings", "label"), "cloze": ("text",)}


def load_task(spec: str, limit: int | None = None) -> Task:
    """The task a --tasks entry names (see the module's docstring), its first `limit` items (text:
    scoring windows) or all."""
    name, _, path = spec.partition("=")
    if path:
        if name not in BUILTIN_TASKS:
            raise UserError(
                f"--tasks {spec!r}: {name!r} is not a built-in task (NAME=FILE reads one of "
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
    fields: tuple[str, ...],
    make_item: Callable[[dict, str], Item],
    limit: int | None,
) -> Task:
    items = []
    for number, record in enumerate(records[:limit], start=1):
        where = f"{source} item {number}"
        missing = [field for field in fields if field not in record]
        if missing:
            raise UserError(f"{where}: field {missing[0]!r} is missing (each item needs {', '.join(fields)})")
        try:
            item = make_item(record, where)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise UserError(f"{where}: a field has the wrong form ({e}; see {name}'s record format)") from None
        items.append(_checked(item, "endings" if kind == "choice" else "text"))
    return Task(name, kind, source, items)


def _checked(item: Item, field: str) -> Item:
    """The item, if every part is non-empty text and its label picks one of its choices."""
    if not isinstance(item.context, str) or not item.context:
        raise UserError(f"{item.where}: field 'ctx' is empty (give the text the choices continue)")
    for number, choice in enumerate(item.choices):
        if not isinstance(choice, str) or not choice.strip():
            what = "the last word" if field == "text" else f"ending {number}"
            raise UserError(f"{item.where}: field {field!r}: {what} is empty or not text (give non-empty text)")
    if len(item.choices) < 1 or isinstance(item.label, bool) or not isinstance(item.label, int):
        raise UserError(f"{item.where}: field 'label'={item.label!r} is not an integer index of an ending")
    if not 0 <= item.label < len(item.choices):
        raise UserError(
            f"{item.where}: field 'label'={item.label} is out of range (it has {len(item.choices)} endings: "
            f"use 0 .. {len(item.choices) - 1})"
        )
    return item


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
