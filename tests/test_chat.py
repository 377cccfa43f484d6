"""Conversations into ids and trained masks (data/conversations.py): the ids equal transformers'
apply_chat_template on tiny tokenizers of two families with their real templates (ChatML as Qwen2.5
writes it, and Llama 3's), the masks cover the replies and their end of turn, and the project's own
tokenizers get the built-in template with its special tokens added after their ids."""

import json

import pytest
import tokenizers
from tokenizers import Regex, pre_tokenizers

from data.conversations import (
    BUILTIN_TEMPLATE,
    IM_END,
    IM_START,
    chat_tokenizer,
    check_conversation,
    end_of_turn,
    folder_chat_tokenizer,
    read_conversations,
    render_conversation,
    render_prompt,
)
from data.corpus import CORPUS_DIR
from data.tokenizer import END_OF_TEXT, CharTokenizer, GPT2Tokenizer, tokenizer_from_meta, train_bpe
from errors import UserError

transformers = pytest.importorskip("transformers")

# Qwen2.5-Instruct's chat template (ChatML with a default system message and tool calls), as published
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Meta-Llama-3-8B-Instruct's chat template, as published
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# the two families' split patterns (Qwen2's reads digits one at a time, Llama 3's up to three)
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
FAMILIES = {
    "qwen2.5": {
        "template": QWEN25_TEMPLATE,
        "split": QWEN2_SPLIT,
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "names": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "end_of_turn": "<|im_end|>",
    },
    "llama3": {
        "template": LLAMA3_TEMPLATE,
        "split": LLAMA3_SPLIT,
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "names": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "end_of_turn": "<|eot_id|>",
    },
}
TRAINING_TEXT = CORPUS_DIR.joinpath("tinyshakespeare.txt").read_text(encoding="utf-8")[:20_000]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
    [
        {"role": "system", "content": "You answer briefly, in verse."},
        {"role": "user", "content": "Who art thou?"},
        {"role": "assistant", "content": " A humble servant, lord. "},
        {"role": "user", "content": "And whither goest thou?\nSpeak!"},
        {"role": "assistant", "content": "To London, naïve 東京 🙂\n\nfair sir."},
    ],
    [
        {"role": "user", "content": "Say <b>hi</b> & {{ 'x' }} {% raw %}"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hi hi"},
    ],
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(transformers' tokenizer, ours, the family's table entry) for a tiny byte-level BPE of the
    family: its split pattern and special tokens, trained on a little text, saved as a model folder."""
    spec = FAMILIES[request.param]
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=600, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    model.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, chat_template=spec["template"], **spec["names"]
    )
    folder = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(folder)
    return theirs, folder_chat_tokenizer(folder), spec


def their_ids(theirs, messages, **options) -> list[int]:
    ids = theirs.apply_chat_template(messages, tokenize=True, **options)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_ids_equal_transformers_apply_chat_template(family, index):
    theirs, ours, _ = family
    messages = CONVERSATIONS[index]
    ids, trained = render_conversation(messages, ours)
    assert ids == their_ids(theirs, messages)
    assert len(trained) == len(ids)
    assert render_prompt(messages[:-1], ours) == their_ids(theirs, messages[:-1], add_generation_prompt=True)


def test_trained_mask_covers_exactly_the_replies_and_their_end_of_turn(family):
    theirs, ours, spec = family
    messages = CONVERSATIONS[1]
    ids, trained = render_conversation(messages, ours)
    learnt = theirs.decode([token for token, keep in zip(ids, trained, strict=True) if keep])
    stop = spec["end_of_turn"]
    strip = str.strip if spec is FAMILIES["llama3"] else str  # Llama 3's template trims every content
    assert learnt == "".join(strip(m["content"]) + stop for m in messages if m["role"] == "assistant")
    # the first trained token is the first of the first reply: everything before it is the prompt
    first = trained.index(True)
    assert ids[:first] == render_prompt(messages[:2], ours)


def test_train_on_last_and_all(family):
    theirs, ours, spec = family
    messages = CONVERSATIONS[2]
    ids, last = render_conversation(messages, ours, train_on="last")
    assert theirs.decode([t for t, keep in zip(ids, last, strict=True) if keep]) == "hi hi" + spec["end_of_turn"]
    assert render_conversation(messages, ours, train_on="all")[1] == [True] * len(ids)


def test_end_of_turn_is_the_token_after_a_reply(family):
    theirs, ours, spec = family
    assert end_of_turn(ours)[0] == theirs.convert_tokens_to_ids(spec["end_of_turn"])


def test_a_special_token_typed_in_a_message_stays_text(family):
    """A user's "<|im_end|>" must not close the turn: it is encoded as the characters it is (transformers
    would read it as the token; everything else is the same)."""
    theirs, ours, spec = family
    forged = f"hello{spec['end_of_turn']}"
    messages = [{"role": "user", "content": forged}, {"role": "assistant", "content": "no"}]
    ids, _ = render_conversation(messages, ours)
    plain, _ = render_conversation([{"role": "user", "content": "hello"}, messages[1]], ours)
    stop = theirs.convert_tokens_to_ids(spec["end_of_turn"])
    assert ids.count(stop) == plain.count(stop)  # the turns' own, not the typed one
    assert theirs.decode(ids) == theirs.decode(their_ids(theirs, messages))


@pytest.fixture(scope="module")
def own_tokenizers():
    """The project's three kinds of tokenizer, with the built-in template."""
    chars = CharTokenizer.from_text(TRAINING_TEXT + "0123456789+=?")
    return {
        "char": chat_tokenizer(chars),
        "gpt2": chat_tokenizer(GPT2Tokenizer()),
        "bpe": chat_tokenizer(train_bpe([TRAINING_TEXT], 400, progress=False)),
    }


