"""The text of a JSON value's parts as they were written (the stdlib's scanner finds where
each begins and ends), for tool-call arguments sent as the model wrote them."""

from __future__ import annotations

import json

_DECODER = json.JSONDecoder()


def raw_members(text: str) -> dict[str, str]:
    """Each top-level member of a valid JSON object, as the text it was written as."""
    pos = _skip(text, 0) + 1  # past "{"
    out: dict[str, str] = {}
    while True:
        pos = _skip(text, pos)
        if text[pos] == "}":
            return out
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip(text, _skip(text, pos) + 1)  # past ":"
        _, end = _DECODER.raw_decode(text, pos)
        out[key] = text[pos:end]
        pos = _skip(text, end)
        if text[pos] == ",":
            pos += 1


def raw_array_items(text: str) -> list[str]:
    """Each item of a valid JSON array, as the text it was written as."""
    pos = _skip(text, 0) + 1  # past "["
    items: list[str] = []
    while True:
        pos = _skip(text, pos)
        if text[pos] == "]":
            return items
        _, end = _DECODER.raw_decode(text, pos)
        items.append(text[pos:end])
        pos = _skip(text, end)
        if text[pos] == ",":
            pos += 1


def _skip(text: str, pos: int) -> int:
    """Past JSON whitespace from ``pos``."""
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos
