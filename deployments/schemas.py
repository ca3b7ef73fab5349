"""The request schemas and the one validation behind HTTP (`POST /v1/completions`, `POST /v1/chat/completions`)
and gRPC (`Generate`, `Chat` and their streams).

HTTP bodies and gRPC messages are both turned into a `CompletionRequest` by `parse_request` (a chat body into a
`ChatRequest`, which becomes a `CompletionRequest` once the family's chat template has rendered its messages),
then checked against the served families by `check_request`; any problem raises `RequestError`, which the router
answers with 400 (HTTP) or INVALID_ARGUMENT (gRPC) and the message, never a 500. The one check this module can't
make, prompt length in tokens against the context, is made by the worker with the family's tokenizer and reported
the same way.

Defaults follow OpenAI's: max_tokens 16 for completions and the family's limit for chat, temperature 1.0, top_p
1.0; like OpenAI, JSON null for an optional field means its default.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rankserve.workers.chat import ROLES, ChatError, ChatTemplate
from rankserve.workers.sampler import MAX_LOGPROBS, MIN_TEMPERATURE  # MIN: smaller means greedy (0)

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_STOP_CHARS = 256  # each stop string's: every generated token's stop check rescans up to this much of the text
MAX_PROMPT_CHARS = 1_000_000  # refuse absurd bodies before tokenizing them; the token limit is the real bound
MAX_PROMPT_TOKENS = 1_000_000  # the same for a prompt sent as token ids (the context is the real bound)
INT32_MAX = 2**31 - 1  # token ids: the proto's int32
MAX_CHOICES = 8  # prompts x n per request: each choice is one generation, and a replica's batch holds
# max_batch_size rows (8 by default): more choices than it holds would wait for others' rows to finish
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # the proto's int64 seed, and what torch.Generator.manual_seed takes


class RequestError(ValueError):
    """A client error: HTTP 400 / gRPC INVALID_ARGUMENT with `message`; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False  # one more chunk before [DONE]: no choices, the request's usage; null = no


