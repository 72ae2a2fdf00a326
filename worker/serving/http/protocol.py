"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models, and the
one message each invalid field gets.

A body is validated in two parts, in the order a caller is told about problems: the head (the
model, the parameters this server refuses, and the prompt or messages), then, once the prompt has
been tokenized (which has its own errors: a chat template that fails, token ids outside the
vocabulary), the options. Of all the errors of a part, the first field in FIELD_ORDER is reported,
with the message `_message` gives it: pydantic's own wording never reaches the caller.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from shardwise.worker.serving.http.errors import BadRequest

MAX_N = 16              # choices per request (each one a request in the engine)
MAX_LOGPROBS = 20       # top_logprobs / completions' logprobs, OpenAI's bound
# Completion tokens one request of several choices may ask for (n x max_tokens): without a bound,
# n = 16 with chat's default max_tokens (the rest of the context) is 16 full-context generations.
# A single choice may always fill the context. (shardwise serve --max-request-tokens)
MAX_REQUEST_TOKENS = 32768
MAX_STOP = 4            # stop strings per request, OpenAI's bound
MAX_STOP_CHARS = 256    # characters of one stop string (each is looked for at every token)
# Chat roles accepted. "developer" is OpenAI's newer name for "system" (what its client sends to
# reasoning models); chat templates only know "system", so it is rendered as one. "tool" goes to
# the template as is: one that cannot render it raises, which answers 400 naming the template.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Parameters this server does not implement, with the values that mean "off": any other value
# is refused rather than silently ignored (a caller relying on it would get a different answer).
UNSUPPORTED = {
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "tools": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}
FIELD_ORDER = ("model", *UNSUPPORTED, "prompt", "messages", "max_tokens", "max_completion_tokens",
               "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options", "return_token_ids", "ignore_eos", "logprobs", "top_logprobs")
_BOUND = f"an integer from 0 to {MAX_LOGPROBS}"

PositiveInt = Annotated[StrictInt, Field(ge=1)]
Number = Annotated[float, Field(strict=True)]      # an int or a float, not a bool
TopCount = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
NonEmpty = Annotated[StrictStr, Field(min_length=1)]


def _fail(kind: str) -> PydanticCustomError:
    """An error whose message `_message` writes (by its kind), for a rule pydantic has no type for."""
    return PydanticCustomError(kind, kind)


class _Model(BaseModel):
    # fields of OpenAI's API this server ignores (user, metadata, tool_choice, ...) are dropped
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class Message(_Model):
    model_config = ConfigDict(extra="allow")      # other keys (name, tool_call_id) go to the template
    role: Literal[CHAT_ROLES]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        # text parts are joined with newlines, as vLLM does
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class StreamOptions(_Model):
    include_usage: StrictBool = False


class ModelName(_Model):
    """The model a request names: this server's, or none."""
    model: StrictStr | None = None

    @field_validator("model")
    @classmethod
    def _served(cls, v, info: ValidationInfo):
        # The server answers to exactly one name: the id /v1/models reports (--model as given, or the
        # contract's serving.model_name). A router or gateway in front of several models picks the
        # backend by this field; answering another name with this model's text would hide a routing
        # mistake, so any other name is 404 model_not_found, as OpenAI answers. A request without
        # `model` (or null) is still served: it cannot mean another model, and the curl examples
        # and single-model clients leave it out.
        if v is not None and v != info.context["served"]:
            raise _fail("model_not_found")
        return v


class _Head(ModelName):
    """What is checked before the prompt is tokenized: the model named, the refused parameters."""
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    functions: Any = None
    response_format: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _off(cls, v, info: ValidationInfo):
        if not UNSUPPORTED[info.field_name](v):
            raise _fail("unsupported")
        return v


class CompletionHead(_Head):
    # a string, a list of one string, or token ids
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)] | \
        Annotated[list[StrictStr], Field(min_length=1, max_length=1)]


class ChatHead(_Head):
    messages: Annotated[list[Message], Field(min_length=1)]


