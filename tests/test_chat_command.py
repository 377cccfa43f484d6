"""sample.py --chat (inference/chat.py): replies streamed and ended at the end of turn, history kept within
the context, Ctrl-C stopping a reply and not the session, one turn for scripts; and the exported folder
of a chat model, where transformers' apply_chat_template and greedy generate print what --chat prints."""

import io
import subprocess
import sys

import pytest
import torch

from data.conversations import IM_END, chat_tokenizer, render_prompt
from data.corpus import CORPUS_DIR
from data.tokenizer import CharTokenizer
from errors import UserError
from inference.chat import Sampling, chat, fit_history, prompt_room
from inference.load import model_from_checkpoint
from tests.conftest import PROJECT_ROOT, tiny_model
from trainer.checkpoint import load_checkpoint

GREEDY = Sampling(max_new_tokens=12, temperature=0)


def chars() -> CharTokenizer:
    return chat_tokenizer(CharTokenizer.from_text(CORPUS_DIR.joinpath("tinyshakespeare.txt").read_text()))


def lines(*typed):
    """read_line for chat(): each string is a line typed, an exception class is raised there (EOFError
    is Ctrl-D, KeyboardInterrupt is Ctrl-C); after the last, the input ends."""
    queue = list(typed)

    def read_line() -> str:
        if not queue:
            raise EOFError
        line = queue.pop(0)
        if isinstance(line, type):
            raise line
        return line

    return read_line


class ScriptedModel:
    """Makes a model write `reply` (ids) at every turn: its logits at each forward pass pick the next
    id of the reply, starting again at each prompt (a forward pass of more than one position)."""

    def __init__(self, model, reply: list[int]):
        self.reply, self.at = reply, 0
        self.prompts = []  # the ids of each prompt the model was given
        model.register_forward_pre_hook(self.before)
        model.lm_head.register_forward_hook(self.after)

    def before(self, module, args):
        if args[0].size(1) > 1:
            self.at = 0
            self.prompts.append(args[0][0].tolist())

    def after(self, module, inputs, logits):
        logits = torch.full_like(logits, -1e9)
        logits[..., self.reply[min(self.at, len(self.reply) - 1)]] = 0
        self.at += 1
        return logits


def scripted(reply_text: str, block_size: int = 64):
    tokenizer = chars()
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=block_size)
    script = ScriptedModel(model, [*tokenizer.encode(reply_text), tokenizer.specials[IM_END]])
    return model, tokenizer, script


def talk(model, tokenizer, *typed, out=None, sampling=GREEDY, **options):
    out, notes = out or io.StringIO(), io.StringIO()
    generator = torch.Generator().manual_seed(0)
    messages = chat(model, tokenizer, sampling, generator, lines(*typed), out=out, notes=notes, **options)
    return messages, out.getvalue(), notes.getvalue()


def test_each_reply_is_streamed_until_the_end_of_turn_and_joins_the_conversation():
    model, tokenizer, script = scripted("d o g", block_size=128)
    messages, out, _ = talk(model, tokenizer, "spell: dog", "", "again", system="Be brief.")
    assert out == "d o g\nd o g\n"  # the end-of-turn token ends each reply and is not shown
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "spell: dog"},
        {"role": "assistant", "content": "d o g"},
        {"role": "user", "content": "again"},  # the empty line was no turn
        {"role": "assistant", "content": "d o g"},
    ]
    # each turn's prompt is the whole conversation through the template, ending in the generation prompt
    assert script.prompts == [render_prompt(messages[:2], tokenizer), render_prompt(messages[:4], tokenizer)]


def test_one_turn_with_first_answers_and_ends():
    model, tokenizer, _ = scripted("god")
    messages, out, _ = talk(model, tokenizer, "never read", first="reverse: dog")
    assert out == "god\n" and [m["content"] for m in messages] == ["reverse: dog", "god"]


def test_replies_and_notes_go_to_the_standard_streams_of_the_call_not_of_the_import(monkeypatch):
    """chat() looks sys.stdout and sys.stderr up when called: a program (or a test) that replaces them
    after importing it gets the reply, not the streams of the moment the module was first imported."""
    model, tokenizer, _ = scripted("god")
    out, notes = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", notes)
    chat(model, tokenizer, GREEDY, torch.Generator().manual_seed(0), lines(), first="reverse: dog")
    assert out.getvalue() == "god\n"


