"""serve.py, as programs meet it: started as a command on a tiny chat run, and spoken to with OpenAI's own
Python client (or raw HTTP where the bytes on the wire are the point). A served reply is sample.py's
reply; streamed, it is the same text; requests decoded together get what each gets alone."""

import io
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import pytest
import torch

from data.conversations import render_prompt
from inference.load import model_from_checkpoint
from tests.conftest import PROJECT_ROOT, run_entry_point, run_script
from trainer.checkpoint import load_checkpoint

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

STARTUP_SECONDS = 120  # a busy machine imports torch slowly
KEY = "s3cret-key"  # the module's server asks for it, so that every test also sends it


@pytest.fixture(scope="module")
def run_dir(chat_run, tmp_path_factory) -> Path:
    """The tiny chat run with noise added to its weights: its greedy replies are varied text rather than the
    spaces of a model trained for a few steps, so that equal replies say something."""
    folder = tmp_path_factory.mktemp("served") / "speller"
    folder.mkdir()
    checkpoint = torch.load(chat_run / "ckpt.pt", weights_only=True)
    generator = torch.Generator().manual_seed(0)
    for tensor in checkpoint["model"].values():
        tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.5)
    torch.save(checkpoint, folder / "ckpt.pt")
    return folder


class Served:
    """serve.py in a subprocess of its own; its stderr is kept, read by a thread so the pipe never fills.
    `http` speaks to it with the key given."""

    def __init__(self, *args: str, key: str | None = None):
        command = [sys.executable, str(PROJECT_ROOT / "serve.py"), "--port", "0", "--device", "cpu", *args]
        self.process = subprocess.Popen(command, cwd=PROJECT_ROOT, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            found = re.search(r"at (http://\S+/) on ", line)
            if found:
                self.url, self.key = found.group(1), key
                headers = {} if key is None else {"Authorization": f"Bearer {key}"}
                self.http = httpx.Client(base_url=self.url, headers=headers, timeout=120)
                return
            assert self.process.poll() is None or not self.lines.empty(), "".join(self.log)

    def _read(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            self.lines.put(line)

    def client(self, api_key: str | None = None) -> "openai.OpenAI":
        api_key = api_key or self.key or "none"
        return openai.OpenAI(base_url=self.url + "v1", api_key=api_key, max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def server(run_dir, tmp_path_factory):
    """The one server of the module's tests (but SIGTERM's), asking for an API key read from a file."""
    key_file = tmp_path_factory.mktemp("key") / "key.txt"
    key_file.write_text(KEY + "\n")
    served = Served("--out-dir", str(run_dir), "--max-batch", "4", "--max-tokens", "100000", "--api-key-file",
                    str(key_file), key=KEY)  # fmt: skip
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tokenizer(run_dir):
    return model_from_checkpoint(load_checkpoint(run_dir / "ckpt.pt"), run_dir)[1]


def sample_py(monkeypatch, *args: str) -> str:
    """What sample.py writes to stdout: run in this process as `python sample.py` runs it, or with --chat
    (whose terminal chat keeps the stdout of its first import) in a subprocess."""
    if "--chat" in args:
        result = run_script("sample.py", "--device", "cpu", *args)
        assert result.returncode == 0, result.stderr
        return result.stdout
    out = io.StringIO()
    with redirect_stdout(out):
        assert run_entry_point("sample.py", ["--device", "cpu", *args], monkeypatch) == 0
    return out.getvalue()


def user(message: str) -> list[dict]:
    return [{"role": "user", "content": message}]


def test_the_model_is_listed_by_its_run_name(server):
    assert [model.id for model in server.client().models.list()] == ["speller"]


def test_a_greedy_chat_reply_is_sample_py_chats_reply(server, run_dir, monkeypatch):
    system, message = "Spell.", "spell: dog"
    reply = server.client().chat.completions.create(
        model="speller", messages=[{"role": "system", "content": system}, *user(message)], temperature=0, max_tokens=30
    )
    printed = sample_py(monkeypatch, "--out-dir", str(run_dir), "--chat", "--system", system, "--prompt", message,
                        "--temperature", "0", "--max-new-tokens", "30")  # fmt: skip
    assert reply.choices[0].message.content + "\n" == printed
    assert len(set(printed)) > 3  # varied text, not a run of one character


def test_a_greedy_completion_is_sample_py_sample(server, run_dir, monkeypatch):
    reply = server.client().completions.create(model="speller", prompt="ROMEO:", temperature=0, max_tokens=30)
    printed = sample_py(monkeypatch, "--out-dir", str(run_dir), "--prompt", "ROMEO:", "--temperature", "0",
                        "--max-new-tokens", "30")  # fmt: skip
    assert "ROMEO:" + reply.choices[0].text + "\n" == printed
    assert reply.choices[0].finish_reason == "length" and len(set(printed)) > 3


def test_choices_with_a_seed_are_sample_py_samples_with_that_seed(server, run_dir, monkeypatch):
    """Choice i is drawn with seed + i, as sample.py draws sample i: reproducible, and sample.py's."""
    client = server.client()
    options = {"model": "speller", "prompt": "JULIET:", "temperature": 1.0, "max_tokens": 20, "n": 3, "seed": 42}
    first = [choice.text for choice in client.completions.create(**options).choices]
    again = [choice.text for choice in client.completions.create(**options).choices]
    printed = sample_py(monkeypatch, "--out-dir", str(run_dir), "--prompt", "JULIET:", "--temperature", "1",
                        "--top-k", "0", "--max-new-tokens", "20", "--num-samples", "3", "--seed", "42")  # fmt: skip
    samples = [sample.removeprefix("JULIET:").removesuffix("\n") for sample in printed.split("\n" + "-" * 40 + "\n")]
    assert first == again == samples and len(set(first)) == 3
    third_alone = client.completions.create(**options | {"n": 1, "seed": 44}).choices[0].text
    assert third_alone == first[2]


def test_a_seeded_chat_reply_is_sample_py_chats_with_that_seed(server, run_dir, monkeypatch):
    reply = server.client().chat.completions.create(
        model="speller", messages=user("spell: cat"), temperature=0.8, top_p=0.9, seed=7, max_tokens=20,
        extra_body={"top_k": 5},
    )  # fmt: skip
    printed = sample_py(monkeypatch, "--out-dir", str(run_dir), "--chat", "--prompt", "spell: cat", "--seed", "7",
                        "--temperature", "0.8", "--top-p", "0.9", "--top-k", "5", "--max-new-tokens", "20")  # fmt: skip
    assert reply.choices[0].message.content + "\n" == printed


def chunks_of(server, path: str, body: dict) -> list:
    """The data lines of a stream, read as raw server-sent events: each chunk parsed, [DONE] as is."""
    with server.http.stream("POST", path, json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode("utf-8")
    events = text.split("\n\n")
    assert events[-1] == "" and all(event.startswith("data: ") for event in events[:-1]), text
    return [event[6:] if event == "data: [DONE]" else json.loads(event[6:]) for event in events[:-1]]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_a_stream_is_openais_chunks_of_the_same_text(server, chat):
    request = {"model": "speller", "temperature": 0.9, "seed": 3, "n": 2, "max_tokens": 25}
    request |= {"messages": user("spell: goat")} if chat else {"prompt": "KING:"}
    path = "v1/chat/completions" if chat else "v1/completions"
    whole = server.http.post(path, json=request).json()
    chunks = chunks_of(server, path, request | {"stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    usage, chunks = chunks[-2], chunks[:-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert len({chunk["id"] for chunk in [*chunks, usage]}) == 1
    for index, expected in enumerate(whole["choices"]):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert all(choice["finish_reason"] is None for choice in mine[:-1])
        assert mine[-1]["finish_reason"] == expected["finish_reason"]
        if chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(choice["delta"].get("content", "") for choice in mine)
            assert text == expected["message"]["content"]
        else:
            assert "".join(choice["text"] for choice in mine) == expected["text"]


def test_the_client_reads_a_stream_as_the_whole_reply(server):
    client = server.client()
    options = {"model": "speller", "messages": user("spell: deer"), "temperature": 0, "max_tokens": 30}
    whole = client.chat.completions.create(**options).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**options, stream=True)
    )
    assert streamed == whole


def test_usage_counts_the_tokenizers_tokens(server, tokenizer):
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, *user("spell: bee")]
    chat = client.chat.completions.create(model="speller", messages=messages, temperature=0, max_tokens=30)
    assert chat.usage.prompt_tokens == len(render_prompt(messages, tokenizer))
    # a reply ended by its end-of-turn token drew that token too; one cut at max_tokens drew max_tokens
    ended_by_token = 1 if chat.choices[0].finish_reason == "stop" else 0
    assert chat.usage.completion_tokens == len(tokenizer.encode(chat.choices[0].message.content)) + ended_by_token
    text = client.completions.create(model="speller", prompt=["ROMEO:", "To be"], temperature=0, max_tokens=12, n=2)
    assert text.usage.prompt_tokens == len(tokenizer.encode("ROMEO:")) + len(tokenizer.encode("To be"))
    assert text.usage.completion_tokens == 4 * 12
    assert text.usage.total_tokens == text.usage.prompt_tokens + text.usage.completion_tokens


def test_a_stop_string_across_tokens_ends_the_reply_before_it(server):
    client = server.client()
    options = {"model": "speller", "prompt": "ROMEO:", "temperature": 0, "max_tokens": 30}
    whole = client.completions.create(**options).choices[0].text
    stop = whole[10:13]  # three characters, three tokens
    expected = whole[: whole.index(stop)]
    stopped = client.completions.create(**options, stop=["\x00never", stop])
    assert stopped.choices[0].text == expected and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**options, stop=stop, stream=True))
    assert streamed == expected


def test_concurrent_requests_each_get_the_reply_they_get_alone(server):
    """Eight requests at once for four rows: they join and leave the batch at different steps, and wait
    their turn; each reply is what the request gets on its own."""
    client = server.client()
    requests = [
        {"prompt": prompt, "max_tokens": length, "temperature": 0}
        for prompt, length in zip(["ROMEO:", "To be, or", "O", "JULIET: my", "KING", "A", "Good morrow", "What"],
                                  [30, 7, 19, 40, 3, 25, 12, 33], strict=True)
    ] + [{"prompt": "HAMLET:", "max_tokens": 20, "temperature": 1.0, "seed": 5}]  # fmt: skip
    alone = [client.completions.create(model="speller", **request).choices[0].text for request in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: client.completions.create(model="speller", **r).choices[0].text, requests))
    assert together == alone


