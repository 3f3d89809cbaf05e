"""``--tool-call-parser openai``: gpt-oss's calls. The model addresses a message to a function
(``to=functions.NAME`` in a harmony header, ``harmony.py``) and ends it with ``<|call|>``;
the harmony reading hands each such message on as one canonical fragment,
``<|start|>assistant to=functions.NAME<|message|>ARGUMENTS<|call|>``, read here. The
arguments are the message body as the model wrote it (JSON for gpt-oss's function tools),
streamed as they are written.
"""

from __future__ import annotations

import re

from ..tool_calls import ToolCall
from .base import ToolFormat, held_suffix

CALL_START = "<|start|>assistant to=functions."
CALL_MESSAGE = "<|message|>"
CALL_END = "<|call|>"
_CALL = re.compile(re.escape(CALL_START) + r"(?P<name>[^<]*?)" + re.escape(CALL_MESSAGE)
                   + r"(?P<args>.*?)(?P<end>" + re.escape(CALL_END) + r"|$)", re.DOTALL)


def call_start(name: str) -> str:
    return f"{CALL_START}{name}{CALL_MESSAGE}"


class OpenAIFormat(ToolFormat):
    name = "openai"
    marker = CALL_START
    keeps_special_tokens = True

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out = []
        for match in _CALL.finditer(section):
            if not match.group("end"):
                break
            out.append(ToolCall(match.group("name"), match.group("args")))
        return out

    def open_call(self, section: str) -> tuple[int, ToolCall] | None:
        for index, match in enumerate(_CALL.finditer(section)):
            if not match.group("end"):
                args = match.group("args")
                return index, ToolCall(match.group("name"),
                                       args[:len(args) - held_suffix(args, CALL_END)])
        return None