def test_the_oldest_turns_leave_the_context_with_a_note_and_the_system_message_stays():
    model, tokenizer, script = scripted("a b c d e f", block_size=96)
    questions = [f"spell: {word}" for word in ("abcdef", "ghijkl", "mnopqr", "stuvwx")]
    messages, _, notes = talk(model, tokenizer, *questions, system="Be brief.")
    room = prompt_room(96, GREEDY.max_new_tokens)
    assert all(len(prompt) <= room for prompt in script.prompts)
    assert "oldest messages no longer fit in the model's 96-token context" in notes
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[-2]["content"] == questions[-1] and len(messages) < 1 + 2 * len(questions)
    assert script.prompts[-1] == render_prompt(messages[:-1], tokenizer)


def test_a_turn_too_long_for_the_context_is_refused_and_the_conversation_goes_on():
    model, tokenizer, _ = scripted("ok")
    messages, out, notes = talk(model, tokenizer, "x" * 80, "hi")
    assert "but the model reads 52 tokens before its reply: write a shorter one" in notes
    assert out == "ok\n" and [m["content"] for m in messages] == ["hi", "ok"]
    with pytest.raises(UserError, match="write a shorter one"):
        fit_history([{"role": "user", "content": "x" * 80}], tokenizer, 52)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"first": "   "}, r"--prompt='   ' is blank: with --chat, --prompt is the one message the model answers"),
        ({"first": ""}, r"--prompt='' is blank"),
        ({"system": ""}, r"--system='' is blank, and a system message needs text as every message does"),
        ({"system": " \n"}, r"--system=' \\n' is blank"),
    ],
    ids=["blank-prompt", "empty-prompt", "empty-system", "blank-system"],
)
def test_a_blank_system_or_one_turn_message_is_refused_not_skipped(options, match):
    """A blank --prompt was skipped as a blank typed line is, and came back for ever; an empty --system was
    left out of the conversation without a word."""
    model, tokenizer, script = scripted("ok")
    with pytest.raises(UserError, match=match):
        talk(model, tokenizer, "hi", **options)
    assert script.prompts == []


def test_a_template_that_fails_on_the_one_turn_is_one_user_error():
    model, tokenizer, _ = scripted("ok")
    tokenizer.with_chat_template("{{ 1/0 }}", {})
    with pytest.raises(UserError, match=r"the chat template cannot render it \(ZeroDivisionError: division by zero\)"):
        talk(model, tokenizer, first="hi")


class CtrlCAfter(io.StringIO):
    """Standard output where Ctrl-C is pressed once, after `after` writes."""

    def __init__(self, after: int):
        super().__init__()
        self.writes = after

    def write(self, text: str) -> int:
        self.writes -= 1
        if self.writes == -1:
            raise KeyboardInterrupt
        return super().write(text)


def test_ctrl_c_stops_the_reply_in_progress_not_the_session():
    model, tokenizer, _ = scripted("d o g", block_size=128)
    messages, out, notes = talk(model, tokenizer, "spell: dog", "again", out=CtrlCAfter(2))
    assert out == "d \nd o g\n" and "(reply stopped)" in notes
    assert [m["content"] for m in messages] == ["spell: dog", "d ", "again", "d o g"]  # what was shown is kept


def test_ctrl_c_once_at_the_prompt_goes_on_and_twice_ends():
    model, tokenizer, _ = scripted("ok")
    messages, out, notes = talk(model, tokenizer, KeyboardInterrupt, "hi", KeyboardInterrupt, KeyboardInterrupt, "no")
    assert out == "ok\n" and notes.count("Ctrl-C again, or Ctrl-D") == 2
    assert [m["content"] for m in messages] == ["hi", "ok"]


def test_chat_refuses_a_model_without_a_template():
    tokenizer = CharTokenizer.from_text("abc")
    with pytest.raises(UserError, match="has no chat template, so it cannot tell turns apart"):
        talk(tiny_model(vocab_size=3), tokenizer, "hi")


# --- a chat run, sampled through sample.py and exported ---------------------------------------------------


def run_sample(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(PROJECT_ROOT / "sample.py"), "--device", "cpu", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PROJECT_ROOT,
    )


