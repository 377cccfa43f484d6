"""The HTTP server: OpenAI's endpoints over the engine, the chat page, the API key, and every failure
answered with OpenAI's error object (docs/serving.md).

    GET  /                      the chat page (server/static/chat.html)
    GET  /v1/models             the one model served
    POST /v1/chat/completions   messages through the model's chat template, as sample.py --chat
    POST /v1/completions        plain text continued, as sample.py
    GET  /health                {"status": "ok", "running": rows decoding, "waiting": choices queued}

A reply is drawn as sample.py draws it: the prompt's ids (a completion's text encoded; a chat's
messages rendered by render_prompt with the generation prompt), sample_next_token with the request's
temperature, top_p and top_k, choice i from a generator seeded with seed + i, ended as sample.py ends
it. So with the same prompt, seed and sampling a choice is sample.py's sample, and greedy replies are
sample.py's greedy replies.

No value of a request reaches the file system: the page is read once, when the app is made, and no
route names a file.
"""

import asyncio
import json
import secrets
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from data.conversations import render_prompt
from data.tokenizer import Tokenizer
from errors import UserError
from inference.chat import prompt_room
from inference.load import PromptTooLong, check_prompt
from model import GPTConfig
from server.engine import Choice, Engine, EngineFailure, Job, ShuttingDown
from server.protocol import SEEDS, Answer, APIError, ChatRequest, CompletionRequest, Sampling, Usage, limited

PAGE = Path(__file__).resolve().parent / "static" / "chat.html"


@dataclass(frozen=True)
class Served:
    """What the server serves and the limits it keeps."""

    name: str  # the model's id: in /v1/models, and the `model` every request names
    tokenizer: Tokenizer
    config: GPTConfig
    chat_stops: frozenset[int] | None  # the tokens that end a chat reply; None: the model has no chat template
    max_tokens: int  # a request's max_tokens: at most this, and this when it gives none
    max_n: int  # choices a request may ask for
    max_body_bytes: int  # a larger request body is refused (413) before it is read
    api_key: str | None  # every request but the page's must carry it as `Authorization: Bearer KEY`


def create_app(engine: Engine, served: Served) -> FastAPI:
    """The server's ASGI app; it starts the engine's thread when it starts, and stops it when it stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    # a body without a Content-Type is read as JSON too; one of another type is refused, naming the header
    app = FastAPI(title="gpt-trainer", lifespan=lifespan, docs_url=None, redoc_url=None, strict_content_type=False)
    page = PAGE.read_text(encoding="utf-8")
    chat_request = limited(ChatRequest, served.max_tokens, served.max_n)
    completion_request = limited(CompletionRequest, served.max_tokens, served.max_n)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **engine.load}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object(served)]}

    @app.get("/v1/models/{name}")
    async def one_model(name: str) -> dict:
        check_model(name, served)
        return model_object(served)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: chat_request, request: Request):  # type: ignore[valid-type]
        check_model(body.model, served)
        prompt = chat_prompt(body, served)
        markup = template_markup(served)
        choices = [sampled(body, served, prompt, seed, served.chat_stops, markup) for seed in seeds(body)]
        return await answer(engine, request, body, Answer(chat=True, model=served.name), choices, len(prompt))

    @app.post("/v1/completions")
    async def completions(body: completion_request, request: Request):  # type: ignore[valid-type]
        check_model(body.model, served)
        prompts = [completion_prompt(text, served) for text in body.prompt]
        eot = served.tokenizer.eot_token
        stop_tokens = frozenset() if eot is None else frozenset([eot])
        all_seeds = iter(seeds(body, len(prompts) * body.n))
        # choice i * n + j is prompt i's j-th, drawn with seed + i * n + j as sample.py --num-samples n draws
        choices = [sampled(body, served, ids, next(all_seeds), stop_tokens) for ids in prompts for _ in range(body.n)]
        prompt_tokens = sum(len(ids) for ids in prompts)
        return await answer(engine, request, body, Answer(chat=False, model=served.name), choices, prompt_tokens)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    # the outermost first: a body too large is refused before the key is read, and both before any route
    app.add_middleware(RequireKey, key=served.api_key)
    app.add_middleware(LimitBody, max_bytes=served.max_body_bytes)
    return app


# --- what a request asks the model ------------------------------------------------------------------


def model_object(served: Served) -> dict:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "gpt-trainer"}


def check_model(name: str, served: Served) -> None:
    if name != served.name:
        raise APIError(
            404,
            f"the model {name!r:.100} is not served here: this server serves {served.name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def chat_prompt(body: ChatRequest, served: Served) -> list[int]:
    """The messages' ids through the chat template, ending in the generation prompt."""
    if served.chat_stops is None:
        raise APIError(
            400,
            f"the model {served.name!r} has no chat template, so it cannot tell turns apart (fine-tune it on "
            f"conversations, docs/chat.md; or continue text with /v1/completions)",
            param="messages",
            code="model_not_chat",
        )
    messages = [{"role": message.role, "content": message.content} for message in body.messages]
    try:
        ids = render_prompt(messages, served.tokenizer, "the request's messages")
    except UserError as e:
        raise APIError(400, str(e), param="messages") from None
    room = prompt_room(served.config.block_size, max_tokens(body, served))
    if len(ids) > room:
        raise APIError(
            400,
            f"the messages are {len(ids)} tokens through the chat template, but the model reads at most {room} tokens "
            f"before its reply (its context is {served.config.block_size} tokens, less room for the reply): "
            f"shorten the messages",
            param="messages",
            code="context_length_exceeded",
        )
    return ids


def completion_prompt(text: str, served: Served) -> list[int]:
    """A prompt's ids, as sample.py encodes its prompt: empty is the start of a document."""
    tokenizer = served.tokenizer
    text = text or ("\n" if tokenizer.eot_token is None else tokenizer.decode([tokenizer.eot_token]))
    try:
        ids = tokenizer.encode(text)
        check_prompt(text, ids, served.config)
    except PromptTooLong as e:
        raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from None
    except UserError as e:
        raise APIError(400, str(e), param="prompt") from None
    return ids


def max_tokens(body: Sampling, served: Served) -> int:
    return body.max_tokens or served.max_tokens


def seeds(body: Sampling, count: int | None = None) -> list[int]:
    """Choice i is drawn with seed + i, as sample.py's sample i with --seed + i; without a seed, from a
    fresh one."""
    count = count or body.n
    first = secrets.randbelow(SEEDS - count + 1) if body.seed is None else body.seed
    return [first + i for i in range(count)]


def template_markup(served: Served) -> frozenset[int]:
    """A chat template's special tokens: not text, left out of a reply as sample.py --chat leaves them."""
    return frozenset(served.tokenizer.specials.values())


def sampled(
    body: Sampling,
    served: Served,
    prompt: list[int],
    seed: int,
    stop_tokens: frozenset[int],
    markup: frozenset[int] = frozenset(),
) -> Choice:
    return Choice(
        prompt=prompt,
        max_tokens=max_tokens(body, served),
        temperature=body.temperature,
        top_k=body.top_k or None,
        top_p=body.top_p,
        seed=seed,
        stop_tokens=stop_tokens,
        stops=tuple(body.stop),
        markup=markup,
    )


# --- answering: whole, or streamed as server-sent events ------------------------------------------------


async def answer(
    engine: Engine, request: Request, body: Sampling, answer: Answer, choices: list[Choice], prompt_tokens: int
):
    try:
        job = engine.submit(choices)
    except ShuttingDown:
        raise APIError(503, "the server is shutting down and takes no new requests", kind="server_error") from None
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    if body.stream:
        events = stream(job, request, answer, prompt_tokens, include_usage)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    texts, reasons = [""] * len(choices), [""] * len(choices)
    usage = Usage(prompt_tokens=prompt_tokens)
    async with watching(job, request):
        try:
            async for event in job.events():
                texts[event.index] += event.text
                if event.finish_reason is not None:
                    reasons[event.index] = event.finish_reason
                    usage.completion_tokens += event.tokens
        except EngineFailure as e:
            raise failure(e) from None
    return JSONResponse(answer.whole(texts, reasons, usage))


