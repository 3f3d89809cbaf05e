"""Chat-template rendering: the checkpoint's jinja template, in a sandbox.

The template comes from tokenizer_config.json (untrusted input from the model directory), so
it runs in jinja's ImmutableSandboxedEnvironment, compiled once per tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (no template, or the template raised)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)  # templates call raise_exception("...") on bad input


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self._bos = bos_token or ""
        self._eos = eos_token or ""

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos, eos_token=self._eos)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc
