"""A flag whose value is a JSON object (vLLM's ``--kv-events-config``, ``--pooler-config``):
parsed and its keys checked in one place, so every such flag says the same things the same
way when its value is wrong."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any


def json_object_flag(flag: str, text: str,
                     known_keys: Collection[str] | None) -> dict[str, Any]:
    """The object ``text`` holds; ValueError naming ``flag`` when it is not JSON, not an
    object, or has a key outside ``known_keys`` (a misspelt key is an error, not ignored;
    None: any key, as for ``--hf-overrides``, whose keys are config.json's)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = [] if known_keys is None else sorted(set(value) - set(known_keys))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known_keys or ()))})")
    return value
