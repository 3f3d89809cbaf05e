"""Sampling defaults from the checkpoint's generation_config.json (``--generation-config``):
what the model's authors ask for when a request does not say (Qwen3: temperature 0.6,
top_p 0.95, top_k 20), as vLLM applies them. A request's own field always wins.

``auto`` (the default) reads the model directory's file, ``none`` keeps the neutral
defaults (temperature 1, top_p 1, no top_k), a directory reads that directory's file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("shoal.api")

# generation_config.json field -> the request field it defaults (vLLM's list)
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
           "repetition_penalty": 1.0}


def load_sampling_defaults(model_dir: str, mode: str) -> dict[str, Any]:
    """The request defaults the checkpoint sets (only the fields it sets)."""
    if mode == "none":
        return {}
    path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"--generation-config {mode}: no generation_config.json there")
        return {}
    data = json.loads(path.read_text())
    defaults = {ours: data[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items()
                if isinstance(data.get(theirs), (int, float))
                and not isinstance(data.get(theirs), bool)}
    if defaults:
        logger.info("sampling defaults from %s (a request's own fields override them): %s",
                    path, ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())))
    return defaults


def default_of(defaults: dict[str, Any], name: str, given: Any) -> Any:
    """The request's value, else the checkpoint's, else the neutral one."""
    if given is not None:
        return given
    return defaults.get(name, NEUTRAL.get(name))