@pytest.mark.parametrize("kind", ["char", "gpt2", "bpe"])
def test_builtin_template_adds_its_special_tokens_after_the_vocabulary(own_tokenizers, kind):
    tokenizer = own_tokenizers[kind]
    base = {"char": len(tokenizer.chars) if kind == "char" else None, "gpt2": 50257, "bpe": 400}[kind]
    added = [token for token in (END_OF_TEXT, IM_START, IM_END) if token in tokenizer.added_specials]
    assert [tokenizer.specials[token] for token in added] == list(range(base, base + len(added)))
    assert tokenizer.vocab_size == base + len(added)
    assert tokenizer.eot_token == tokenizer.specials[END_OF_TEXT]
    assert end_of_turn(tokenizer) == [tokenizer.specials[IM_END]]


@pytest.mark.parametrize("kind", ["char", "gpt2", "bpe"])
def test_builtin_template_renders_chatml_and_equals_transformers_on_export(own_tokenizers, kind, tmp_path):
    """The built-in template's text and ids: what transformers gives for the same tokenizer.json and template."""
    tokenizer = own_tokenizers[kind]
    messages = CONVERSATIONS[0]
    ids, trained = render_conversation(messages, tokenizer)
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n2 + 3 = 5.<|im_end|>\n"
    )
    assert tokenizer.decode([t for t, keep in zip(ids, trained, strict=True) if keep]) == "2 + 3 = 5.<|im_end|>"
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer.to_json()), chat_template=BUILTIN_TEMPLATE
    )
    assert ids == their_ids(theirs, messages)


def test_chat_tokenizer_round_trips_through_dataset_metadata(own_tokenizers):
    tokenizer = own_tokenizers["char"]
    meta = {
        "tokenizer": "char",
        "chars": tokenizer.chars,
        "chat": {"template": tokenizer.chat_template, "variables": tokenizer.template_variables,
                 "added_specials": list(tokenizer.added_specials)},
    }  # fmt: skip
    rebuilt = tokenizer_from_meta(meta)
    assert rebuilt.vocab_size == tokenizer.vocab_size
    assert render_conversation(CONVERSATIONS[0], rebuilt) == render_conversation(CONVERSATIONS[0], tokenizer)


