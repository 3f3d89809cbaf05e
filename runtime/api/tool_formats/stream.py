"""A format's calls as the model writes them (``tool_choice: auto`` with ``--tool-call-parser``):
content streams until the format's calls may begin (a possible marker is held back, never
sent as content); from there each call's first delta carries its index, id and name, and its
arguments follow as the model writes them, as far as the format can be sure of them
(``ToolFormat.open_call``; a format that cannot tell sends a call's arguments when it ends).
If the text after the marker holds no call when the message ends, it was content after all
and is sent then, as ``parse_whole`` would return it."""

from __future__ import annotations

from typing import Any

from ..tool_calls import ToolCall
from .base import ToolFormat, final_calls


class FormatCallStream:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._sent = 0  # characters streamed as content
        self._section_at: int | None = None
        self._arguments: list[str] = []  # per call sent: its arguments sent so far

    @property
    def num_calls(self) -> int:
        return len(self._arguments)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool_calls deltas) that can be sent now."""
        self.text += text
        content = ""
        if self._section_at is None:
            start = self.fmt.section_start(self.text)
            if start is None:
                end = max(self._sent, len(self.text) - self.fmt.held_back(self.text))
                content, self._sent = self.text[self._sent:end], end
                return content, []
            self._section_at = start
            content, self._sent = self.text[self._sent:start], start
        return content, self._deltas(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the message ends."""
        if self._section_at is None:
            rest, self._sent = self.text[self._sent:], len(self.text)
            return rest, []
        calls = self._deltas(final=True)
        if self.num_calls == 0:
            return self.text[self._sent:], []
        return "", calls

    def _deltas(self, final: bool) -> list[dict[str, Any]]:
        assert self._section_at is not None
        section = self.text[self._section_at:]
        if final:
            calls = final_calls(self.fmt, section)
        else:
            calls = self.fmt.calls(section, final=False)
            begun = self.fmt.open_call(section)
            if begun is not None and begun[0] == len(calls):
                calls.append(begun[1])
        return [d for i, call in enumerate(calls) if (d := self._delta(i, call))]

    def _delta(self, index: int, call: ToolCall) -> dict[str, Any] | None:
        if index == len(self._arguments):  # a new call: id, name and what there is
            self._arguments.append(call.arguments)
            return {"index": index, **call.to_json()}
        sent = self._arguments[index]
        if len(call.arguments) <= len(sent) or not call.arguments.startswith(sent):
            return None  # nothing new (a format keeps what it sent a prefix: ToolFormat)
        self._arguments[index] = call.arguments
        return {"index": index, "function": {"arguments": call.arguments[len(sent):]}}