async def stream(
    job: Job, request: Request, answer: Answer, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    """The chunks of OpenAI's stream: in a chat, first each choice's role; then text as it comes, the
    finish reason with each choice's last; with include_usage, a chunk of usage (and `usage: null` in
    the others); then [DONE]."""
    usage = Usage(prompt_tokens=prompt_tokens)
    extra = {"usage": None} if include_usage else {}
    async with watching(job, request):
        if answer.chat:
            for index in range(job.choices):
                yield event_line(answer.chunk(index, "", first=True) | extra)
        try:
            async for event in job.events():
                usage.completion_tokens += event.tokens
                yield event_line(answer.chunk(event.index, event.text, event.finish_reason) | extra)
        except EngineFailure as e:
            yield event_line(failure(e).body())
            return
        if include_usage:
            yield event_line(answer.usage_chunk(usage))
        yield "data: [DONE]\n\n"


def event_line(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def failure(error: EngineFailure) -> APIError:
    return APIError(500, f"decoding failed ({error}); the server's log has the details", kind="server_error")


@asynccontextmanager
async def watching(job: Job, request: Request):
    """While the request is answered, a client that goes away cancels its job, whose choices then leave
    the batch; and the job is cancelled however the answer ends."""

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(wait_for_disconnect())
    try:
        yield
    finally:
        watcher.cancel()
        job.cancel()


# --- errors: OpenAI's error object, never a traceback --------------------------------------------------


async def api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body its schema refuses: 400, naming the first field at fault and what it received."""
    first = error.errors()[0]
    where = [str(part) for part in first["loc"] if part != "body"]
    param = ".".join(where) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        message, param = f"the body is not valid JSON ({first.get('ctx', {}).get('error', message)})", None
    elif param is None and first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        message = "the body is not a JSON object: send one, with the header Content-Type: application/json"
    elif first["type"] == "missing":
        message = f"{param} is required"
    elif first["type"] == "extra_forbidden":
        message = f"{param} is not a field this server takes (it computes no {where[-1]}, and does not ignore it)"
    elif param is not None:
        message = f"{param}={first.get('input')!r:.80}: {message}"
    return JSONResponse(APIError(400, message, param=param).body(), status_code=400)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    if error.status_code == 404:
        message = f"no such route: {request.method} {request.url.path} (the API is under /v1: docs/serving.md)"
    elif error.status_code == 405:
        message = f"{request.url.path} does not take {request.method}"
    else:
        message = str(error.detail)
    return JSONResponse(APIError(error.status_code, message).body(), status_code=error.status_code)


async def server_error(request: Request, error: Exception) -> JSONResponse:
    traceback.print_exception(error, file=sys.stderr)
    message = "the server failed to answer; its log has the details"
    return JSONResponse(APIError(500, message, kind="server_error").body(), status_code=500)


# --- middleware: the API key and the body's size ---------------------------------------------------------


async def refuse(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequireKey:
    """With a key, every request but the page's (which holds nothing, and which a browser opens without
    a header) must carry `Authorization: Bearer KEY`; compared in constant time."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] == "/":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.key.encode()):
            return await self.app(scope, receive, send)
        what = "no API key was given" if not given else "the API key is not this server's"
        message = f"{what} (send it as the header Authorization: Bearer KEY)"
        await refuse(send, APIError(401, message, code="invalid_api_key"))


class LimitBody:
    """A request body of more than max_bytes is refused with 413, by its Content-Length before it is
    read, or as soon as more arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await refuse(send, self.too_large())
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, self.too_large().message, code="request_too_large")
            return message

        await self.app(scope, counted, send)

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes:,} bytes", code="request_too_large")
