"""Chat prompts: OpenAI-style messages -> the one prompt string a completion model continues.

A checkpoint that carries a chat template (HF's `chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) is rendered with it as transformers' `apply_chat_template` renders it: jinja2's
immutable sandbox, `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`, `raise_exception`.
A checkpoint without one (the bundled base models) gets a plain transcript,

    system: You tell short stories.
    user: Tell me about a cat.
    assistant:

and the next turn's marker ("\\nuser:") is a stop string, so a base model's reply ends where it would start
writing the user's next line instead of running on with both sides of the conversation.

Template problems a request causes (`raise_exception("roles must alternate")`, a sandbox refusal) raise
`ChatError`, which the service answers with 400. A template that does not compile is the checkpoint's fault: it is
found when the template is read, and that model then refuses chat requests (saying why) but serves completions.
As in transformers, templates get jinja2's loop controls (`break`, `continue`) and `{% generation %}` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROLES = ("system", "developer", "user", "assistant")  # OpenAI's roles without tools; developer = a newer system
PLAIN_STOP = ("\nuser:",)  # the plain transcript's next user turn


class ChatError(ValueError):
    """A conversation the template can't render (the service's 400)."""


@dataclass(frozen=True)
class ChatTemplate:
    """How one checkpoint turns messages into a prompt. Plain data: it crosses process boundaries."""

    source: str | None = None  # jinja2 template text; None = the plain transcript
    bos_token: str = ""  # the strings templates write for BOS / EOS (from tokenizer_config.json)
    eos_token: str = ""
    error: str | None = None  # the checkpoint's template does not compile: chat is refused, completions still work

    def __post_init__(self) -> None:
        if self.source is not None and self.error is None:
            _compile(self.source)  # fail at load, not on the first request

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings the template implies (a templated model ends its turn with EOS, which already stops)."""
        return PLAIN_STOP if self.source is None else ()

    def render(self, messages: list[dict[str, str]]) -> str:
        """[{"role", "content"}, ...] -> the prompt, ending where the assistant's reply begins. A leading BOS the
        template writes is left out: the engine starts every prompt with the BOS token itself."""
        if self.error is not None:
            raise ChatError(f"this model's chat template is unusable ({self.error}); render the conversation "
                            "yourself and send it to /v1/completions")
        for m in messages:
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ChatError(f"each message needs a role in {ROLES} and text content, got {m!r:.200}")
        messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
        if self.source is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        from jinja2.exceptions import SecurityError

        try:
            out = _compile(self.source).render(messages=messages, add_generation_prompt=True,
                                               bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatError:
            raise
        except SecurityError as e:
            raise ChatError(f"the chat template refused this conversation (sandbox: {e})") from None
        except Exception as e:  # a template is a program of the checkpoint's: any failure is this request's 400
            raise ChatError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from None
        return out[len(self.bos_token):] if self.bos_token and out.startswith(self.bos_token) else out


def read_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The checkpoint's chat template (`chat_template.jinja` first, then tokenizer_config.json), or the plain one.
    One that does not compile comes back with `error` set (and chat refused), so completions are still served."""
    from rankserve.workers.checkpoint import CheckpointError

    d = Path(model_dir)
    cfg: dict[str, Any] = {}
    if (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{d / 'tokenizer_config.json'} is not valid JSON: {e}") from None
        cfg = cfg if isinstance(cfg, dict) else {}
    source = cfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        try:
            source = (d / "chat_template.jinja").read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{d / 'chat_template.jinja'} is not UTF-8 text: {e}") from None
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise CheckpointError(f"{d}: chat_template must be a string or a list of named templates")
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    try:
        return ChatTemplate(source or None, bos, eos)
    except ChatError as e:
        return ChatTemplate(source, bos, eos, error=str(e))


def _token_text(tok: Any) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...} (an AddedToken)."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else ""


def _raise(message: str) -> None:
    raise ChatError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_compiled: dict[str, Any] = {}  # template text -> jinja2 Template (a router renders every chat request)


def _compile(source: str):
    if source not in _compiled:
        from jinja2 import TemplateSyntaxError, nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks in
            transformers; rendering a prompt needs only its body."""

            tags = {"generation"}

            def parse(self, parser) -> list[nodes.Node]:
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        try:
            _compiled[source] = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ChatError(f"the chat template does not compile (line {e.lineno}: {e.message})") from None
    return _compiled[source]