def test_a_client_that_goes_away_frees_its_row(server):
    body = {"model": "speller", "prompt": "ROMEO:", "max_tokens": 100_000, "temperature": 0, "stream": True}
    with server.http.stream("POST", "v1/completions", json=body) as response:
        next(response.iter_lines())
    deadline = time.monotonic() + 30
    while server.http.get("health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.http.get("health").json() == {"status": "ok", "running": 0, "waiting": 0}, "".join(server.log)


def test_a_reply_sends_a_character_once_its_bytes_are_complete_and_holds_back_a_stop_string():
    """The engine's text of one choice, as its tokens come: each event whole characters, never a stop
    string's beginning until it is known not to be one."""
    from data.tokenizer import GPT2Tokenizer
    from server.engine import Choice, Reply

    class Events(list):
        send = list.append

    tokenizer = GPT2Tokenizer()
    text = " 日本語 and 語る"
    ids = tokenizer.encode(text)
    choice = Choice(ids[:1], max_tokens=len(ids), temperature=0, top_k=None, top_p=1.0, seed=0,
                    stop_tokens=frozenset(), stops=(" and 語",))  # fmt: skip
    events = Events()
    reply = Reply(choice, 0, tokenizer, events)
    fed = 0
    while not reply.accept(ids[fed]):  # as the decoder feeds it: until it says the reply has ended
        fed += 1
    assert fed < len(ids) - 1  # it ended at the stop string, before the last token
    assert all("\ufffd" not in event.text for event in events) and len(events) > 1
    assert "".join(event.text for event in events) == " 日本語"
    assert events[-1].finish_reason == "stop" and events[-1].tokens == fed + 1


ERRORS = {
    "bad-value": ("v1/completions", {"model": "speller", "prompt": "a", "temperature": 5}, 400, "temperature"),
    "unknown-field": ("v1/completions", {"model": "speller", "prompt": "a", "logprobs": 2}, 400, "logprobs"),
    "missing-field": ("v1/chat/completions", {"model": "speller"}, 400, "messages"),
    "n-above-the-limit": ("v1/completions", {"model": "speller", "prompt": "a", "n": 9}, 400, "n"),
    "max-tokens-above-the-limit": ("v1/completions", {"model": "speller", "max_tokens": 100_001}, 400, "max_tokens"),
    "blank-message": ("v1/chat/completions", {"model": "speller", "messages": user(" ")}, 400, "messages.0.content"),
    "too-many-stops": ("v1/completions", {"model": "speller", "stop": list("abcde")}, 400, "stop"),
    "unknown-model": ("v1/completions", {"model": "gpt-4o", "prompt": "a"}, 404, "model"),
    "prompt-past-the-context": ("v1/completions", {"model": "speller", "prompt": "a" * 65}, 400, "prompt"),
    "chat-past-the-context": ("v1/chat/completions", {"model": "speller", "messages": user("a" * 40)}, 400, "messages"),
    "unknown-character": ("v1/completions", {"model": "speller", "prompt": "€"}, 400, "prompt"),
}


@pytest.mark.parametrize(("path", "body", "status", "param"), ERRORS.values(), ids=ERRORS.keys())
def test_a_bad_request_gets_openais_error_object_and_status(server, path, body, status, param):
    response = server.http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert "Traceback" not in response.text
    if "past-the-context" in path or param in ("prompt", "messages") and "a" * 40 in json.dumps(body):
        assert error["code"] == "context_length_exceeded"


def test_the_client_raises_the_error_the_status_means(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4o", prompt="a")
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|block_size=64"):
        client.completions.create(model="speller", prompt="a" * 65)
    with pytest.raises(openai.NotFoundError, match="no such route"):
        client.embeddings.create(model="speller", input="a")


def test_a_body_that_is_not_json_or_too_large_gets_an_error_object(server):
    response = server.http.post("v1/completions", content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = server.http.post("v1/completions", data={"model": "speller"})  # a form
    assert response.status_code == 400 and "Content-Type: application/json" in response.json()["error"]["message"]
    response = server.http.post("v1/completions", content=b"x" * (2**21 + 1))
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    response = server.http.delete("v1/models")
    assert response.status_code == 405 and "error" in response.json()


def test_an_api_key_is_refused_when_missing_or_wrong_and_accepted_when_right(server):
    options = {"model": "speller", "prompt": "ROMEO:", "max_tokens": 3}
    with pytest.raises(openai.AuthenticationError, match="the API key is not this server's"):
        server.client(api_key="wrong").completions.create(**options)
    response = httpx.post(server.url + "v1/completions", json=options, timeout=60)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert "no API key was given" in response.json()["error"]["message"]
    assert httpx.get(server.url + "health", timeout=60).status_code == 401
    accepted = server.client(api_key=KEY).completions.create(**options)
    assert accepted.usage.completion_tokens == 3
    assert httpx.get(server.url, timeout=60).status_code == 200  # the page, which holds nothing, opens without it


def test_sigterm_finishes_the_replies_in_progress_then_exits(run_dir):
    served = Served("--out-dir", str(run_dir))
    try:
        body = {"model": "speller", "prompt": "ROMEO:", "max_tokens": 25, "temperature": 0, "stream": True}
        whole = httpx.post(served.url + "v1/completions", json=body | {"stream": False}, timeout=120).json()
        with httpx.stream("POST", served.url + "v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(lines)
            served.process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]" and "".join(texts) == whole["choices"][0]["text"]
        assert served.process.wait(timeout=30) == -signal.SIGTERM
        assert "stopping: the replies in progress get 5 s to finish" in "".join(served.log)
        with pytest.raises(httpx.ConnectError):
            httpx.get(served.url + "health", timeout=5)
    finally:
        served.stop()


# --- the chat page, in a real browser -----------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install chromium)")


@pytest.fixture(scope="module")
def browser():
    """The OS's headless Chromium, driven by Playwright through its executable (no browser of Playwright's)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


class Page:
    """The chat page as a user works it: settings typed in, messages sent with Enter, replies read."""

    def __init__(self, browser, server: Served):
        self.page = browser.new_page()
        self.page.set_default_timeout(60_000)
        self.page.goto(server.url)
        self.page.click("summary")
        self.set("api-key", server.key)  # the page asks for the model again with it, at the first message

    def set(self, field: str, value: str) -> None:
        self.page.fill(f"#{field}", value)

    def send(self, message: str) -> None:
        before = self.replies().count()
        self.page.fill("#message", message)
        self.page.press("#message", "Enter")
        self.page.wait_for_function(f"document.querySelectorAll('.message.assistant').length === {before + 1}")
        self.page.wait_for_function("document.getElementById('model').textContent === 'speller'")

    def replies(self):
        return self.page.locator(".message.assistant")

    def last_reply(self) -> tuple[str, int]:
        """The last reply's text once it has ended, and the chunks it came in."""
        self.page.wait_for_function("document.body.dataset.state === 'idle'")
        reply = self.replies().last
        return reply.text_content(), int(reply.get_attribute("data-chunks"))

    def close(self) -> None:
        self.page.close()


def greedy_chat(server, messages: list[dict], max_tokens: int) -> str:
    reply = server.client().chat.completions.create(
        model="speller", messages=messages, temperature=0, max_tokens=max_tokens
    )
    return reply.choices[0].message.content


@needs_chromium
def test_the_chat_page_streams_the_apis_greedy_replies_turn_by_turn(server, browser):
    page = Page(browser, server)
    page.set("temperature", "0")
    page.set("max-tokens", "5")
    messages = []
    for message in ("dog", "cat"):
        page.send(message)
        text, chunks = page.last_reply()
        messages.append({"role": "user", "content": message})
        assert text == greedy_chat(server, messages, 5) and chunks > 1
        messages.append({"role": "assistant", "content": text})
    page.set("system", "Spell.")
    page.page.click("#new")
    page.send("spell: dog")
    text, _ = page.last_reply()
    assert text == greedy_chat(server, [{"role": "system", "content": "Spell."}, *user("spell: dog")], 5)
    page.close()


@needs_chromium
def test_the_chat_pages_stop_button_ends_the_reply_and_frees_its_row(server, browser):
    page = Page(browser, server)
    page.set("temperature", "0")
    page.set("max-tokens", "100000")
    page.send("dog")
    page.page.wait_for_function("Number(document.querySelector('.message.assistant:last-child').dataset.chunks) >= 3")
    page.page.click("#stop")
    text, chunks = page.last_reply()
    assert len(text) >= 3 and chunks >= 3
    deadline = time.monotonic() + 30
    while server.http.get("health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.http.get("health").json()["running"] == 0
    page.close()
