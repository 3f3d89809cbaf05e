"""One streamed choice's deltas when the request has tools: content and ``tool_calls``
deltas in the shape the openai client assembles (by ``index``: the first delta of a call
carries id, type and name, later ones append to ``function.arguments``), sent as the model
writes them (``tool_call_stream.py``)."""

from __future__ import annotations

from typing import Any

from .tool_call_stream import AutoCallStream, RequiredCallStream
from .tool_calls import ToolCall, ToolPolicy, calls_from_constrained
from .tool_formats import FormatCallStream


class ToolDeltaStream:
    def __init__(self, policy: ToolPolicy) -> None:
        self.policy = policy
        self.text = ""
        self.num_calls = 0
        self._named: ToolCall | None = None
        self._auto: AutoCallStream | FormatCallStream | None = None
        if policy.mode == "auto":
            self._auto = FormatCallStream(policy.format) if policy.format else AutoCallStream()
        self._required = RequiredCallStream() if policy.mode == "required" else None

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields for this much new text ({} when nothing can be sent yet)."""
        self.text += text
        if self.policy.mode == "none":
            return {"content": text} if text else {}
        if self._auto is not None:
            content, calls = self._auto.feed(text)
            self.num_calls = self._auto.num_calls
            return _fields(content, calls)
        if self._required is not None:
            calls = self._required.feed(text)
            self.num_calls = len([c for c in self._required.calls if c.started])
            return _fields("", calls)
        # named: the text is the arguments: stream it as it comes, once it has begun (not
        # while a reasoning model is still thinking: its call comes after the reasoning)
        assert self.policy.named is not None
        if self._named is None:
            if not self.text.strip():
                return {}
            self._named = ToolCall(self.policy.named, "")
            self.num_calls = 1
            first = self._named.to_json()
            first["function"]["arguments"] = self.text
            return {"tool_calls": [{"index": 0, **first}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}

    def finish(self) -> dict[str, Any]:
        """What is left when the choice ends: held content and/or calls not yet sent."""
        if self._auto is not None:
            content, calls = self._auto.finish()
            self.num_calls = self._auto.num_calls
            return _fields(content, calls)
        if self._required is not None and not self._required.streamed:
            # a shape the stream could not follow: the calls whole, if it parses
            whole = calls_from_constrained(self.text, self.policy)
            self.num_calls = len(whole)
            return _fields("", [{"index": i, **c.to_json()} for i, c in enumerate(whole)])
        return {}


def _fields(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = calls
    return out
