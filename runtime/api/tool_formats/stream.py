"""A format's calls as the model writes them (``tool_choice: auto`` with ``--tool-call-parser``):
content streams until the format's calls may begin (a possible marker is held back, never
sent as content); from there each call is sent whole (id, name and arguments in one delta)
as soon as its end is written, which is what ``ToolFormat.calls`` reports. If the text
after the marker holds no call when the message ends, it was content after all and is sent
then, as ``parse_whole`` would return it."""

from __future__ import annotations

from typing import Any

from .base import ToolFormat


class FormatCallStream:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.num_calls = 0
        self._sent = 0  # characters streamed as content
        self._section_at: int | None = None

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
        return content, self._new_calls(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the message ends."""
        if self._section_at is None:
            rest, self._sent = self.text[self._sent:], len(self.text)
            return rest, []
        calls = self._new_calls(final=True)
        if self.num_calls == 0:
            return self.text[self._sent:], []
        return "", calls

    def _new_calls(self, final: bool) -> list[dict[str, Any]]:
        assert self._section_at is not None
        found = self.fmt.calls(self.text[self._section_at:], final)
        out = [{"index": i, **call.to_json()}
               for i, call in enumerate(found[self.num_calls:], start=self.num_calls)]
        self.num_calls = max(self.num_calls, len(found))
        return out
