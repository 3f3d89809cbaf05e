"""``--tool-call-parser pythonic``: the whole message is a Python list of calls with keyword
arguments, ``[get_weather(city="Paris", days=3), ping()]`` (Llama 3.2 / Llama 4 style), read
as vLLM's parser reads it: with ``ast``, the argument values Python literals (strings,
numbers, True/False/None, lists, dicts) turned into JSON. A message that is not such a list
is content, whole. Its calls are known only when the message ends (a list that closes may
still be followed by text that makes it content), so they stream then.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from ..tool_calls import ToolCall
from .base import ToolFormat


def _value(node: ast.AST) -> Any:
    value = ast.literal_eval(node)
    json.dumps(value)  # a tuple or set is not JSON: TypeError
    return value


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        args[keyword.arg] = _value(keyword.value)
    return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))


class PythonicFormat(ToolFormat):
    name = "pythonic"

    def section_start(self, text: str) -> int | None:
        return 0 if text.startswith("[") else None  # as vLLM: the message is the list

    def held_back(self, text: str) -> int:
        return 0

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        if not final:
            return []
        try:
            tree = ast.parse(section.rstrip(), mode="eval")
            if not isinstance(tree.body, ast.List) or not tree.body.elts:
                return []
            calls = [_call(node) for node in tree.body.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return []
        return [c for c in calls if c is not None] if all(calls) else []
