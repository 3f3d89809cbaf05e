"""Reading tool calls out of free text (``tool_choice`` auto), whole; ``tool_stream.py`` reads
the same formats as they arrive.

Two formats, tried in this order: hermes-style ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` blocks (Qwen 2/2.5/3, Hermes), and Llama 3's bare JSON
``{"name": ..., "parameters": {...}}`` (several separated by ``;``) as the whole message.
Text that does not parse stays content: a model that half-writes a call loses nothing;
except a last block cut short (max_tokens) once its arguments began: that is the call with
the arguments written, as the stream has sent it (vLLM's stream too), so the streamed calls
still assemble to the whole-message ones.
A call's ``arguments`` is the model's own JSON text for them (as OpenAI sends it), not a
re-serialisation: the streamed deltas are that text piece by piece, so both agree.
"""

from __future__ import annotations

import json
import re

from .json_text import raw_members
from .tool_calls import ToolCall

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls). Content is None when the message is only calls."""
    if TOOL_CALL_START in text:
        calls = [c for block in _HERMES.findall(text) if (c := call_from_json(block))]
        cut = cut_short_call(text)
        if cut is not None:
            calls.append(cut)
        if calls:
            content = text[:text.index(TOOL_CALL_START)].strip()
            return content or None, calls
        return text, []
    stripped = text.strip()
    if stripped.startswith("{"):
        parts = [p.strip() for p in stripped.split(";")] if ";" in stripped else [stripped]
        found = [call_from_json(p) for p in parts]
        if found and all(found):
            return None, [c for c in found if c]
    return text, []


def cut_short_call(text: str) -> ToolCall | None:
    """The last block, if the text ended inside it (no ``</tool_call>``, its JSON unfinished)
    after its name and the start of its arguments: the call as ``CallObjectStream`` streams
    it."""
    body = text[text.rindex(TOOL_CALL_START) + len(TOOL_CALL_START):]
    if TOOL_CALL_END in body or call_from_json(body.strip()) is not None:
        return None
    from .tool_call_stream import CallObjectStream  # (it imports this module)

    block = CallObjectStream(0)
    block.deltas(body)
    return block.call


def call_from_json(block: str) -> ToolCall | None:
    """The call in one ``{"name": ..., "arguments"|"parameters": ...}`` object, if it is one."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None:
        return ToolCall(obj["name"], "{}")
    if isinstance(obj[key], str):  # some models write the arguments as a JSON string
        return ToolCall(obj["name"], obj[key])
    return ToolCall(obj["name"], raw_members(block)[key])


def partial_marker(text: str) -> int:
    """How many trailing characters could be the start of ``<tool_call>``."""
    for n in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0