class _Request(BaseModel):
    """The fields completions and chat completions share (OpenAI's names and defaults)."""

    model_config = ConfigDict(extra="forbid", strict=False)

    model: str = Field(min_length=1)  # the compression family, e.g. "svd-llm"
    max_tokens: int = Field(16, gt=0)  # the upper bound is per family: check_request
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # 0 = off (a vLLM extra)
    ignore_eos: bool = False  # run on past EOS / end of turn to max_tokens or a stop string (a vLLM extra)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream: true, as OpenAI
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices per prompt; sample j of a seeded request uses seed + j
    user: str | None = None  # accepted for OpenAI clients, unused

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """OpenAI accepts null for an optional field and means its default: drop those keys (required ones stay)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    @field_validator("temperature")
    @classmethod
    def _temperature_not_tiny(cls, v: float) -> float:
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"{v:g} is below {MIN_TEMPERATURE:g}; temperatures that small must be 0 "
                             "(greedy decoding)")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"a stop string is {max(map(len, v))} characters; each may have at most {MAX_STOP_CHARS}")
        for s in v:
            _utf8(s, "a stop string")
        return v

    @field_validator("user")  # `model` needs none: pydantic's min_length refuses a lone surrogate itself
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return v if v is None else _utf8(v, "the user name")

    @field_validator("max_tokens", "top_k", "seed", "n", mode="before")
    @classmethod
    def _no_float_ints(cls, v: Any) -> Any:
        return _integer(v)

    def seed_of(self, j: int) -> int | None:
        """The seed of choice j among n (distinct samples, each reproducible); None stays None."""
        if self.seed is None or j == 0:
            return self.seed
        return self.seed + j if self.seed + j <= INT64_MAX else self.seed - j

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class CompletionRequest(_Request):
    """OpenAI-shaped completion request. Fields OpenAI has and we don't (best_of, suffix, ...) are refused, so a
    client never silently gets something other than what it asked for. `echo` with `logprobs` and `max_tokens: 0`
    scores a text (each token's logprob given those before it), as evaluation harnesses ask."""

    # a text or token ids (ints, used as given: no BOS added), or a list of either kind: one completion per prompt
    # (choices prompt-major, then n), batched together
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's and the n most likely tokens' logprobs
    echo: bool = False  # the reply's text (and logprobs) start with the prompt's
    max_tokens: int = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> Any:
        """OpenAI's four shapes: "text", ["text", ...], [id, ...] (one prompt as token ids), [[id, ...], ...]."""
        if isinstance(v, list) and v and all(t is None or isinstance(t, (int, float)) for t in v):
            items = [v]  # one prompt of token ids (each checked below)
        else:
            items = v if isinstance(v, list) else [v]
        if not items:
            raise ValueError("an empty list of prompts")
        kinds = set()
        for p in items:
            if isinstance(p, str):
                kinds.add("text")
                if len(p) > MAX_PROMPT_CHARS:
                    raise ValueError(f"a prompt is longer than {MAX_PROMPT_CHARS} characters")
                _utf8(p, "a prompt")
            elif isinstance(p, list):
                kinds.add("token ids")
                for t in p:
                    if not _is_id(t):
                        raise ValueError(f"a token-id prompt holds {t!r}: token ids are integers from 0 to "
                                         f"{INT32_MAX}")
                if len(p) > MAX_PROMPT_TOKENS:
                    raise ValueError(f"a prompt is longer than {MAX_PROMPT_TOKENS} tokens")
            else:
                raise ValueError(f"each prompt must be a string (text) or a list of token ids, got "
                                 f"{type(p).__name__}")
            if not p:
                raise ValueError("a prompt must not be empty")
        if len(kinds) > 1:
            raise ValueError("the prompts mix text and token ids: send one kind")
        return v

    @model_validator(mode="after")
    def _echo_rules(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo: true (to score the prompt)")
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts)} prompts x n = {self.n} is more than {MAX_CHOICES} choices a request")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or a list of token ids (the validator made a list one kind: texts, ids or lists)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def choices(self) -> list["CompletionRequest"]:
        """One single-prompt, n = 1 request per choice, in the response's order (prompt-major, then n)."""
        return [self.model_copy(update={"prompt": p, "n": 1, "seed": self.seed_of(j)})
                for p in self.prompts for j in range(self.n)]

    @field_validator("logprobs", mode="before")
    @classmethod
    def _no_float_n(cls, v: Any) -> Any:
        return _integer(v)

    def sampling(self) -> dict[str, Any]:
        """What the worker needs to build `SamplingParams` (a plain dict: it crosses process boundaries)."""
        return dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,  # 0: echo only
                    top_k=self.top_k, seed=self.seed, stop=tuple(self.stop), ignore_eos=self.ignore_eos,
                    logprobs=self.logprobs)


class TextPart(BaseModel):
    """One part of a message's content; only text parts are served (no images or audio)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal[ROLES]  # type: ignore[valid-type]  # no tool messages: tools are not served
    content: str | list[TextPart] = Field(max_length=MAX_PROMPT_CHARS)
    name: str | None = None  # accepted for OpenAI clients, unused

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | list[TextPart]) -> str | list[TextPart]:
        for i, text in enumerate([v] if isinstance(v, str) else [p.text for p in v]):
            _utf8(text, "the content" if isinstance(v, str) else f"content part {i}'s text")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        return v if v is None else _utf8(v, "the name")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    """OpenAI-shaped chat completion request. `max_tokens` (or its newer name `max_completion_tokens`) defaults to
    the family's limit, as OpenAI's chat API runs to the end of the reply by default."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False  # each content token's logprob
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and the n most likely tokens' (needs logprobs)

    @field_validator("max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _no_float_int(cls, v: Any) -> Any:
        return _integer(v)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _not_too_long(self):
        if sum(len(m.text) for m in self.messages) > MAX_PROMPT_CHARS:  # before rendering it
            raise ValueError(f"the conversation is longer than {MAX_PROMPT_CHARS} characters")
        return self

    @model_validator(mode="after")
    def _one_max_tokens(self):
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree; send one of them")
        if self.max_tokens is None:
            self.max_tokens = b
        return self

    def to_completion(self, template: ChatTemplate, limits: "FamilyLimits") -> CompletionRequest:
        """Render the conversation with the family's template: the completion request the worker runs. The
        template's own stop strings come after the client's (they may make the list longer than MAX_STOP)."""
        try:
            prompt = template.render([{"role": m.role, "content": m.text} for m in self.messages])
        except ChatError as e:
            raise RequestError(f"messages: {e}", "messages") from None
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"messages: the conversation is longer than {MAX_PROMPT_CHARS} characters", "messages")
        if not prompt:
            raise RequestError("messages: the chat template rendered an empty prompt for this conversation",
                               "messages")
        fields = self.model_dump(exclude={"messages", "max_completion_tokens", "max_tokens", "stop", "logprobs",
                                          "top_logprobs"})
        req = CompletionRequest(**fields, prompt=prompt, max_tokens=self.max_tokens or limits.max_tokens,
                                logprobs=(self.top_logprobs or 0) if self.logprobs else None)
        return req.model_copy(update={"stop": self.stop + [s for s in template.stop if s not in self.stop]})


