"""Conversations: reading them, checking them, and turning them into token ids with the mask of the
positions a model is trained on (docs/chat.md).

    conversations = read_conversations("chats.jsonl")           # Conversation(messages, where), checked
    tokenizer = chat_tokenizer(tokenizer)                       # the built-in template, specials added
    ids, trained = render_conversation(messages, tokenizer)     # ids; trained[i]: position i is learnt
    ids = render_prompt(messages, tokenizer)                    # ends where the assistant's reply begins
    stop = end_of_turn(tokenizer)                               # the ids that end a reply

Formats: JSON lines (or a JSON list) of {"messages": [{"role": "system"|"user"|"assistant",
"content": "..."}]}, or ShareGPT's {"conversations": [{"from": "system"|"human"|"gpt", "value":
"..."}]}, read as the first (a record with both is refused); from a local .jsonl/.json file or a
Hugging Face hub dataset.

Templates are jinja2 texts rendered as transformers renders them (a sandboxed environment,
trim_blocks and lstrip_blocks, raise_exception, strftime_now, a tojson that leaves non-ASCII and HTML
characters alone, the tokenizer's named special tokens such as bos_token as variables), so that the
ids of a Hugging Face folder's own template equal `tokenizer.apply_chat_template(messages)`.
Whatever a template raises while it renders is a UserError naming the conversation, and so is a
template that would fill the memory (ChatSandbox, TEMPLATE_MARKUP_CHARS), that renders a
conversation as no text, or that leaves out a message's content.
The tokenizers of this project (characters, GPT-2's BPE, a BPE trained here) get BUILTIN_TEMPLATE,
ChatML, whose special tokens are added after their own ids.

The rendered text becomes ids in pieces: it is split at the special tokens the template itself wrote,
each written as its id, and the text between them is encoded as ordinary text. A message's content is
always ordinary text: a user who types "<|im_end|>" gets the characters, never the token, so no
message can close a turn or forge another role's. (transformers turns such a string into the token;
for every other conversation the ids are the same.)

Which positions are trained comes from the rendering itself, not from knowledge of any one template:
for the i-th message, an assistant's, the conversation up to it rendered with the generation prompt
is a prefix of the conversation up to and including it; the reply is the text between the two, up to
and including the first special token the template writes after the reply's content (the end of the
turn, e.g. <|im_end|> or Llama 3's <|eot_id|>); text it writes after that (ChatML's newline) is not
learnt. A token that starts inside a trained span is trained.
"""

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np

from data.files import parse_json, read_json, read_user_text
from data.tokenizer import END_OF_TEXT, CharTokenizer, JsonTokenizer, Tokenizer, split_specials, with_special_tokens
from errors import UserError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}  # ShareGPT's "from" -> role
# where a record holds its messages, with the keys of a message and its role names -> ours
RECORD_FIELDS = {
    "messages": ("role", "content", {role: role for role in ROLES}),
    "conversations": ("from", "value", SHAREGPT_ROLES),
}
TRAIN_ON = ("assistant", "all", "last")  # every reply, every token, the last reply only
# ChatML, as many models (Qwen, SmolLM2's instruct models) write it; written to exported folders as is
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# the built-in template's special tokens, added to a vocabulary that lacks them (<|endoftext|> separates
# conversations in a dataset, as it separates documents; GPT-2's BPE has it already)
BUILTIN_SPECIALS = (END_OF_TEXT, IM_START, IM_END)
BUILTIN_VARIABLES = {"eos_token": IM_END}  # a reply ends at <|im_end|>: what generation stops at
# the named special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES)
TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CONTENT_MARK = "\ue000{}\ue001"  # private-use characters around a message's number: where its content goes
# A template writes its markup around the messages (a few dozen characters a turn, a default system
# prompt, a date): at most this many characters beyond twice the messages' own text. More is a loop or a
# product that would fill the memory, refused as it grows; a text or list repeated (`*`) is bounded by it too.
TEMPLATE_MARKUP_CHARS = 1 << 20
MAX_POWER_BITS = 1 << 14  # an integer power in a template: more digits (~4,900) than Python prints anyway


