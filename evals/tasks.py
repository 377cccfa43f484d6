"""Evaluation tasks: what eval.py and training's [eval] section score, read into plain items.

A task is named on the command line in one of three ways:

- a built-in name (`hellaswag`, `arc_easy`, `arc_challenge`, `piqa`, `lambada`, `gsm8k`): its split is read
  from the Hugging Face hub through `datasets`, and each record turned into an item exactly as
  lm-evaluation-harness's task definition does it (the functions below, one per task);
- `NAME=FILE`: the same built-in task read from a local JSON-lines file holding the hub's records
  (for a machine without network, or a subset);
- a local file: a `.jsonl` whose lines are `{"ctx": ..., "endings": [...], "label": i}` (multiple
  choice: two or more endings, label the index of the right one), `{"text": ...}` (cloze: the
  last of its two or more words is predicted from the rest) or `{"prompt": ..., "answer": ...}` /
  `{"messages": [...], "answer": ...}` (generation: the model's greedy reply is compared with the
  answer), or any other file, read as UTF-8 text for perplexity and bits per byte. Its task name is
  the file's stem.

An entry that is an existing file is that file, whatever its name holds (`my=items.jsonl`); only
another entry is split at its first `=` into NAME=FILE.

Every record is checked before anything is scored, each field by name against the shape its format
gives it (`Shape`: text, a list of endings, an index): a bad one is a UserError naming the file, the
item, the field, the value and what the field takes.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from data.conversations import messages_problem
from data.files import parse_json, read_user_text
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
class Question:
    """A generation task's item: the model's greedy reply to prompt (or, through its chat template, to
    messages, which end with the user's turn) is right when it equals answer, both as the task's
    Judge compares them."""

    prompt: str | None
    messages: list[dict] | None
    answer: str
    where: str  # "FILE item N", for error messages


@dataclass(frozen=True)
class Judge:
    """How a generation task's replies end and are scored."""

    stops: tuple[str, ...]  # a reply ends before the first of these (and at the end-of-text token)
    first_line: bool  # a plain prompt's reply ends at its first newline too (not one through a chat template)
    max_new_tokens: int  # a reply ends after this many tokens at most
    reference: Callable[[str], str]  # the answer as compared
    figures: dict[str, Callable[[str], str]]  # figure -> the reply as compared with the reference ("acc" first)


@dataclass
class Task:
    name: str
    kind: str  # "choice", "cloze", "generation" or "text"
    source: str  # the file or hub dataset it came from
    items: list  # Item (choice, cloze) or Question (generation)
    text: str = ""  # kind "text": the whole file
    judge: Judge | None = None  # kind "generation": how its replies are scored


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


def _messages_problem(value: object) -> str | None:
    """A conversation that the model's reply continues: messages as data/conversations.py checks them, the last
    one the user's."""
    problem = messages_problem(value)
    if problem is None and value[-1]["role"] != "user":
        return f": the last message is the {value[-1]['role']}'s, not the user's (the reply to it is what is scored)"
    return problem


def _gsm8k_answer_problem(value: object) -> str | None:
    problem = _text_problem(value)
    if problem is None and "#### " not in value:
        return f"={_shown(value)} has no '#### ' before its final answer"
    return problem


TEXT = Shape("non-empty text", _text_problem)
ANY_TEXT = Shape("text", _any_text_problem)
ENDINGS = Shape("a list of 2 or more non-empty texts", _texts_problem)
INDEX = Shape("a whole number: the index of the right ending, from 0", _index_problem)
INDEX_OR_DIGITS = Shape("the index of the right ending, from 0, as a number or digits", _index_or_digits_problem)
CLOZE_TEXT = Shape("text of two or more words: the last is predicted from the rest", _cloze_problem)
MESSAGES = Shape(
    'a list of {"role": ..., "content": ...} objects (roles system, user, assistant; non-empty content), the last '
    "the user's",
    _messages_problem,
)
GSM8K_ANSWER = Shape("the worked solution, ending in '#### ' and the final answer", _gsm8k_answer_problem)
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


def gsm8k_item(record: dict, where: str) -> Question:
    return Question(f"Question: {record['question']}\nAnswer:", None, record["answer"], where)


QUESTION_FIELDS = {"prompt": {"prompt": TEXT, "answer": TEXT}, "messages": {"messages": MESSAGES, "answer": TEXT}}


def local_question_item(record: dict, where: str) -> Question:
    """A prompt or a conversation, never both: which one the model answers would be a guess."""
    if "prompt" in record and "messages" in record:
        raise UserError(
            f"{where}: fields 'prompt' and 'messages' are both given (give one: the text to continue, or the "
            f"conversation to answer)"
        )
    if "prompt" not in record and "messages" not in record:
        raise UserError(f"{where}: field 'prompt' is missing (each item needs prompt or messages, and answer)")
    _check_fields(record, QUESTION_FIELDS["messages" if "messages" in record else "prompt"], where)
    return Question(record.get("prompt"), record.get("messages"), record["answer"], where)


# Replies compared with answers. A local task compares them as texts whose spacing does not matter;
# GSM8K as lm-evaluation-harness does (its gsm8k.yaml: the regex filters and exact_match's settings).


def normalise(text: str) -> str:
    """Leading and trailing whitespace dropped, every run of whitespace inside one space; case kept."""
    return " ".join(text.split())


def _harness_exact(text: str) -> str:
    """gsm8k.yaml's exact_match: its regexes_to_ignore removed in order, then ignore_case."""
    for pattern in (",", "\\$", "(?s).*#### ", "\\.$"):
        text = re.sub(pattern, "", text)
    return text.lower()


def _harness_regex(pattern: str, group_select: int) -> Callable[[str], str]:
    """The harness's regex filter followed by take_first: the group_select-th match (its first
    non-empty group), stripped, or "[invalid]"."""

    def extract(reply: str) -> str:
        matches = re.findall(pattern, reply)
        if not matches:
            return "[invalid]"
        match = matches[group_select]
        if isinstance(match, tuple):
            match = next((group for group in match if group), "[invalid]")
        return _harness_exact(match.strip())

    return extract


LOCAL_JUDGE = Judge((), True, 64, normalise, {"acc": normalise})
GSM8K_JUDGE = Judge(
    ("Question:", "</s>", "<|im_end|>"),
    False,
    256,  # the harness's default max_gen_toks
    _harness_exact,
    {
        "acc": _harness_regex("#### (\\-?[0-9\\.\\,]+)", 0),  # strict-match
        "acc_flexible": _harness_regex("(-?[$0-9.,]{2,})|(-?[0-9]+)", -1),  # flexible-extract
    },
)


@dataclass(frozen=True)
class BuiltinTask:
    path: str  # the hub dataset
    name: str | None  # its configuration
    split: str  # the split the harness evaluates
    kind: str
    fields: dict[str, Shape]  # what each record needs
    item: Callable[[dict, str], Item | Question]
    judge: Judge | None = None  # kind "generation"


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
    # zero-shot: the harness's prompt without its five worked examples, which a small model's block cannot hold
    "gsm8k": BuiltinTask(
        "openai/gsm8k",
        "main",
        "test",
        "generation",
        {"question": TEXT, "answer": GSM8K_ANSWER},
        gsm8k_item,
        GSM8K_JUDGE,
    ),
}
# the local formats: the fields each record needs (generation: checked per record, as a prompt or messages)
LOCAL_FORMATS = {
    "choice": ({"ctx": TEXT, "endings": ENDINGS, "label": INDEX}, local_choice_item),
    "cloze": ({"text": CLOZE_TEXT}, local_cloze_item),
    "generation": ({}, local_question_item),
}