def _utf8(s: str, what: str) -> str:
    """`s`, if it can be encoded as UTF-8; else ValueError naming the first lone surrogate (JSON allows "\\ud800"
    alone, but no tokenizer or embedder reads it). The message never holds the surrogate: it must encode too."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate (U+{ord(s[e.start]):04X}) at character {e.start}, which UTF-8 "
                         "can't encode; send valid Unicode text") from None
    return s


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def _integer(v: Any) -> Any:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError("must be an integer")
    return v


@dataclass
class FamilyLimits:
    """What the router checks per family before calling its worker."""

    max_tokens: int  # upper bound on max_tokens


def parse_request(body: bytes | str | dict, kind: type[_Request] = CompletionRequest) -> _Request:
    """A JSON body (bytes/str) or an already-decoded dict -> `kind` (CompletionRequest or ChatRequest), or
    RequestError saying what is wrong."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None
        except RecursionError:  # e.g. 100000 '[': deeper than the parser's recursion limit
            raise RequestError("the body is not valid JSON: nested too deeply") from None
        except ValueError:  # an integer literal longer than Python parses (sys.get_int_max_str_digits())
            raise RequestError(f"the body is not valid JSON: a number has more than {sys.get_int_max_str_digits()} "
                               "digits") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        msg = err["msg"]
        if err["type"] == "value_error":  # our own validators' messages, without pydantic's "Value error, "
            msg = str(err["ctx"]["error"])
            field = msg.split(": ", 1)[0]
            if param is None and field in kind.model_fields:  # a model check's message names its field first
                param, msg = field, msg.split(": ", 1)[1]
        elif err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            msg = "unknown field (supported: " + ", ".join(kind.model_fields) + ")"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "field required"
        raise RequestError(f"{param}: {msg}" if param else msg, param) from None


def check_request(req: _Request, families: dict[str, FamilyLimits]) -> FamilyLimits:
    """Checks that depend on what is served: the family exists and max_tokens is within its limit."""
    limits = families.get(req.model)
    if limits is None:
        raise RequestError(f"model: unknown model {req.model!r}; served: {', '.join(sorted(families))}", "model")
    if req.max_tokens is not None and req.max_tokens > limits.max_tokens:
        raise RequestError(f"max_tokens: {req.max_tokens} is above this model's limit of {limits.max_tokens}",
                           "max_tokens")
    return limits


