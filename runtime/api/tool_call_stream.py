"""Tool calls read as the model writes them, for streaming: each call's first delta carries
index, id, type and name (arguments ""), then its arguments text arrives as it is written,
the way OpenAI and vLLM stream and the openai client assembles (by ``index``).

A call streams once its object has started ``{"name": "...", "arguments"|"parameters": `` and
its arguments are an object or array; any other shape (name after the arguments, arguments
as a JSON string) is sent whole when its block ends. The arguments text is the model's own,
as ``tool_parsers.parse_tool_calls`` returns it for the same output.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .tool_calls import ToolCall
from .tool_parsers import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    call_from_json,
    parse_tool_calls,
    partial_marker,
)

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*'
                     r'"(?:arguments|parameters)"\s*:\s*(?=\S)')
_ITEM_END = re.compile(r"\s*\}\s*([,\]])")


class _ValueEnd:
    """Where an object or array value ends, its text arriving in pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of ``text`` still belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class CallObjectStream:
    """One call object's text, from its ``{``, growing; ``deltas`` says what is new."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.call: ToolCall | None = None  # set once the header is sent
        self.args_end: int | None = None  # in the object's text, once the arguments ended
        self.unstreamable = False  # a shape sent whole at the end
        self._args_at = 0  # arguments text sent up to here
        self._end = _ValueEnd()

    @property
    def started(self) -> bool:
        return self.call is not None

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """The deltas for this call given its text so far (which only grows)."""
        out: list[dict[str, Any]] = []
        if self.call is None and not self.unstreamable:
            match = _HEADER.match(text)
            if match is None:
                return out
            if text[match.end()] not in "{[":
                self.unstreamable = True
                return out
            self.call = ToolCall(json.loads(match.group(1)), "")
            self._args_at = match.end()
            out.append({"index": self.index, **self.call.to_json()})
        if self.call is None or self.args_end is not None:
            return out
        fresh = text[self._args_at:]
        taken = self._end.feed(fresh)
        if taken:
            self.call.arguments += fresh[:taken]
            out.append({"index": self.index, "function": {"arguments": fresh[:taken]}})
        self._args_at += taken
        if self._end.done:
            self.args_end = self._args_at
        return out


class RequiredCallStream:
    """``tool_choice: required``: the grammar's JSON array of ``{"name", "parameters"}``."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[CallObjectStream] = []
        self._item_at: int | None = None  # where the current item's object begins
        self._closed = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        while not self._closed:
            if self._item_at is None:
                start = self.text.find("{")
                if not self.calls and start >= 0:
                    self._item_at = start
                    self.calls.append(CallObjectStream(0))
                else:
                    return out
            assert self._item_at is not None
            item = self.calls[-1]
            out += item.deltas(self.text[self._item_at:])
            if item.args_end is None:
                return out
            after = self._item_at + item.args_end
            end = _ITEM_END.match(self.text, after)
            if end is None:
                return out
            if end.group(1) == "]":
                self._closed = True
                return out
            nxt = self.text.find("{", end.end())
            if nxt < 0:
                return out
            self._item_at = nxt
            self.calls.append(CallObjectStream(len(self.calls)))
        return out

    @property
    def streamed(self) -> bool:
        return any(c.started for c in self.calls)


class AutoCallStream:
    """``tool_choice: auto``: content streams until a ``<tool_call>`` may begin (a partial
    tag is held back, never sent as content); each block then streams as a call, and text
    after the first block is dropped as the whole-message parse drops it. A message that
    starts with ``{`` may be Llama 3 JSON: it is held and parsed when it ends."""

    def __init__(self) -> None:
        self.text = ""
        self.num_calls = 0
        self._sent = 0  # characters streamed as content
        self._mode = "content"  # "content" | "blocks" | "json"
        self._block_at = 0  # where the current block's body begins (after its tag)
        self._block: CallObjectStream | None = None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool_calls deltas) that can be sent now."""
        self.text += text
        content = self._content() if self._mode == "content" else ""
        return content, self._blocks() if self._mode == "blocks" else []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left when the message ends."""
        if self._mode == "json" or (self._mode == "content" and self._sent == 0):
            content, calls = parse_tool_calls(self.text)
            if calls:
                return "", self._whole(calls)
            return self.text, []
        if self._mode == "content":
            rest, self._sent = self.text[self._sent:], len(self.text)
            return rest, []
        out = self._blocks(final=True)
        if self.num_calls == 0:  # no block was a call: the text was content after all
            return self.text[self._sent:], out
        return "", out

    def _content(self) -> str:
        if self._sent == 0 and not self.text.strip():
            return ""  # leading whitespace: wait to see whether a JSON call starts
        if self._sent == 0 and self.text.lstrip().startswith("{"):
            self._mode = "json"
            return ""
        start = self.text.find(TOOL_CALL_START, self._sent)
        if start >= 0:
            self._mode, self._block_at = "blocks", start + len(TOOL_CALL_START)
            self._block = CallObjectStream(0)
            out, self._sent = self.text[self._sent:start], start
            return out
        end = len(self.text) - partial_marker(self.text)
        out, self._sent = self.text[self._sent:end], max(self._sent, end)
        return out

    def _blocks(self, final: bool = False) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self._block is None:
                start = self.text.find(TOOL_CALL_START, self._block_at)
                if start < 0:
                    return out
                self._block_at = start + len(TOOL_CALL_START)
                self._block = CallObjectStream(self.num_calls)
            block = self._block
            end = self.text.find(TOOL_CALL_END, self._block_at)
            body = self.text[self._block_at:end if end >= 0 else len(self.text)]
            was_started = block.started
            out += block.deltas(body)
            if block.started and not was_started:
                self.num_calls += 1
            if end < 0 and not final:
                return out
            if not block.started:  # not a streamable shape: the whole block, if a call
                call = call_from_json(body.strip())
                if call is not None:
                    out += self._whole([call])
            self._block = None
            if end < 0:
                return out
            self._block_at = end + len(TOOL_CALL_END)

    def _whole(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"index": self.num_calls, **call.to_json()})
            self.num_calls += 1
        return out