def local_kind(record: dict) -> str:
    """The local format a file's first record is written in."""
    if any(field in record for field in ("prompt", "messages", "answer")):
        return "generation"
    return "cloze" if "text" in record and "endings" not in record else "choice"


def load_task(spec: str, limit: int | None = None, max_new_tokens: int | None = None, key: str = "--tasks") -> Task:
    """The task a --tasks entry names (see the module's docstring), its first `limit` items (text:
    scoring windows) or all; max_new_tokens, if given, replaces a generation task's own. key: the option
    or config key a refusal names as the one that gave spec."""
    task = _load_task(spec, limit, key)
    if task.judge is not None and max_new_tokens is not None:
        task.judge = replace(task.judge, max_new_tokens=max_new_tokens)
    return task


def _load_task(spec: str, limit: int | None, key: str) -> Task:
    name, _, path = spec.partition("=")
    if path and not Path(spec).is_file():
        if name not in BUILTIN_TASKS:
            raise UserError(
                f"{key} {spec!r} is no file, and {name!r} is not a built-in task (NAME=FILE reads one of "
                f"{', '.join(BUILTIN_TASKS)} from a local file)"
            )
        builtin = BUILTIN_TASKS[name]
        task = _task(name, builtin.kind, path, _read_jsonl(Path(path)), builtin.fields, builtin.item, limit)
        return replace(task, judge=builtin.judge)
    if spec in BUILTIN_TASKS:
        builtin = BUILTIN_TASKS[spec]
        source = f"{builtin.path}" + (f" ({builtin.name})" if builtin.name else "")
        records = _read_hub(spec, builtin)
        task = _task(spec, builtin.kind, source, records, builtin.fields, builtin.item, limit)
        return replace(task, judge=builtin.judge)
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"{key} {spec!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor a file "
            f"(give a .jsonl of multiple-choice, cloze or generation items, or a text file)"
        )
    if path.suffix != ".jsonl":
        return Task(path.stem, "text", spec, [], _read_text(path))
    records = _read_jsonl(path)
    kind = local_kind(records[0])
    fields, item = LOCAL_FORMATS[kind]
    task = _task(path.stem, kind, spec, records, fields, item, limit)
    return replace(task, judge=LOCAL_JUDGE) if kind == "generation" else task


def _task(
    name: str,
    kind: str,
    source: str,
    records: list[dict],
    fields: dict[str, Shape],
    make_item: Callable[[dict, str], Item | Question],
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
        record = parse_json(line, f"{path} line {number}")
        if not isinstance(record, dict):
            raise UserError(f"{path} line {number} is not a JSON object (write one {{...}} per line)")
        records.append(record)
    if not records:
        raise UserError(f"{path} holds no items (write one JSON object per line)")
    return records


def _read_text(path: Path) -> str:
    text = read_user_text(path)
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