class Conversation(NamedTuple):
    messages: list[dict[str, str]]  # {"role": one of ROLES, "content": non-empty text}
    where: str  # for messages: the file and line (or the hub dataset and record)


# ---------------------------------------------------------------------------------------------------------
# reading and checking


def read_conversations(
    spec: str,
    *,
    split: str = "train",
    config_name: str | None = None,
    revision: str | None = None,
    cache_dir: str | None = None,
) -> Iterator[Conversation]:
    """The conversations of a local .jsonl or .json file, or of a hub dataset (through `datasets`,
    refused at once when offline), each checked by check_conversation."""
    path = Path(spec)
    if path.is_file():
        yield from _read_local(path)
        return
    if path.exists() or path.suffix in (".jsonl", ".json") or spec.startswith((".", "/", "~")):
        raise UserError(f"--dataset={spec!r}: give a .jsonl or .json file of conversations, or a hub dataset name")
    import datasets

    from data.sources import check_hub_reachable, hub_offline_errors, read_errors

    check_hub_reachable(spec)
    with read_errors(spec), hub_offline_errors(spec):
        dataset = datasets.load_dataset(spec, config_name, split=split, revision=revision, cache_dir=cache_dir)
    for index, record in enumerate(dataset, start=1):
        yield Conversation(check_conversation(record, f"{spec} record {index}"), f"{spec} record {index}")


def _read_local(path: Path) -> Iterator[Conversation]:
    if path.suffix not in (".jsonl", ".json"):
        raise UserError(
            f"--dataset={str(path)!r}: conversations are read from .jsonl or .json files, not {path.suffix!r}"
        )
    text = read_user_text(path)
    if path.suffix == ".json":
        records = parse_json(text, f"{path}")
        if not isinstance(records, list):
            raise UserError(f"{path} holds a {type(records).__name__}, not a list of conversations")
        numbered = ((f"{path} record {i}", record) for i, record in enumerate(records, start=1))
    else:
        lines = enumerate(text.splitlines(), start=1)
        numbered = ((f"{path} line {n}", parse_json(line, f"{path} line {n}")) for n, line in lines if line.strip())
    empty = True
    for where, record in numbered:
        empty = False
        yield Conversation(check_conversation(record, where), where)
    if empty:
        raise UserError(f"{path} holds no conversations")


def check_conversation(record: object, where: str, need_reply: bool = True) -> list[dict[str, str]]:
    """The messages of a record, as {"role", "content"} dicts, or a UserError naming where, the
    message and the field: a record needs a non-empty list under "messages" or ShareGPT's
    "conversations" (not both: which one is the conversation would be a guess), each message a known
    role and non-empty text, and (need_reply) an assistant turn."""
    if not isinstance(record, dict):
        raise UserError(f'{where}: a conversation is an object with a "messages" list, not {record!r:.60}')
    # a hub dataset's records hold every column of the dataset, None where a record has no value
    given = [field for field in RECORD_FIELDS if record.get(field) is not None]
    if len(given) > 1:
        raise UserError(
            f'{where}: both "messages" and ShareGPT\'s "conversations" are given, and which one is the conversation '
            f"would be a guess (keep one of them)"
        )
    present = given or [field for field in RECORD_FIELDS if field in record]
    if not present:
        fields = ", ".join(map(repr, record)) or "none"
        raise UserError(f'{where}: no "messages" field (nor ShareGPT\'s "conversations"); its fields: {fields}')
    field = present[0]
    role_key, content_key, roles = RECORD_FIELDS[field]
    problem = messages_problem(record[field], role_key, content_key, roles)
    if problem is not None:
        raise UserError(f"{where}: {field}{problem}")
    messages = [{"role": roles[m[role_key]], "content": m[content_key]} for m in record[field]]
    if need_reply and not any(message["role"] == "assistant" for message in messages):
        raise UserError(f"{where}: no assistant message, so nothing to learn (every conversation needs a reply)")
    return messages


