"""The generated conversation set (data/chat_tasks.py): deterministic, in the corpus's characters,
right answers, and held-out questions never asked in training or validation."""

import json

import pytest

from data.chat_tasks import TASKS, corpus_words, make_sets, turn
from data.conversations import chat_tokenizer, render_conversation
from data.files import read_text
from data.tokenizer import CharTokenizer
from errors import UserError
from tests.conftest import PROJECT_ROOT, run_entry_point

CORPUS = read_text(PROJECT_ROOT / "data" / "tinyshakespeare.txt")
WORDS = corpus_words(CORPUS)
NUMBERS = ["three", "four", "five", "six", "seven", "eight"]


def small_sets(seed: int) -> dict[str, list[dict]]:
    return make_sets(WORDS, seed, n_train=3000, n_val=100, n_heldout=300)


def questions(records: list[dict]) -> list[tuple[str, str]]:
    """(user turn, the reply to it) of every turn of the records: the next assistant message, or a
    held-out item's answer."""
    result = []
    for record in records:
        messages = record["messages"]
        for n, message in enumerate(messages):
            if message["role"] == "user":
                reply = messages[n + 1]["content"] if n + 1 < len(messages) else record["answer"]
                result.append((message["content"], reply))
    return result


def expected_reply(question: str) -> str:
    """The answer to a question, worked out from its words alone."""
    *ask, word = question.rstrip("?").split(" ")
    ask = " ".join(ask)
    if ask == "reverse:":
        return "".join(reversed(word))
    if ask == "spell:":
        return " ".join(list(word))
    if ask == "first letter of":
        return word[:1]
    if ask == "last letter of":
        return word[len(word) - 1 :]
    if ask == "uppercase:":
        return "".join(chr(ord(c) - 32) for c in word)
    if ask == "how many letters in":
        return NUMBERS[len(word) - 3]
    raise AssertionError(f"unknown question {question!r}")


def test_the_same_seed_writes_the_same_files_and_another_seed_others(tmp_path, monkeypatch):
    for folder, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        args = ["--out", str(tmp_path / folder), "--seed", seed, "--train", "500", "--val", "20", "--heldout", "30"]
        assert run_entry_point("data/chat_tasks.py", args, monkeypatch) == 0
    for name in ("train.jsonl", "val.jsonl", "heldout.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes()
    lines = (tmp_path / "a" / "heldout.jsonl").read_text().splitlines()
    assert len(lines) == 30 and set(json.loads(lines[0])) == {"messages", "answer"}


def test_held_out_questions_are_never_asked_in_training_or_validation():
    sets = small_sets(0)
    held = {question for question, _ in questions(sets["heldout.jsonl"])}
    asked = {question for name in ("train.jsonl", "val.jsonl") for question, _ in questions(sets[name])}
    val = {question for question, _ in questions(sets["val.jsonl"])}
    assert len(held) == 300 and not held & asked
    assert not val & {question for question, _ in questions(sets["train.jsonl"])}
    assert all(len(item["messages"]) == 1 and item["messages"][0]["role"] == "user" for item in sets["heldout.jsonl"])


def test_rl_questions_are_distinct_training_pairs_never_held_out():
    sets = small_sets(2)
    rl = [question for question, _ in questions(sets["questions.jsonl"])]
    held_out_or_val = {question for name in ("heldout.jsonl", "val.jsonl") for question, _ in questions(sets[name])}
    assert len(rl) == len(set(rl)) == 2000 and not set(rl) & held_out_or_val
    assert all(len(item["messages"]) == 1 and "answer" in item for item in sets["questions.jsonl"])


def test_every_answer_is_right_by_a_second_computation():
    sets = small_sets(1)
    for name, records in sets.items():
        for question, reply in questions(records):
            assert reply == expected_reply(question), (name, question)
    tasks = {" ".join(question.split(" ")[:-1]) for question, _ in questions(sets["train.jsonl"])}
    assert len(tasks) == 6  # every kind of question is trained


def test_every_character_is_one_of_the_corpus():
    alphabet = set(CORPUS)
    sets = small_sets(2)
    text = "".join(json.dumps(record, ensure_ascii=False) for records in sets.values() for record in records)
    contents = "".join(
        message["content"] + record.get("answer", "")
        for records in sets.values()
        for record in records
        for message in record["messages"]
    )
    assert set(contents) <= alphabet, sorted(set(contents) - alphabet)
    assert text.isascii()


def test_each_conversation_is_one_question_and_its_answer():
    for record in small_sets(3)["train.jsonl"] + small_sets(3)["val.jsonl"]:
        assert [message["role"] for message in record["messages"]] == ["user", "assistant"]


def test_every_conversation_fits_the_quickstart_models_context_whole():
    """Rendered through the built-in template with the quickstart's characters, no conversation is
    longer than its 64 positions: prepare.py's --too-long truncate cuts nothing, and every reply is
    trained. The longest question and answer are asked of a word of the most letters."""
    tokenizer = chat_tokenizer(CharTokenizer.from_text(CORPUS))
    longest = max(WORDS, key=len)
    records = [{"messages": turn(task, longest)} for task in TASKS]
    sets = make_sets(WORDS, 4, n_train=20000, n_val=500, n_heldout=200)
    for record in records + sets["train.jsonl"] + sets["val.jsonl"]:
        ids, trained = render_conversation(record["messages"], tokenizer, where="chat_tasks")
        assert len(ids) <= 64 and any(trained), record


def test_more_held_out_questions_than_the_corpus_gives_are_refused():
    with pytest.raises(UserError, match="--heldout=1000000 and --val=1 need .* questions, but the corpus gives"):
        make_sets(WORDS, 0, n_train=1, n_val=1, n_heldout=10**6)
