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
import re
import string
from dataclasses import dataclass

from ..json_text import raw_members
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


_ITEM_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')  # its string closed
_ITEM_ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


@dataclass
class _Array:
    calls: list[ToolCall]  # the items written whole
    closed: bool  # its ``]`` was written
    open: ToolCall | None  # the item being written, once its name is


def _item_call(raw: str) -> ToolCall | None:
    """An array item's call, None when the item is no call (neither a name nor arguments).
    As vLLM reads one: a name that is not a string is "", missing or null arguments are {}."""
    members = raw_members(raw) if raw.startswith("{") else {}
    if "name" not in members and "arguments" not in members:
        return None
    name = json.loads(members.get("name", "null"))
    args = members.get("arguments", "null")
    if args == "null":
        args = "{}"
    elif args.startswith('"'):  # the arguments written as a JSON string
        args = str(json.loads(args))
    return ToolCall(name if isinstance(name, str) else "", args, mistral_call_id())


def _array(piece: str) -> _Array:
    """A pre-v11 ``[{"name": ..., "arguments": {...}}, ...]`` as far as it is written; an
    item that is no call is skipped (as vLLM skips it), text that is not JSON ends it."""
    text = piece.lstrip()
    calls: list[ToolCall] = []
    at = 1
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ","):
            at += 1
        if at == len(text):
            return _Array(calls, False, None)
        if text[at] == "]":
            return _Array(calls, True, None)
        try:
            _, end = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:  # the item is being written (or is not JSON)
            name = _ITEM_NAME.match(text, at)
            if name is None:
                return _Array(calls, False, None)
            header = _ITEM_ARGUMENTS.match(text, name.end())
            args = text[header.end():] if header is not None else ""
            if not args.startswith(("{", "[")):  # none yet, or a JSON string: at the end
                args = ""
            return _Array(calls, False, ToolCall(json.loads(name.group(1)),
                                                 _json_prefix(args) or args.rstrip(),
                                                 mistral_call_id()))
        call = _item_call(text[at:end])
        if call is not None:
            calls.append(call)
        at = end


def _pre_v11(piece: str) -> _Array | None:
    """A pre-v11 piece as far as it is written: its array of calls, or one call object
    written bare (vLLM reads that as the one call); None when the piece is v7+."""
    text = piece.lstrip()
    if text.startswith("["):
        return _array(text)
    if text.startswith("{"):
        array = _array("[" + text)
        return _Array(array.calls[:1], False, None if array.calls else array.open)
    return None


class MistralFormat(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def calls(self, section: str, final: bool) -> list[ToolCall]:
        out: list[ToolCall] = []
        for piece in section.split(self.marker)[1:]:
            array = _pre_v11(piece)
            if array is not None:  # the items written so far count
                out += array.calls
                if not array.closed:
                    break
                continue
            found = self._piece(piece)
            if found is None:
                break  # not ended (or not a call): nothing after it counts yet
            out += found
        return out

    def open_call(self, section: str) -> tuple[int, ToolCall] | None:
        """The call being written: v7+, its name once ``[ARGS]`` (or ``{``) follows it, and
        its JSON text so far (whitespace before it dropped, as the finished call drops it,
        and after it until more follows, as vLLM drops it from a call cut short);
        pre-v11, the array item (or bare call object) after the complete ones once its
        ``"name"`` is written (as vLLM sends it), its arguments once they begin an object or
        array (arguments written as a JSON string are sent when the item ends)."""
        done = 0
        for piece in section.split(self.marker)[1:]:
            array = _pre_v11(piece)
            if array is not None:
                if array.closed:
                    done += len(array.calls)
                    continue
                return (done + len(array.calls), array.open) if array.open else None
            found = self._piece(piece)
            if found is not None:
                done += len(found)
                continue
            name, rest = self._name_and_rest(piece)
            if not name or rest is None:
                return None
            return done, ToolCall(name, rest.strip(), mistral_call_id())
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
        """A v7+ piece's call, once its JSON ended."""
        name, rest = self._name_and_rest(piece)
        if rest is None:
            return None
        written = _json_prefix(rest)
        if not name or written is None:
            return None
        return [ToolCall(name, written, mistral_call_id())]
