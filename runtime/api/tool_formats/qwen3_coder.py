"""``--tool-call-parser qwen3_coder``: Qwen3-Coder's XML calls, as vLLM's parser reads them::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are text; each becomes the JSON type the function's schema gives its parameter, tried
in vLLM's order (null, integer, number, boolean, object, array, then the text itself), and a
parameter the schema does not type stays a string. One newline after ``<parameter=..>`` and
before ``</parameter>`` is the template's markup, not the value. A call is complete at its
``</function>``; when the output ends inside one, the call counts with the parameters
that were closed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..tool_calls import ToolCall
from .base import ToolFormat

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|$)", re.DOTALL)
# a parameter ends at its close tag or where the next one opens; one cut off by the end of
# the output is dropped (vLLM's reading)
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=))",
                        re.DOTALL)
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def typed_value(text: str, schema_type: Any) -> Any:
    types = schema_type if isinstance(schema_type, list) else [schema_type]
    for kind in (k for k in _ORDER if k in types):
        if kind == "string":
            return text
        if kind == "null" and text.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(text)
            except ValueError:
                continue
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if not math.isfinite(number):  # not a JSON number: kept as text
                continue
            return int(number) if number.is_integer() else number
        if kind == "boolean" and text.lower().strip() in ("true", "1", "false", "0"):
            return text.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                continue
            if _finite(value):
                return value
    try:  # no type matched: JSON if it is JSON (vLLM's fallback), else the text
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if _finite(value) else text


def _finite(value: Any) -> bool:
    """No inf/nan anywhere (json.dumps would write them as invalid JSON)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _trim(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderFormat(ToolFormat):
    name = "qwen3_coder"
    marker = "<tool_call>"

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out = []
        for match in _FUNCTION.finditer(section):
            if not match.group(3) and not final:
                break
            out.append(ToolCall(match.group(1).strip(), self._members(match) + "}"))
        return out

    def open_call(self, section: str) -> tuple[int, ToolCall] | None:
        """The function being written: its parameters closed so far, as the opening of
        its arguments object (each streams once its ``</parameter>`` is written)."""
        for index, match in enumerate(_FUNCTION.finditer(section)):
            if not match.group(3):
                return index, ToolCall(match.group(1).strip(), self._members(match))
        return None

    def _members(self, match: re.Match[str]) -> str:
        """``{`` and the closed parameters as JSON members, as ``json.dumps`` writes an
        object (so the finished text is the object with ``}`` added)."""
        name = match.group(1).strip()
        types = self.parameter_types(name)
        members = [
            json.dumps(key.strip(), ensure_ascii=False) + ": " + json.dumps(
                typed_value(_trim(value), types.get(key.strip(), "string")), ensure_ascii=False)
            for key, value in _PARAMETER.findall(match.group(2))]
        return "{" + ", ".join(members)