class _Options(_Model):
    """What is checked once the prompt is tokenized. None: the parameter's default."""
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None      # chat's newer name; takes precedence
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    seed: StrictInt | None = None
    stop: list[NonEmpty] = []
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension, which a router needs to move a stream to another replica without a
    # tokenizer: a streamed answer's first chunk carries the prompt's token ids and the completion
    # bound in force, and each chunk the ids of the tokens it covers
    return_token_ids: StrictBool = False
    # vLLM's and llama.cpp's extension: generate past the model's end-of-sequence token, up to
    # max_tokens (a stop string still ends the answer), so a load test produces the answer lengths
    # it asked for whatever the model would say
    ignore_eos: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _precedence(cls, body):
        # max_completion_tokens, when given, replaces max_tokens, which is then not looked at
        if isinstance(body, dict) and body.get("max_completion_tokens") is not None:
            body = {k: v for k, v in body.items() if k != "max_tokens"}
        return body

    @field_validator("seed")
    @classmethod
    def _seed(cls, v, info: ValidationInfo):
        # choice i samples with seed + i; torch takes seeds in [-2^63, 2^64)
        n = info.data.get("n") or 1
        if v is not None and not -2**63 <= v <= 2**64 - n:
            raise _fail("seed_range")
        return v

    @field_validator("stop", "stream", mode="before")
    @classmethod
    def _falsy_is_off(cls, v, info: ValidationInfo):
        if not v:                   # null, "", [], false: no stop strings, no streaming
            return [] if info.field_name == "stop" else False
        return [v] if info.field_name == "stop" and isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, v: list[str]):
        if len(v) > MAX_STOP:
            raise _fail("stop_count")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise _fail("stop_length")
        return v

    @field_validator("stream_options", mode="before")
    @classmethod
    def _with_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            raise _fail("stream_off")
        return v

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionOptions(_Options):
    logprobs: TopCount | None = None        # the top alternatives per token; None: no logprobs

    @property
    def top_logprobs(self) -> int | None:
        return self.logprobs


class ChatOptions(_Options):
    logprobs: StrictBool | None = None
    top_logprobs: TopCount | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise _fail("needs_logprobs")
        return v


def validate(model: type[_Model], body, served: str, chat: bool) -> _Model:
    """`body` as `model`, or BadRequest with the message of its first invalid field."""
    try:
        return model.model_validate(body, context={"served": served})
    except ValidationError as e:
        errors = e.errors(include_url=False)
    if any(not err["loc"] for err in errors):
        raise BadRequest("request body must be a JSON object") from None
    first = min(errors, key=lambda err: FIELD_ORDER.index(err["loc"][0]))   # min keeps pydantic's order on ties
    raise _message(first, body, served, chat) from None


def _message(err: dict, body: dict, served: str, chat: bool) -> BadRequest:
    """The error a caller gets for one invalid field: the same words for every way it can be wrong."""
    name, kind = err["loc"][0], err["type"]
    if name == "model":
        if kind == "model_not_found":
            return BadRequest(f"The model '{err['input']}' does not exist; this server serves '{served}'",
                              404, "model", "model_not_found")
        return BadRequest("'model' must be a string", param="model")
    if name in UNSUPPORTED:
        return BadRequest(f"'{name}' is not supported by this server (leave it out)", param=name)
    if name == "messages":
        return _message_error(err["loc"][1:], body["messages"] if "messages" in body else None)
    fixed = {
        "prompt": "'prompt' must be a string or a non-empty list of token ids",
        "max_tokens": "'max_tokens' must be a positive integer",
        "max_completion_tokens": "'max_completion_tokens' must be a positive integer",
        "temperature": "'temperature' must be a number in [0, 2]",
        "top_p": "'top_p' must be a number in (0, 1]",
        "n": f"'n' must be an integer from 1 to {MAX_N}",
        "seed": "'seed' must be an integer in [-2^63, 2^64 - n]",
        "stop": {"stop_count": f"'stop' may hold at most {MAX_STOP} strings",
                 "stop_length": f"each 'stop' string must be at most {MAX_STOP_CHARS} characters",
                 }.get(kind, "'stop' must be a string or a list of non-empty strings"),
        "stream": "'stream' must be a boolean",
        "ignore_eos": "'ignore_eos' must be a boolean",
        "stream_options": ("'stream_options' is only allowed when 'stream' is true" if kind == "stream_off" else
                           "'stream_options' must be an object like {\"include_usage\": true}"),
        "logprobs": "'logprobs' must be a boolean" if chat else f"'logprobs' must be {_BOUND}",
        "top_logprobs": ("'top_logprobs' requires 'logprobs': true" if kind == "needs_logprobs" else
                         f"'top_logprobs' must be {_BOUND}"),
    }
    return BadRequest(fixed[name], param=name)


def _message_error(loc: tuple, messages) -> BadRequest:
    """The error of the first invalid message: where it is, and what of it is wrong."""
    if not loc:
        return BadRequest("'messages' must be a non-empty list of {role, content} objects", param="messages")
    where = f"messages[{loc[0]}]"
    message = messages[loc[0]]
    if len(loc) == 1:
        return BadRequest(f"'{where}' must be an object with 'role' and 'content'", param=where)
    if loc[1] == "role":
        return BadRequest(f"'{where}.role' is {message.get('role')!r}; valid roles are: {', '.join(CHAT_ROLES)}",
                          param=f"{where}.role")
    if isinstance(message.get("content"), list):
        return BadRequest(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": string}}; "
                          f"only text is supported", param=f"{where}.content")
    return BadRequest(f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content")