def test_sample_py_chat_reads_turns_from_stdin_as_the_function_does(chat_run):
    result = run_sample("--out-dir", str(chat_run), "--chat", "--temperature", "0", "--max-new-tokens", "10",
                        "--system", "Be brief.", stdin="spell: dog\nspell: cat\n")  # fmt: skip
    assert result.returncode == 0, result.stderr
    model, tokenizer = model_from_checkpoint(load_checkpoint(chat_run / "ckpt.pt"), chat_run)
    _, out, _ = talk(model, tokenizer, "spell: dog", "spell: cat", system="Be brief.", sampling=Sampling(10, 0))
    assert result.stdout == out and result.stdout.count("\n") == 2
    assert "chatting with" in result.stderr


def test_sample_py_chat_prompt_answers_one_turn(chat_run):
    result = run_sample("--out-dir", str(chat_run), "--chat", "--prompt", "spell: dog", "--temperature", "0",
                        "--max-new-tokens", "10", stdin="never read\n")  # fmt: skip
    model, tokenizer = model_from_checkpoint(load_checkpoint(chat_run / "ckpt.pt"), chat_run)
    _, out, _ = talk(model, tokenizer, first="spell: dog", sampling=Sampling(10, 0))
    assert result.returncode == 0 and result.stdout == out and result.stdout.count("\n") == 1


@pytest.mark.parametrize("message", ["   ", ""])
def test_sample_py_chat_refuses_a_blank_prompt_at_once(chat_run, message):
    """`--chat --prompt "   "` spun for ever, and `--prompt ""` read turns from stdin instead of answering one."""
    result = run_sample("--out-dir", str(chat_run), "--chat", "--prompt", message, stdin="spell: dog\n")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        f"error: --prompt={message!r} is blank: with --chat, --prompt is the one message the model answers, and a "
        f"message needs text (write the message, or leave --prompt out to chat turn by turn)"
    ]


def test_sample_py_with_an_empty_prompt_samples_as_without_one(chat_run):
    """Plain sampling: --prompt "" is the default prompt, the start of a document (docs/sampling.md)."""
    options = ("--out-dir", str(chat_run), "--temperature", "0", "--max-new-tokens", "10")
    empty, left_out = run_sample(*options, "--prompt", ""), run_sample(*options)
    assert empty.returncode == 0 and left_out.returncode == 0, empty.stderr + left_out.stderr
    assert empty.stdout == left_out.stdout and empty.stdout.startswith("<|endoftext|>")


# --- exported: transformers' apply_chat_template and greedy generate print what --chat prints -----------


def build_llama3_folder(folder):
    """A tiny random Llama with a byte-level BPE that has Llama 3's special tokens and chat template."""
    import tokenizers
    import transformers
    from tokenizers import Regex, pre_tokenizers

    from tests.test_chat import FAMILIES, TRAINING_TEXT

    spec = FAMILIES["llama3"]
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"), pre_tokenizers.ByteLevel(use_regex=False)]
    )
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=spec["template"],
                                                     **spec["names"])  # fmt: skip
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def their_reply(folder, message: str, max_new_tokens: int) -> str:
    """transformers' greedy reply to one user message, as the model card's chat example writes it."""
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("source", ["char run", "gpt2 bpe", "llama3 folder"])
def test_exported_chat_model_replies_in_transformers_as_chat_does(source, chat_run, tmp_path):
    from data.tokenizer import GPT2Tokenizer
    from interop.pretrained import export_model, model_from_pretrained

    if source == "char run":
        model, tokenizer = model_from_checkpoint(load_checkpoint(chat_run / "ckpt.pt"), chat_run)
    elif source == "gpt2 bpe":
        tokenizer = chat_tokenizer(GPT2Tokenizer())
        model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=64)
    else:
        model, tokenizer, _ = model_from_pretrained(str(build_llama3_folder(tmp_path / "llama")), "--init-from")
    message, new_tokens = "spell: dog", 20
    _, ours, _ = talk(model, tokenizer, first=message, sampling=Sampling(new_tokens, 0))
    export_model(model, tokenizer, tmp_path / "exported")
    assert their_reply(tmp_path / "exported", message, new_tokens) + "\n" == ours
    if source == "llama3 folder":  # and the folder it was imported from
        assert their_reply(tmp_path / "llama", message, new_tokens) + "\n" == ours
