"""Chat-template rendering: the checkpoint's jinja template, as transformers renders it.

The template is untrusted input from the model directory, so it runs in jinja's
ImmutableSandboxedEnvironment, with the environment transformers' ``apply_chat_template``
gives it (trim_blocks, lstrip_blocks, loop controls, a ``tojson`` that does not escape HTML,
``raise_exception``, ``strftime_now``) and the same variables: the full message objects
(tool_calls, tool_call_id, name, content parts), ``tools``, ``documents``,
``add_generation_prompt``, the special tokens and any extra keyword arguments.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, or the template raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)  # templates call raise_exception("...") on bad input


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# a template that loops over a message's content takes OpenAI content parts as they come
_READS_CONTENT_PARTS = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.\[\]'\"]*content\b")


class ChatTemplate:
    """One compiled template. ``special_tokens`` are the template variables bos_token etc."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.source = source
        self.reads_content_parts = bool(_READS_CONTENT_PARTS.search(source))
        self._special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               documents: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True,
               extra: dict[str, Any] | None = None) -> str:
        variables = {**self._special_tokens, **(extra or {})}
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
