"""One streamed choice's deltas when the request has tools: content and ``tool_calls``
deltas in the shape the openai client assembles (by ``index``: the first delta of a call
carries id, type and name, later ones append to ``function.arguments``)."""

from __future__ import annotations

from typing import Any

from .tool_calls import ToolCall, ToolPolicy, calls_from_constrained
from .tool_parsers import StreamingToolParser


class ToolDeltaStream:
    def __init__(self, policy: ToolPolicy) -> None:
        self.policy = policy
        self.text = ""
        self.num_calls = 0
        self._named: ToolCall | None = None
        self._parser = StreamingToolParser() if policy.mode == "auto" else None

    def feed(self, text: str) -> dict[str, Any]:
        """The delta fields for this much new text ({} when nothing can be sent yet)."""
        self.text += text
        if self.policy.mode == "none":
            return {"content": text} if text else {}
        if self._parser is not None:
            content = self._parser.feed(text)
            return {"content": content} if content else {}
        if self.policy.mode == "named":  # the text is the arguments: stream it as it comes
            assert self.policy.named is not None
            if self._named is None:
                self._named = ToolCall(self.policy.named, "")
                self.num_calls = 1
                first = self._named.to_json()
                first["function"]["arguments"] = text
                return {"tool_calls": [{"index": 0, **first}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        return {}  # required: a JSON array, sent whole when it is complete

    def finish(self) -> dict[str, Any]:
        """What is left when the choice ends: held content and/or whole calls."""
        if self._parser is not None:
            rest, calls = self._parser.finish()
        elif self.policy.mode == "required":
            rest, calls = "", calls_from_constrained(self.text, self.policy)
        else:
            return {}
        out: dict[str, Any] = {}
        if rest:
            out["content"] = rest
        if calls:
            out["tool_calls"] = [{"index": i, **c.to_json()} for i, c in enumerate(calls)]
            self.num_calls = len(calls)
        return out
