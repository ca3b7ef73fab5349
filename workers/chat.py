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
`ChatError`, which the service answers with 400; a template that does not compile is the checkpoint's fault and
is refused when the template is read.
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

    def __post_init__(self) -> None:
        if self.source is not None:
            _compile(self.source)  # fail at load, not on the first request

    @property
    def stop(self) -> tuple[str, ...]:
        """Stop strings the template implies (a templated model ends its turn with EOS, which already stops)."""
        return PLAIN_STOP if self.source is None else ()

    def render(self, messages: list[dict[str, str]]) -> str:
        """[{"role", "content"}, ...] -> the prompt, ending where the assistant's reply begins."""
        for m in messages:
            if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ChatError(f"each message needs a role in {ROLES} and text content, got {m!r:.200}")
        if self.source is None:
            roles = {"developer": "system"}
            return "".join(f"{roles.get(m['role'], m['role'])}: {m['content']}\n" for m in messages) + "assistant:"
        from jinja2.exceptions import SecurityError, TemplateError

        try:
            return _compile(self.source).render(messages=messages, add_generation_prompt=True,
                                                bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatError:
            raise
        except SecurityError as e:
            raise ChatError(f"the chat template refused this conversation (sandbox: {e})") from None
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatError(f"the chat template failed on this conversation: {type(e).__name__}: {e}") from None


def read_chat_template(model_dir: str | Path) -> ChatTemplate:
    """The checkpoint's chat template (`chat_template.jinja` first, then tokenizer_config.json), or the plain one."""
    from rankserve.workers.checkpoint import CheckpointError

    d = Path(model_dir)
    cfg: dict[str, Any] = {}
    if (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{d / 'tokenizer_config.json'} is not valid JSON: {e}") from None
        cfg = cfg if isinstance(cfg, dict) else {}
    source = cfg.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        source = (d / "chat_template.jinja").read_text()
    elif isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise CheckpointError(f"{d}: chat_template must be a string or a list of named templates")
    try:
        return ChatTemplate(source or None, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
    except ChatError as e:
        raise CheckpointError(f"{d}: {e}") from None


def _token_text(tok: Any) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ..., ...} (an AddedToken)."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else ""


def _raise(message: str) -> None:
    raise ChatError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_compiled: dict[str, Any] = {}  # template text -> jinja2 Template (a router renders every chat request)


def _compile(source: str):
    if source not in _compiled:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            _compiled[source] = env.from_string(source)
        except TemplateSyntaxError as e:
            raise ChatError(f"the chat template does not compile (line {e.lineno}: {e.message})") from None
    return _compiled[source]
