"""Tool-call formats by vLLM's ``--tool-call-parser`` names, one per module. Without the flag
the server reads hermes ``<tool_call>`` JSON and Llama 3 JSON (``tool_parsers.py``), which
is also what ``hermes`` and ``llama3_json`` name."""

from __future__ import annotations

from typing import Any

from .base import ToolFormat, parse_whole
from .deepseek_v3 import DeepSeekV3Format
from .mistral import MistralFormat
from .openai import OpenAIFormat
from .pythonic import PythonicFormat
from .qwen3_coder import Qwen3CoderFormat
from .stream import FormatCallStream

FORMATS: dict[str, type[ToolFormat]] = {
    f.name: f for f in (MistralFormat, Qwen3CoderFormat, PythonicFormat, DeepSeekV3Format,
                        OpenAIFormat)}
BUILT_IN = ("hermes", "llama3_json")  # the default reading (tool_parsers.py)
TOOL_CALL_PARSERS = (*BUILT_IN, *FORMATS)


def tool_format(name: str | None, tools: list[dict[str, Any]] | None) -> ToolFormat | None:
    """The request's format; None for the built-in reading."""
    if name is None or name in BUILT_IN:
        return None
    return FORMATS[name](tools)


__all__ = ["FORMATS", "TOOL_CALL_PARSERS", "FormatCallStream", "ToolFormat", "parse_whole",
           "tool_format"]
