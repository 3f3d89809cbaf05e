"""``--tool-call-parser mistral``: ``[TOOL_CALLS]`` then the calls, in the shapes Mistral's
tokenizers write them (as vLLM's parser reads them):

- v11+ (Mistral Small 3.2, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}``, one marker
  per call (``[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}``);
- v7-v10: ``[TOOL_CALLS]name[CALL_ID]abc123XYZ[ARGS]{...}``;
- pre-v11 (Mistral 7B v0.3, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

The arguments are the model's own JSON text. ``[TOOL_CALLS]`` is a special token in those
tokenizers, so with this parser the output is detokenized with special tokens kept. Call ids
are 9 letters and digits: Mistral's chat templates refuse any other id when the calls come
back in the conversation.
"""

from __future__ import annotations

import json
import random
import string

from ..json_text import raw_array_items, raw_members
from ..tool_calls import ToolCall
from .base import ToolFormat

_DECODER = json.JSONDecoder()
_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


def _json_prefix(text: str) -> str | None:
    """The JSON value ``text`` starts with (after whitespace), as written; None if it has
    not ended yet or is not JSON."""
    stripped = text.lstrip()
    try:
        _, end = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError:
        return None
    return stripped[:end]


class MistralFormat(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out: list[ToolCall] = []
        for piece in section.split(self.marker)[1:]:
            found = self._piece(piece)
            if found is None:
                break  # not ended (or not a call): nothing after it counts yet
            out += found
        return out

    def open_call(self, section: str) -> tuple[int, ToolCall] | None:
        """The v7+ call being written: its name once ``[ARGS]`` (or ``{``) follows it, and
        its JSON text so far (whitespace before it dropped, as the finished call drops it).
        A pre-v11 array is sent when it closes."""
        done = 0
        for piece in section.split(self.marker)[1:]:
            found = self._piece(piece)
            if found is not None:
                done += len(found)
                continue
            if piece.lstrip().startswith("["):
                return None
            name, rest = self._name_and_rest(piece)
            if not name or rest is None:
                return None
            return done, ToolCall(name, rest.lstrip(), mistral_call_id())
        return None

    @staticmethod
    def _name_and_rest(piece: str) -> tuple[str, str | None]:
        name, sep, rest = piece.partition("[ARGS]")
        if not sep:
            brace = piece.find("{")  # some releases write name{...} with no separator
            if brace < 0:
                return "", None
            name, rest = piece[:brace], piece[brace:]
        return name.partition("[CALL_ID]")[0].strip(), rest

    def _piece(self, piece: str) -> list[ToolCall] | None:
        if piece.lstrip().startswith("["):  # pre-v11: a JSON array of call objects
            array = _json_prefix(piece)
            if array is None:
                return None
            calls = []
            for item in raw_array_items(array):
                members = raw_members(item) if item.startswith("{") else {}
                if not members.get("name", "").startswith('"'):
                    return None
                args = members.get("arguments", "{}")
                if args.startswith('"'):  # the arguments written as a JSON string
                    args = str(json.loads(args))
                calls.append(ToolCall(json.loads(members["name"]), args, mistral_call_id()))
            return calls
        name, rest = self._name_and_rest(piece)
        if rest is None:
            return None
        written = _json_prefix(rest)
        if not name or written is None:
            return None
        return [ToolCall(name, written, mistral_call_id())]