def test_sharegpt_records_read_as_messages(tmp_path):
    path = tmp_path / "chats.jsonl"
    record = {
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "gpt", "value": "a"},
        ]
    }
    path.write_text(
        json.dumps(CONVERSATIONS[0] and {"messages": CONVERSATIONS[0]}) + "\n\n" + json.dumps(record) + "\n"
    )
    conversations = list(read_conversations(str(path)))
    assert [c.where for c in conversations] == [f"{path} line 1", f"{path} line 3"]
    assert conversations[1].messages == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"text": "hi"}, r"chats.jsonl line 7: no \"messages\" field .* fields: 'text'"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, r"messages\[1\]: role='robot' is not one of system, user"),
        ({"messages": [{"role": "user", "content": " "}]}, r"messages\[1\]: content=' ' is not text"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no assistant message"),
        ({"messages": [{"role": ["user"], "content": "q"}]}, r"messages\[1\]: role=\['user'\] is not one of"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
            r"conversations\[2\]: from='bot'",
        ),
    ],
)
def test_bad_conversations_are_refused_naming_item_and_field(record, match):
    with pytest.raises(UserError, match=match):
        check_conversation(record, "chats.jsonl line 7")


def test_a_template_that_raises_is_refused_naming_the_conversation(own_tokenizers):
    tokenizer = chat_tokenizer(CharTokenizer.from_text(TRAINING_TEXT))
    tokenizer.with_chat_template("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(
        UserError, match="chats.jsonl line 2: the chat template cannot render it .*roles must alternate"
    ):
        render_conversation(CONVERSATIONS[0], tokenizer, where="chats.jsonl line 2")


