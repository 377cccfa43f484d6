"""Talking to a model fine-tuned on conversations: sample.py --chat (docs/chat.md, "Talking to it").

Each turn, the conversation so far (the --system message, then the user's and the model's turns)
goes through the model's chat template with the generation prompt (data/conversations.py's render_prompt,
as eval.py renders its generation items), and the reply is streamed until the template's end-of-turn
token (or the end-of-text token, or max_new_tokens); other special tokens a model writes inside a
reply (a template's markup) are not shown, as transformers' decode(skip_special_tokens=True) leaves
them out. The reply joins the conversation as the assistant's message.

The model sees at most block_size tokens. A prompt may take up to block_size - min(max_new_tokens,
block_size // 4) of them, so that a reply has room: the oldest turns (a user's message and the reply
to it) are left out until it fits, with a note on stderr; the system message always stays. A turn that
does not fit even alone is refused with a note, and the conversation goes on. A reply longer than the
room left slides the context as sample.py does.

Ctrl-C stops the reply in progress: what was shown of it is kept as the reply (a reply stopped
before its first character is dropped with its question). At the prompt, Ctrl-C once says how to end;
a second one in a row, or Ctrl-D (the end of input), ends the session.
"""

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch

from data.conversations import end_of_turn, render_prompt
from data.tokenizer import StreamDecoder, Tokenizer
from errors import UserError
from model import GPT, generate


@dataclass(frozen=True)
class Sampling:
    """How a reply is drawn, as sample.py's options say."""

    max_new_tokens: int = 500
    temperature: float = 0.8  # 0 is greedy
    top_k: int | None = 200
    top_p: float = 1.0
    use_cache: bool = True
    compile: bool = False
    step: Callable | None = None  # the one-token step (inference/decode_step.py); None: the model's forward


def check_chat_model(tokenizer: Tokenizer, source: object) -> None:
    """A model without a chat template was never taught where a turn begins or ends: refused by name."""
    if tokenizer.chat_template is None:
        raise UserError(
            f"--chat: the model in {source} has no chat template, so it cannot tell turns apart (fine-tune it on "
            f"conversations first: python data/prepare.py --chat, docs/chat.md; or sample it without --chat)"
        )


def check_messages(system: str | None, first: str | None) -> None:
    """The system message and the one message to answer, where given, hold text, as every message of
    a conversation file must: an empty --system is refused rather than left out (the model would read
    a conversation without the system message it was given), and a blank --prompt rather than
    skipped (there would be no message to answer, and no reply to end on)."""
    if system is not None and not system.strip():
        raise UserError(
            f"--system={system!r} is blank, and a system message needs text as every message does (write the "
            f"message, or leave --system out)"
        )
    if first is not None and not first.strip():
        raise UserError(
            f"--prompt={first!r} is blank: with --chat, --prompt is the one message the model answers, and a "
            f"message needs text (write the message, or leave --prompt out to chat turn by turn)"
        )


def prompt_room(block_size: int, max_new_tokens: int) -> int:
    """The most tokens a prompt may take, leaving a reply room in the context."""
    return block_size - min(max_new_tokens, block_size // 4)


def fit_history(messages: list[dict[str, str]], tokenizer: Tokenizer, room: int) -> tuple[list[int], int]:
    """The prompt ids of the conversation, after leaving out its oldest turns (a user's message and the
    reply to it; a system message stays) until they are at most `room` tokens, and how many messages
    were left out. The last message, the user's turn to answer, is never left out: a UserError says so
    when it does not fit."""
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system) :]
    dropped = 0
    while True:
        ids = render_prompt(system + turns, tokenizer)
        if len(ids) <= room:
            return ids, dropped
        if len(turns) == 1:
            raise UserError(
                f"the message is {len(ids)} tokens with the template{' and the system message' if system else ''}, "
                f"but the model reads {room} tokens before its reply: write a shorter one"
            )
        turns, dropped = turns[2:], dropped + 2


def reply_stops(tokenizer: Tokenizer) -> set[int]:
    """The tokens a reply ends at: the template's end of turn, and the end of text."""
    stops = set(end_of_turn(tokenizer))
    if tokenizer.eot_token is not None:
        stops.add(tokenizer.eot_token)
    return stops


