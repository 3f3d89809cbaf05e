"""Tool calling: what ``tools`` + ``tool_choice`` ask of the sampler, and the tool calls read
back from the model's text.

``none``: the tools are still shown to the template but the text is plain content. ``auto``
(default with tools): the model decides; its text is parsed for calls (``tool_parsers``).
``required`` and a named function constrain the output with a grammar, so the arguments
always validate against the function's schema (as vLLM does): named -> the text *is* the
arguments object; required -> a JSON array of ``{"name", "parameters"}``, one item unless
``parallel_tool_calls``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.runtime.structured.spec import GrammarSpec, json_schema_spec

from .errors import bad_request
from .json_text import raw_array_items, raw_members
from .protocol import ChatTool, NamedToolChoice, ToolChoice

if TYPE_CHECKING:
    from .tool_formats import ToolFormat

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPolicy:
    """How one request's output relates to its tools."""

    mode: str  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function, when mode == "named"
    format: ToolFormat | None = None  # --tool-call-parser's, for auto; None: hermes / Llama 3

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def tool_policy(tools: list[ChatTool] | None, choice: ToolChoice | None,
                parser: str | None = None) -> ToolPolicy:
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return ToolPolicy("none")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in tools]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not "
                              f"among the tools ({', '.join(names)})", "tool_choice")
        return ToolPolicy("named", choice.function.name)
    from .tool_formats import tool_format  # (the formats import ToolCall from here)

    return ToolPolicy(choice or "auto", format=tool_format(
        parser, [t.model_dump(exclude_none=True) for t in tools]))


def tool_grammar(tools: list[ChatTool], policy: ToolPolicy, parallel: bool) -> GrammarSpec:
    if policy.mode == "named":
        tool = next(t for t in tools if t.function.name == policy.named)
        return json_schema_spec(parameters_schema(tool), "tools")
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": parameters_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json_schema_spec(schema, "tools")


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or NO_ARGUMENTS


def calls_from_constrained(text: str, policy: ToolPolicy) -> list[ToolCall]:
    """The calls in a grammar-constrained output (empty if it was cut short before the
    call began, e.g. while the model was still reasoning: as vLLM, no call then)."""
    if policy.mode == "named":
        assert policy.named is not None
        return [ToolCall(policy.named, text)] if text.strip() else []
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []
    # the parameters as written (the grammar made them valid), as the stream sends them
    return [ToolCall(item["name"], raw_members(raw)["parameters"])
            for item, raw in zip(items, raw_array_items(text), strict=True)
            if isinstance(item, dict) and "name" in item and "parameters" in item]
