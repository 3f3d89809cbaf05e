"""``--tool-call-parser deepseek_v3``: DeepSeek-V3 / R1-0528's calls, as vLLM's parser reads
them::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

A call is complete at its ``<｜tool▁call▁end｜>`` (or, when the output ends, at the closing
fence); its arguments are the model's text between the fences.
"""

from __future__ import annotations

import re

from ..tool_calls import ToolCall
from .base import ToolFormat, held_suffix

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(SEP)
                   + r"(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
                   + r"(?P<end>" + re.escape(CALL_END) + r"|$)", re.DOTALL)
_OPEN = re.compile(re.escape(CALL_BEGIN) + r".*?" + re.escape(SEP) + r"(?P<name>[^\n]*)\n```json\n"
                   + r"(?P<args>.*)", re.DOTALL)
FENCE = "\n```"


class DeepSeekV3Format(ToolFormat):
    name = "deepseek_v3"
    marker = CALLS_BEGIN

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out = []
        for match in _CALL.finditer(section):
            if not match.group("end") and not (final and not section[match.end():].strip()):
                break  # the fence closed but the call has not ended: more may follow
            out.append(ToolCall(match.group("name").strip(), match.group("args")))
        return out

    def open_call(self, section: str) -> tuple[int, ToolCall] | None:
        """The call after the complete ones, once its fence opened: the text so far, less
        what could begin the closing fence."""
        done = len(self.calls(section, final=False))
        begins = section.split(CALL_BEGIN)
        if len(begins) < done + 2:
            return None
        match = _OPEN.match(CALL_BEGIN + begins[done + 1])
        if match is None:
            return None
        args = match.group("args")
        fence = args.find(FENCE)
        args = args[:fence] if fence >= 0 else args[:len(args) - held_suffix(args, FENCE)]
        return done, ToolCall(match.group("name").strip(), args)
