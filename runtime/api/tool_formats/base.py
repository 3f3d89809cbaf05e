"""What a tool-call format is to the server: where its calls begin in the model's text, how
much of a text's end might be the start of that marker, and the complete calls in the text
from that point. One format per module in this package, named as vLLM's ``--tool-call-parser``.

``calls(section, final=False)`` returns only calls that nothing later can change (their end
was written), so the calls it returns while the text grows are always a prefix of the calls
of the finished text. ``open_call`` is the call being written after them, once its name is
known: its arguments so far, only the part that is sure to stay (a prefix of what they will
be), so the stream sends them piece by piece as vLLM does. A call begun is a call: when the
output ends inside one, it counts with the arguments written (as vLLM returns it), so the
streamed calls assemble to the whole-message ones (``stream.py``, ``final_calls``); a call cut
off before any argument has ``{}``, as vLLM reads Mistral's ``name[ARGS]`` at the end (clients
json.loads the arguments: ``""`` breaks them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any

from ..tool_calls import ToolCall


class ToolFormat(ABC):
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
        return held_suffix(text, self.marker)

    @abstractmethod
    def calls(self, section: str, final: bool) -> list[ToolCall]:
        """The complete calls in ``section`` (the text from ``section_start`` on); with
        ``final`` the text has ended and a call cut short there may count."""

    def open_call(self, section: str) -> tuple[int, ToolCall] | None:
        """(its index among the calls, the call so far) for a call begun after the complete
        ones; None when there is none or the format cannot tell before it ends."""
        return None

    def parameter_types(self, function: str) -> dict[str, Any]:
        """A function's parameter name -> its JSON-schema ``type`` (from the request's tools)."""
        for tool in self.tools:
            fn = tool.get("function", tool)
            if fn.get("name") == function:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def held_suffix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def final_calls(fmt: ToolFormat, section: str) -> list[ToolCall]:
    """The calls of a finished text: the complete ones, and one cut short by the end (``{}``
    when it ended before its arguments began)."""
    calls = fmt.calls(section, final=True)
    begun = fmt.open_call(section)
    if begun is not None and begun[0] == len(calls):
        cut = begun[1]
        calls.append(cut if cut.arguments.strip() else replace(cut, arguments="{}"))
    return calls


def parse_whole(fmt: ToolFormat, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished message; content None when it is only calls. Text in
    which no call begins stays content, whole."""
    start = fmt.section_start(text)
    if start is None:
        return text, []
    calls = final_calls(fmt, text[start:])
    if not calls:
        return text, []
    return text[:start].strip() or None, calls