def stream_reply(
    model: GPT,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    sampling: Sampling,
    generator: torch.Generator,
    out: TextIO,
) -> tuple[str, bool]:
    """Generate a reply to the prompt, writing it to out as it comes; returns its text and whether it
    ended by itself (False: a Ctrl-C stopped it)."""
    stops = reply_stops(tokenizer)
    markup = set(tokenizer.specials.values())  # a template's own tokens are not text: not shown, as transformers
    decoder = StreamDecoder(tokenizer, ())  # skips them in decode(..., skip_special_tokens=True)
    pieces = []
    device = generator.device
    steps = generate(  # ended here, at the first of the stops: generate's stop_token takes one
        model,
        torch.tensor([prompt_ids], device=device),
        sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        vocab_size=tokenizer.vocab_size,
        generators=[generator],
        use_cache=sampling.use_cache,
        compile=sampling.compile,
        step=sampling.step,
    )
    try:
        for tokens in steps:
            token = int(tokens[0])
            if token in stops:
                break
            if token in markup:
                continue
            text = decoder.feed(token)
            out.write(text)
            out.flush()
            pieces.append(text)  # once shown: a Ctrl-C while writing it leaves it out
        text = decoder.flush()
        out.write(text + "\n")
        out.flush()
        return "".join(pieces) + text, True
    except KeyboardInterrupt:
        steps.close()
        out.write("\n")
        out.flush()
        return "".join(pieces), False


def chat(
    model: GPT,
    tokenizer: Tokenizer,
    sampling: Sampling,
    generator: torch.Generator,
    read_line: Callable[[], str],
    system: str | None = None,
    first: str | None = None,
    out: TextIO | None = None,
    notes: TextIO | None = None,
) -> list[dict[str, str]]:
    """A conversation with the model: each line read_line returns is the user's turn (EOFError ends the
    session, KeyboardInterrupt twice in a row too; a blank line is passed over), and the reply is
    streamed to out (standard output; notes to standard error), each looked up at the call, not at
    import. With `first`, the model answers that one message and the session ends (sample.py --chat
    --prompt). A blank `system` or `first` is a UserError (check_messages). Returns the conversation
    as it was kept."""
    out, notes = out or sys.stdout, notes or sys.stderr
    check_chat_model(tokenizer, "this run")
    check_messages(system, first)
    messages = [{"role": "system", "content": system}] if system is not None else []
    room = prompt_room(model.config.block_size, sampling.max_new_tokens)
    interrupted = False
    while True:
        if first is not None:
            line = first
        else:
            try:
                line = read_line()
            except EOFError:
                return messages
            except KeyboardInterrupt:
                if interrupted:
                    return messages
                interrupted = True
                notes.write("\n(Ctrl-C again, or Ctrl-D, ends the conversation)\n")
                continue
        interrupted = False
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            prompt_ids, dropped = fit_history(messages, tokenizer, room)
        except UserError as e:
            if first is not None:
                raise
            notes.write(f"({e})\n")
            messages.pop()
            continue
        if dropped:
            start = 1 if system is not None else 0
            del messages[start : start + dropped]
            notes.write(
                f"(the {dropped} oldest messages no longer fit in the model's {model.config.block_size}-token "
                f"context and are left out)\n"
            )
        reply, ended = stream_reply(model, tokenizer, prompt_ids, sampling, generator, out)
        if not ended:
            notes.write("(reply stopped)\n")
        if reply.strip():
            messages.append({"role": "assistant", "content": reply})
        else:
            messages.pop()  # a reply with no text is no turn: its question goes with it
        if first is not None:
            return messages


def chat_in_terminal(
    model: GPT, tokenizer: Tokenizer, args, source: object, products: str, step: Callable | None = None
) -> None:
    """sample.py --chat: the conversation on stdin and stdout (notes on stderr); --prompt answers one
    message. args: sample.py's options; source: where the model came from; products: how its matrix
    products run, for the start-up line; step: the one-token step (None: the model's forward)."""
    check_chat_model(tokenizer, source)
    device = model.transformer.wte.weight.device
    sampling = Sampling(
        args.max_new_tokens,
        args.temperature,
        args.top_k or None,
        args.top_p,
        not args.no_cache,
        args.compile and step is None,  # a decoding step (compiled or not) replaces generate's compiled model
        step,
    )
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if args.prompt is None:
        print(
            f"chatting with {source} on {device.type}, {products}: Ctrl-C stops a reply, Ctrl-D ends", file=sys.stderr
        )
    prompt = "> " if sys.stdin.isatty() else ""  # typed turns get a prompt; piped ones keep stdout to replies
    chat(model, tokenizer, sampling, generator, lambda: input(prompt), args.system, args.prompt)