def from_proto(msg, stream: bool = False) -> dict[str, Any]:
    """A `rankserve.GenerateRequest` or `ChatRequest` -> the same dict an HTTP body would be (unset optional fields
    left out): `prompt_ids` is HTTP's prompt of token ids; a chat's `logprobs: N` is HTTP's `"logprobs": true,
    "top_logprobs": N`; `stream`: it came through a streaming RPC (what HTTP's `stream: true` says). RequestError
    when both prompt and prompt_ids are set."""
    chat = msg.DESCRIPTOR.name == "ChatRequest"
    d: dict[str, Any] = {"model": msg.model}
    if stream:
        d["stream"] = True
    if chat:
        d["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages]
    elif msg.prompt_ids:
        if msg.prompt:
            raise RequestError("prompt and prompt_ids are both set: send the prompt as text or as token ids",
                               "prompt_ids")
        d["prompt"] = list(msg.prompt_ids)
    else:
        d["prompt"] = msg.prompt
    for f in ("max_tokens", "temperature", "top_p", "seed", "top_k", "ignore_eos", "n") + (() if chat else ("echo",)):
        if msg.HasField(f):
            d[f] = getattr(msg, f)
    # float32 on the wire: take the decimal the client wrote (1e-05, not 9.99999975e-06), as HTTP would
    for f in ("temperature", "top_p"):
        if f in d:
            d[f] = float(str(np.float32(d[f])))
    if msg.stop:
        d["stop"] = list(msg.stop)
    if msg.HasField("logprobs"):
        d.update({"logprobs": True, "top_logprobs": msg.logprobs} if chat else {"logprobs": msg.logprobs})
    return d


# ---- responses (OpenAI shapes) ----------------------------------------------------------------------------------

def new_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)


def completion_logprobs(entries: list[dict], prompt_entries: list[dict] | None = None,
                        prompt_chars: int = 0) -> dict[str, list]:
    """The worker's per-token entries ({"token", "logprob", "bytes", "offset", "top"}) -> a completion choice's
    `logprobs` (text_offset counts from the completion's start). With echo the prompt's entries come first and
    the completion's offsets move past the prompt's `prompt_chars`; a first token nothing predicts has null
    logprob and top_logprobs, as OpenAI's."""
    moved = [{**e, "offset": e["offset"] + prompt_chars} for e in entries] if prompt_chars else entries
    every = (prompt_entries or []) + moved
    return {"tokens": [e["token"] for e in every], "token_logprobs": [e["logprob"] for e in every],
            "top_logprobs": [None if e["logprob"] is None else {t: lp for t, lp, _ in e["top"]} for e in every],
            "text_offset": [e["offset"] for e in every]}


def chat_logprobs(entries: list[dict]) -> dict[str, list]:
    """The worker's per-token entries -> a chat choice's `logprobs` ({"content": [...]}, OpenAI's shape)."""
    def one(token: str, lp: float, b: list[int]) -> dict[str, Any]:
        return {"token": token, "logprob": lp, "bytes": list(b)}

    return {"content": [{**one(e["token"], e["logprob"], e["bytes"]), "top_logprobs": [one(*t) for t in e["top"]]}
                        for e in entries]}


@dataclass
class Choice:
    """One choice of a reply: its text, why it ended, and its logprobs in the request's shape (None: not asked)."""

    text: str
    finish_reason: str
    logprobs: dict | None = None


def completion_body(id: str, model: str, choices: list[Choice], prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"text": c.text, "index": i, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(id: str, model: str, text: str, finish_reason: str | None = None,
               usage_: dict[str, int] | None = None, logprobs: dict | None = None, index: int = 0) -> dict[str, Any]:
    body = {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_completion_body(id: str, model: str, choices: list[Choice], prompt_tokens: int,
                         completion_tokens: int) -> dict[str, Any]:
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": c.logprobs,
                         "finish_reason": c.finish_reason} for i, c in enumerate(choices)],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk_body(id: str, model: str, delta: dict[str, str], finish_reason: str | None = None,
                    usage_: dict[str, int] | None = None, logprobs: dict | None = None,
                    index: int = 0) -> dict[str, Any]:
    """A `chat.completion.chunk`: delta {"role": "assistant"} first, then {"content": ...}, then {} + finish_reason."""
    body = {"id": id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk_body(id: str, model: str, object: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The extra last chunk of `stream_options: {"include_usage": true}`: no choices, the usage."""
    return {"id": id, "object": object, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage_}

def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
