"""Reading tool calls out of free text (``tool_choice`` auto), batch and streaming.

Two formats, tried in this order: hermes-style ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks (Qwen 2/2.5/3, Hermes), and Llama 3's bare JSON
``{"name": ..., "parameters": {...}}`` (several separated by ``;``) as the whole message.
Text that does not parse stays content: a model that half-writes a call loses nothing.
"""

from __future__ import annotations

import json
import re

from .tool_calls import ToolCall

TOOL_CALL_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls). Content is None when the message is only calls."""
    if TOOL_CALL_START in text:
        calls = [c for block in _HERMES.findall(text) if (c := _call(block)) is not None]
        if calls:
            content = text[:text.index(TOOL_CALL_START)].strip()
            return content or None, calls
        return text, []
    stripped = text.strip()
    if stripped.startswith("{"):
        parts = [p.strip() for p in stripped.split(";")] if ";" in stripped else [stripped]
        found = [_call(p) for p in parts]
        if found and all(found):
            return None, [c for c in found if c]
    return text, []


def _call(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class StreamingToolParser:
    """Content streams as it comes until it may be a tool call; from there the text is held
    and parsed when the message ends (calls are then sent whole, one delta each, which the
    openai client assembles like any other)."""

    def __init__(self) -> None:
        self.text = ""
        self._sent = 0  # characters of text already streamed as content
        self._holding = False

    def feed(self, delta: str) -> str:
        """Content safe to stream now."""
        self.text += delta
        if self._holding:
            return ""
        if not self.text[self._sent:].strip() and self._sent == 0:
            return ""  # leading whitespace: wait to see whether a JSON call starts
        if self._sent == 0 and self.text.lstrip().startswith("{"):
            self._holding = True
            return ""
        start = self.text.find(TOOL_CALL_START, self._sent)
        if start >= 0:
            self._holding = True
            out, self._sent = self.text[self._sent:start], start
            return out
        end = len(self.text) - _partial_marker(self.text)
        out, self._sent = self.text[self._sent:end], max(self._sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet streamed, calls)."""
        content, calls = parse_tool_calls(self.text)
        if calls:
            rest = (content or "")[self._sent:] if content else ""
            return rest, calls
        return self.text[self._sent:], []


def _partial_marker(text: str) -> int:
    """How many trailing characters could be the start of ``<tool_call>``."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0
