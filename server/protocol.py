"""OpenAI's chat and text completion protocol as the server speaks it: the request bodies (pydantic
models, which FastAPI validates every request against), the responses and stream chunks, and the error
object every failure is answered with.

A field the protocol has and this server does not compute (logprobs, tools, penalties, response
formats) is refused by name, as an unknown field is, rather than ignored: a client that asks for it
would otherwise read an answer that does not hold it as one that does. `top_k` is not OpenAI's; it
is accepted, as vLLM and llama.cpp accept it, so that a reply can be sampled as sample.py samples
(its --top-k; 0 is every token).
"""

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 1000  # a stop string is held back while it may be starting: longer ones are refused
SEEDS = 2**64  # a torch generator takes seeds 0 .. 2**64 - 1; choice i is drawn with seed + i


class APIError(Exception):
    """A request the server does not answer with a completion: the HTTP status and OpenAI's error
    object (message, type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]  # a list of text parts is their text, joined

    @field_validator("content")
    @classmethod
    def has_text(cls, content: str | list[TextPart]) -> str:
        text = content if isinstance(content, str) else "".join(part.text for part in content)
        if not text.strip():
            raise ValueError("a message needs text, and this one is blank")
        return text


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk with the usage and no choices, before [DONE]


class Sampling(Strict):
    """The fields both endpoints take."""

    model: str
    max_tokens: int | None = Field(None, ge=1)  # None: the server's --max-tokens
    temperature: float = Field(1.0, ge=0, le=2)  # 0 is greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # not OpenAI's: sample among the k most likely tokens; 0 = all
    stop: str | list[str] | None = Field(None, validate_default=True)  # a list of them, once validated
    seed: int | None = Field(None, ge=0, lt=SEEDS)  # choice i is drawn with seed + i
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the protocol's end-user id: taken, and read by nothing

    @field_validator("stop")
    @classmethod
    def check_stops(cls, stop: str | list[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings are taken, not {len(stops)}")
        for text in stops:
            if not text:
                raise ValueError("a stop string may not be empty: a reply would end before it begins")
            if len(text) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters, not {len(text)}")
        return stops

    @model_validator(mode="after")
    def check_together(self) -> "Sampling":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options applies only when stream is true")
        if self.seed is not None and self.seed + self.n > SEEDS:
            most = SEEDS - self.n
            raise ValueError(f"choice i is drawn with seed + i, below 2**64: with n={self.n}, seed is at most {most}")
        return self


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens

    @model_validator(mode="after")
    def one_length(self) -> "ChatRequest":
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ: give one of them")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(Sampling):
    # a list, once validated: each prompt gets n choices; "" is the start of a document
    prompt: str | list[str] = Field("", validate_default=True)

    @field_validator("prompt")
    @classmethod
    def some_prompt(cls, prompt: str | list[str]) -> list[str]:
        prompts = [prompt] if isinstance(prompt, str) else prompt
        if not prompts:
            raise ValueError("the list of prompts is empty")
        return prompts


def limited(request: type[Sampling], max_tokens: int, max_n: int) -> type[Sampling]:
    """The request model with the server's limits on max_tokens and n in its schema."""
    fields = {
        "max_tokens": (int | None, Field(None, ge=1, le=max_tokens)),
        "n": (int, Field(1, ge=1, le=max_n)),
    }
    if request is ChatRequest:
        fields["max_completion_tokens"] = (int | None, Field(None, ge=1, le=max_tokens))
    return create_model(request.__name__, __base__=request, **fields)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def body(self) -> dict:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


class Answer:
    """The responses of one request, whole or as stream chunks: one id and one creation time for all."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def whole(self, texts: list[str], reasons: list[str], usage: Usage) -> dict:
        """The response to a request without stream."""
        key = "message" if self.chat else "text"
        choices = [
            self._choice(i, key, {"role": "assistant", "content": text} if self.chat else text, reason)
            for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
        ]
        return self._envelope(self.object) | {"choices": choices, "usage": usage.body()}

    def chunk(self, index: int, text: str, reason: str | None = None, first: bool = False) -> dict:
        """A stream chunk of choice `index`: new text, the finish reason with the last; in a chat, the
        first delta carries the role (and no text), a last one without text is empty."""
        if not self.chat:
            return self._envelope(self.object) | {"choices": [self._choice(index, "text", text, reason)]}
        delta = {"role": "assistant", "content": ""} if first else {"content": text} if text else {}
        return self._envelope("chat.completion.chunk") | {"choices": [self._choice(index, "delta", delta, reason)]}

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        object = "chat.completion.chunk" if self.chat else self.object
        return self._envelope(object) | {"choices": [], "usage": usage.body()}

    @staticmethod
    def _choice(index: int, key: str, body: dict | str, reason: str | None) -> dict:
        return {"index": index, key: body, "logprobs": None, "finish_reason": reason}