def messages_problem(
    raw: object, role_key: str = "role", content_key: str = "content", roles: dict[str, str] | None = None
) -> str | None:
    """What is wrong with a list of messages, as the words that follow the field's name in an error
    line ("[2]: role='bot' is not one of system, user, assistant"), or None: the one check of messages,
    for conversations and for eval.py's generation items alike. roles maps the accepted role names
    (ShareGPT's "from" values) to ours; by default, ours."""
    roles = roles or {role: role for role in ROLES}
    if not isinstance(raw, list) or not raw:
        return f" must be a non-empty list of messages, not {raw!r:.60}"
    for number, message in enumerate(raw, start=1):
        if not isinstance(message, dict):
            return f"[{number}] is {message!r:.60}, not an object with {role_key!r} and {content_key!r}"
        role = message.get(role_key)
        if not isinstance(role, str) or role not in roles:
            return f"[{number}]: {role_key}={role!r:.40} is not one of {', '.join(roles)}"
        content = message.get(content_key)
        if not isinstance(content, str) or not content.strip():
            return f"[{number}]: {content_key}={content!r:.40} is not text (every message needs some)"
    return None


# ---------------------------------------------------------------------------------------------------------
# templates


class ChatTemplate:
    """A chat template (jinja text) and the named token strings it is rendered with."""

    def __init__(self, source: str, variables: dict[str, str]):
        self.source = source
        self.variables = dict(variables)
        self.compiled = compile_template(source)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "ChatTemplate":
        if tokenizer.chat_template is None:
            raise UserError(
                "the model's tokenizer has no chat template (fine-tune it on a chat dataset: "
                "python data/prepare.py --chat, docs/chat.md)"
            )
        return cls(tokenizer.chat_template, tokenizer.template_variables)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False, where: str = "") -> str:
        """The template's text for the messages; a template that fails (see template_errors) or writes
        more than TEMPLATE_MARKUP_CHARS beyond twice the messages' contents is a UserError naming where."""
        limit = TEMPLATE_MARKUP_CHARS + 2 * sum(len(message["content"]) for message in messages)
        pieces, length = [], 0
        with template_errors(f"{where or 'the conversation'}: the chat template cannot render it"):
            for piece in self.compiled.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.variables
            ):
                length += len(piece)
                if length > limit:  # refused as it grows, before it fills the memory
                    raise OverflowError(f"it writes more than {limit:,} characters for {len(messages)} message(s)")
                pieces.append(piece)
        return "".join(pieces)


@contextmanager
def template_errors(what: str) -> Iterator[None]:
    """Whatever a chat template raises, as one UserError: `what`, then the reason. A template is code
    from a model folder or a dataset, so its failures are jinja's (a syntax error, an undefined name,
    its own raise_exception) and Python's alike (a TypeError, a division by zero, the sandbox's
    OverflowError for a range or a product too large, a RecursionError)."""
    import jinja2

    try:
        yield
    except jinja2.TemplateError as e:
        raise UserError(f"{what} ({e})") from None
    except Exception as e:
        raise UserError(f"{what} ({type(e).__name__}: {e})") from None


@lru_cache(maxsize=8)
def compile_template(source: str):
    """The template compiled in the environment transformers renders chat templates in, with products
    and powers bounded (ChatSandbox)."""
    import jinja2
    import jinja2.ext

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False):
        # jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, GenerationTag])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    with template_errors("the chat template is not valid jinja"):
        return environment.from_string(source)


