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
from .base import ToolFormat

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(SEP)
                   + r"(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
                   + r"(?P<end>" + re.escape(CALL_END) + r"|$)", re.DOTALL)


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