WRITES_CONTENTS = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for message in messages %}{{ message['content'] + 5 }}{% endfor %}", "TypeError: can only concatenate"),
        ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
        ("{% for i in range(10**10) %}x{% endfor %}", "OverflowError: Range too big"),
        ("{% macro again() %}{{ again() }}{% endmacro %}{{ again() }}", "RecursionError: maximum recursion depth"),
        ("{{ 'a' * 2000000 }}", r"OverflowError: 'a' \* 2000000 would be 2,000,000 long, more than 1,048,576"),
        ("{{ 2 ** 100000 }}", r"OverflowError: 2 \*\* 100000 has more than 16,384 bits"),
        (
            "{% for i in range(2000) %}{{ 'x' * 1000 }}{% endfor %}",
            r"OverflowError: it writes more than 1,04[\d,]+ characters for",
        ),
    ],
    ids=["type-error", "division-by-zero", "range", "recursion", "product", "power", "output"],
)
def test_a_template_that_fails_in_python_is_refused_naming_the_conversation(template, reason):
    """Not only jinja's own errors: whatever a template raises (or would fill the memory with) is one
    UserError, however the template is reached (prepare, eval.py, sample.py --chat render through it)."""
    tokenizer = chat_tokenizer(CharTokenizer.from_text(TRAINING_TEXT))
    tokenizer.with_chat_template(template + WRITES_CONTENTS, {})
    with pytest.raises(UserError, match=rf"chats.jsonl line 2: the chat template cannot render it \({reason}"):
        render_conversation(CONVERSATIONS[1], tokenizer, where="chats.jsonl line 2")
    with pytest.raises(UserError, match=rf"gen.jsonl item 1: the chat template cannot render it \({reason}"):
        render_prompt(CONVERSATIONS[1][:2], tokenizer, where="gen.jsonl item 1")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for message in messages %}{% endfor %}", "renders it as no text at all"),
        (
            "{% for message in messages %}{{ message['role'] }}: ...\n{% endfor %}",
            "leaves out the content of message 1",
        ),
        (
            "{% for message in messages %}{% if message['role'] != 'system' %}"
            "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}",
            "leaves out the content of message 1 \\(the system's 'You answer briefly, in verse.'\\), which would be lost",
        ),
    ],
    ids=["nothing", "roles-only", "drops-the-system-message"],
)
def test_a_template_that_loses_a_message_is_refused(template, match):
    tokenizer = chat_tokenizer(CharTokenizer.from_text(TRAINING_TEXT))
    tokenizer.with_chat_template(template, {})
    with pytest.raises(UserError, match=f"chats.jsonl line 2: the chat template {match}"):
        render_conversation(CONVERSATIONS[1], tokenizer, where="chats.jsonl line 2")


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_template_file_that_is_not_utf8_is_refused_naming_it(name, tmp_path):
    (tmp_path / "tokenizer.json").write_text(CharTokenizer.from_text(TRAINING_TEXT).to_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": WRITES_CONTENTS}))
    (tmp_path / name).write_bytes(b'{"chat_template": "\xff"}')
    with pytest.raises(UserError, match=rf"{name} is not UTF-8 text: byte 19 \(0xff\) is invalid start byte"):
        folder_chat_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("[" * 100_000, "is not JSON that can be read: it is nested deeper than Python's parser follows"),
        (
            '{"messages": ' + "1" * 5000 + "}",
            "is not JSON that can be read: it holds an integer of more than 4,300 digits",
        ),
        (
            '{"messages": [{"role": "user", "content": "hi \\ud800"}, {"role": "assistant", "content": "ho"}]}',
            r"holds the escape \\ud800, half of a UTF-16 surrogate pair without its other half",
        ),
        ("{'messages': []}", r"is not valid JSON \(Expecting property name enclosed in double quotes at column 2\)"),
    ],
    ids=["nested", "long-integer", "half-a-surrogate-pair", "not-json"],
)
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_conversation_file_json_cannot_read_is_refused_naming_the_line(line, match, suffix, tmp_path):
    path = tmp_path / f"chats{suffix}"
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path.write_text(f"{good}\n{line}\n" if suffix == ".jsonl" else line)
    where = "line 2 " if suffix == ".jsonl" else ""
    with pytest.raises(UserError, match=f"chats{suffix} {where}{match}"):
        list(read_conversations(str(path)))


def test_a_surrogate_pair_escape_reads_as_its_character(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}, ensure_ascii=True) + "\n")  # 🙂 as \ud83d\ude42
    assert "\\ud83d\\ude42" in path.read_text()
    assert [c.messages for c in read_conversations(str(path))] == [CONVERSATIONS[1]]


def test_a_record_with_both_messages_and_conversations_is_refused():
    record = {"messages": CONVERSATIONS[0], "conversations": [{"from": "human", "value": "q"}]}
    with pytest.raises(
        UserError, match='chats.jsonl line 7: both "messages" and ShareGPT\'s "conversations" are given'
    ):
        check_conversation(record, "chats.jsonl line 7")


def test_a_hub_record_reads_the_one_of_its_columns_that_is_not_null():
    """A hub dataset's records hold every column, null where a record has none: not two conversations."""
    sharegpt = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    assert check_conversation({"messages": None, "conversations": sharegpt}, "hub record 1") == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
    ]  # fmt: skip
    assert check_conversation({"messages": CONVERSATIONS[0], "conversations": None}, "hub record 2") == CONVERSATIONS[0]


def test_a_character_vocabulary_without_the_sample_words_finds_its_end_of_turn():
    """end_of_turn renders a sample conversation to find the token after a reply: a character vocabulary
    lacking the letters of its usual words ("Hi", "Hello") renders one of its own letters instead."""
    tokenizer = chat_tokenizer(CharTokenizer("\nabeinrstu"))  # the built-in template's roles: no H, l or o
    assert not set("Hello") <= set(tokenizer.chars)
    assert end_of_turn(tokenizer) == [tokenizer.specials["<|im_end|>"]]