def _chat_sandbox():
    """transformers' environment (jinja's ImmutableSandboxedEnvironment), whose range() already stops
    at 100,000 items, with its two operators that make a large value from small ones bounded too: a
    text or list repeated past TEMPLATE_MARKUP_CHARS (`'a' * 10**10` would take 10 GB before anything
    could refuse it), and an integer power of more than MAX_POWER_BITS (`10 ** (10**10)` would compute for
    hours), each an OverflowError as the sandbox's range() raises."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class ChatSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator: str, left, right):
            if operator == "*":
                for repeated, times in ((left, right), (right, left)):
                    if isinstance(repeated, str | list | tuple) and isinstance(times, int):
                        if len(repeated) * times > TEMPLATE_MARKUP_CHARS:
                            raise OverflowError(
                                f"{repeated!r:.20} * {times} would be {len(repeated) * times:,} long, more than "
                                f"{TEMPLATE_MARKUP_CHARS:,}"
                            )
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if (abs(left).bit_length() - 1) * right > MAX_POWER_BITS:  # a lower bound on the result's bits
                    raise OverflowError(f"{left} ** {right} has more than {MAX_POWER_BITS:,} bits")
            return super().call_binop(context, operator, left, right)

    return ChatSandbox


def _generation_tag():
    """transformers' {% generation %} ... {% endgeneration %} marks assistant text for its own masks;
    here the spans come from the rendering, so the tag only renders its body."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            from jinja2 import nodes

            return nodes.Scope(body, lineno=lineno)

    return Generation


GenerationTag = _generation_tag()
ChatSandbox = _chat_sandbox()


def chat_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The project's own tokenizer (characters, GPT-2's BPE, a trained BPE or a tokenizer.json without a
    template) with the built-in template, its special tokens added after its ids where missing."""
    grown = with_special_tokens(tokenizer, BUILTIN_SPECIALS)
    return grown.with_chat_template(BUILTIN_TEMPLATE, BUILTIN_VARIABLES)


def folder_template(folder: Path) -> tuple[str, dict[str, str]] | None:
    """A Hugging Face model folder's own chat template and named special tokens, as transformers
    reads them: chat_template.jinja, else tokenizer_config.json's chat_template (a string, or the
    list of named templates whose "default" is used); None if it has none."""
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise UserError(f"{config_path} holds a {type(config).__name__}, not an object")
    variables = {}
    for name in TOKEN_VARIABLES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            variables[name] = value
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return read_user_text(jinja_file), variables
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not isinstance(template, str):
        return None
    return template, variables


# ---------------------------------------------------------------------------------------------------------
# rendering into ids


class Rendered(NamedTuple):
    text: str
    ids: list[int]
    starts: list[int]  # the character of text where each token starts
    markup: list[tuple[int, int]]  # (start, end) characters of each special token the template wrote
    contents: list[tuple[int, int]] | None  # each message's content in text, or None where not found


def render_conversation(
    messages: list[dict[str, str]], tokenizer: Tokenizer, train_on: str = "assistant", where: str = ""
) -> tuple[list[int], list[bool]]:
    """The ids of a conversation through the tokenizer's chat template, and which of them are trained:
    train_on="assistant" (every reply and its end-of-turn token), "last" (the last reply only) or
    "all" (every token). The ids are transformers' apply_chat_template(messages, tokenize=True)."""
    if train_on not in TRAIN_ON:
        raise UserError(f"train_on={train_on!r} is not one of {', '.join(TRAIN_ON)}")
    template = ChatTemplate.of(tokenizer)
    rendered = render_ids(template, tokenizer, messages, False, where)
    if train_on == "all":
        return rendered.ids, [True] * len(rendered.ids)
    spans = [
        reply_span(template, messages, i, rendered, where) for i, m in enumerate(messages) if m["role"] == "assistant"
    ]
    if train_on == "last":
        spans = spans[-1:]
    starts = np.array(rendered.starts, dtype=np.int64)
    trained = np.zeros(len(starts), dtype=bool)
    for start, end in spans:
        trained |= (starts >= start) & (starts < end)
    return rendered.ids, trained.tolist()


