"""What a tool-call format is to the server: where its calls begin in the model's text, how
much of a text's end might be the start of that marker, and the complete calls in the text
from that point. One format per module in this package, named as vLLM's ``--tool-call-parser``.

``calls(section, final=False)`` returns only calls that nothing later can change (their end
was written), so the calls it returns while the text grows are always a prefix of the calls
of the finished text: that is what lets the stream send each call once, and the streamed
calls assemble to the whole-message ones (``stream.py``, ``parse_whole``).
"""

from __future__ import annotations

from typing import Any

from ..tool_calls import ToolCall


class ToolFormat:
    name = ""
    marker = ""  # where the calls begin; "" when a format says otherwise (section_start)
    keeps_special_tokens = False  # its markers are special tokens: detokenize them

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def section_start(self, text: str) -> int | None:
        """Where the calls begin in ``text`` (None: not there, or not yet)."""
        at = text.find(self.marker)
        return at if at >= 0 else None

    def held_back(self, text: str) -> int:
        """How many trailing characters could begin the marker (not content yet)."""
        for n in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-n:]):
                return n
        return 0

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        """The complete calls in ``section`` (the text from ``section_start`` on); with
        ``final`` the text has ended and a call cut short there may count."""
        raise NotImplementedError

    def parameter_types(self, function: str) -> dict[str, Any]:
        """A function's parameter name -> its JSON-schema ``type`` (from the request's tools)."""
        for tool in self.tools:
            fn = tool.get("function", tool)
            if fn.get("name") == function:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def parse_whole(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished message; content None when it is only calls. Text in
    which no complete call is found stays content, whole."""
    start = fmt.section_start(text)
    if start is None:
        return text, []
    calls = fmt.calls(text[start:], final=True)
    if not calls:
        return text, []
    return text[:start].strip() or None, calls