def render_prompt(messages: list[dict[str, str]], tokenizer: Tokenizer, where: str = "") -> list[int]:
    """The ids of the messages followed by the template's generation prompt: what a model continues
    with the assistant's reply (transformers' apply_chat_template(messages, add_generation_prompt=True))."""
    return render_ids(ChatTemplate.of(tokenizer), tokenizer, messages, True, where).ids


def end_of_turn(tokenizer: Tokenizer) -> list[int]:
    """The ids that end a reply: the special token the template writes after a reply's content
    (<|im_end|>, Llama 3's <|eot_id|>), and the template's eos_token; generation stops at any of them."""
    template = ChatTemplate.of(tokenizer)
    messages = [{"role": "user", "content": hi} for hi in sample_words(tokenizer)]
    messages[1]["role"] = "assistant"
    rendered = render_ids(template, tokenizer, messages, False, "a sample conversation")
    stops = []
    if rendered.contents is not None:
        after = rendered.contents[-1][1]
        first = next((span for span in rendered.markup if span[0] >= after), None)
        if first is not None:
            stops.append(tokenizer.specials[rendered.text[first[0] : first[1]]])
    eos = tokenizer.specials.get(template.variables.get("eos_token", ""))
    if eos is not None and eos not in stops:
        stops.append(eos)
    return stops


def sample_words(tokenizer: Tokenizer) -> tuple[str, str]:
    """Two words the tokenizer encodes, for a sample conversation: "Hi" and "Hello", or, for a
    character vocabulary without their letters, two of its own letters."""
    words = ("Hi", "Hello")
    if not isinstance(tokenizer, CharTokenizer) or set("".join(words)) <= set(tokenizer.chars):
        return words
    letters = [ch for ch in tokenizer.chars if ch.isalpha()]
    return (letters[0], letters[-1]) if letters else words


def reply_span(template: ChatTemplate, messages: list, index: int, rendered: Rendered, where: str) -> tuple[int, int]:
    """The characters of rendered.text that the reply messages[index] adds, through its end of turn."""
    prompt = template.render(messages[:index], add_generation_prompt=True, where=where)
    upto = template.render(messages[: index + 1], where=where)
    if not (upto.startswith(prompt) and rendered.text.startswith(upto)):
        raise UserError(
            f"{where or 'the conversation'}: the chat template renders message {index + 1} differently once "
            f"later messages follow it, so its reply cannot be told apart (train with --train-on all)"
        )
    content_end = rendered.contents[index][1] if rendered.contents is not None else len(prompt)
    end_of_turn = next((end for start, end in rendered.markup if content_end <= start and end <= len(upto)), None)
    return len(prompt), end_of_turn if end_of_turn is not None else len(upto)


def render_ids(
    template: ChatTemplate, tokenizer: Tokenizer, messages: list, add_generation_prompt: bool, where: str
) -> Rendered:
    """The rendered text and its ids (see the module's docstring for how contents are kept ordinary)."""
    text = template.render(messages, add_generation_prompt, where)
    if not text.strip():
        raise UserError(
            f"{where or 'the conversation'}: the chat template renders it as no text at all, so the model would read "
            f"nothing of it (give a template that writes the messages)"
        )
    contents = content_spans(template, messages, text, add_generation_prompt, where)
    markup = [
        (start, end)
        for start, end in special_spans(text, tokenizer.specials)
        if contents is None or not any(a < end and start < b for a, b in contents)
    ]
    ids, starts, position = [], [], 0
    for start, end in [*markup, (len(text), len(text))]:
        if start > position:
            piece_ids, piece_starts = encode_ordinary(tokenizer, text[position:start], where)
            ids.extend(piece_ids)
            starts.extend(position + s for s in piece_starts)
        if end > start:
            ids.append(tokenizer.specials[text[start:end]])
            starts.append(start)
        position = end
    return Rendered(text, ids, starts, markup, contents)


def special_spans(text: str, specials: dict[str, int]) -> list[tuple[int, int]]:
    """Where each special token's string occurs in text (the longest at each place)."""
    spans, position = [], 0
    for piece, special in split_specials(text, specials):
        if special is not None:
            spans.append((position, position + len(piece)))
        position += len(piece)
    return spans


def content_spans(
    template: ChatTemplate, messages: list, text: str, add_generation_prompt: bool, where: str
) -> list[tuple[int, int]] | None:
    """Where each message's content lies in text: the template rendered once more with a mark in place
    of each content shows it, if putting the contents (as they are, or stripped as Llama 3's template
    strips them) back where the marks are gives text again. None if not (then a content's special-token
    strings are read as the tokens, as transformers reads them). A template that leaves a message's
    content out is a UserError: what the message says would be lost without a word."""
    marked = [{**message, "content": CONTENT_MARK.format(i)} for i, message in enumerate(messages)]
    skeleton = re.split(
        "(" + CONTENT_MARK.format(r"(\d+)") + ")", template.render(marked, add_generation_prompt, where)
    )
    written = {int(number) for number in skeleton[2::3]}
    left_out = next((i for i in range(len(messages)) if i not in written), None)
    if left_out is not None:
        message = messages[left_out]
        raise UserError(
            f"{where or 'the conversation'}: the chat template leaves out the content of message {left_out + 1} "
            f"(the {message['role']}'s {message['content']!r:.40}), which would be lost (give a template that writes "
            f"every message whole, or leave that message out)"
        )
    for transform in (str, str.strip):
        rebuilt, spans = [], [None] * len(messages)
        length = 0
        for i, part in enumerate(skeleton):
            if i % 3 == 2:
                continue  # the number captured inside a mark
            if i % 3 == 1:
                number = int(skeleton[i + 1])
                part = transform(messages[number]["content"]) if number < len(messages) else part
                spans[number] = (length, length + len(part))
            rebuilt.append(part)
            length += len(part)
        if "".join(rebuilt) == text and None not in spans:
            return spans
    return None


def encode_ordinary(tokenizer: Tokenizer, text: str, where: str) -> tuple[list[int], list[int]]:
    """The ids of text with every special token's string read as ordinary text, and the character
    where each token starts."""
    try:
        ids = tokenizer.encode_array(text).tolist()
    except UserError as e:
        raise UserError(f"{where or 'the conversation'}: {e}") from None
    if isinstance(tokenizer, JsonTokenizer) and tokenizer.encoding is None:
        offsets = tokenizer.corpus_tokenizer.encode(text, add_special_tokens=False).offsets
        return ids, [start for start, _ in offsets]
    if isinstance(tokenizer, CharTokenizer):
        return ids, list(range(len(text)))
    # byte-level BPE: each token is its bytes; map byte positions to characters
    byte_starts = np.cumsum([0] + [len(tokenizer.token_bytes(token)) for token in ids[:-1]])
    char_of_byte = np.repeat(np.arange(len(text)), [len(ch.encode("utf-8")) for ch in text])
    char_of_byte = np.append(char_of_byte, len(text))
    return ids, char_of_byte[np.minimum(byte_starts, len(char_of_byte) - 1)].tolist()


def folder_chat_tokenizer(folder: Path) -> JsonTokenizer:
    """A Hugging Face model folder's tokenizer.json with the folder's own chat template; a folder
    without one is refused (its model was not trained to converse in any format we could know)."""
    tokenizer = JsonTokenizer.from_file(folder / "tokenizer.json")
    found = folder_template(folder)
    if found is None:
        raise UserError(
            f"{folder} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json): "
            f"give a model folder that has one, or prepare with the model's tokenizer.json alone to use the "
            f"built-in template (docs/chat.md)"
        )
    return tokenizer.with_chat_template(*found)
