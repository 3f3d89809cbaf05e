"""A checkpoint's config.json as JSON (vLLM's ``--hf-overrides`` merged in): what the API
process needs of it (the architecture, the model type) without importing torch and
transformers: the API process of a test server, ready, held 276 MB and had used 2.2 CPU-s
with them, 76 MB and 0.5 CPU-s without. The engine core builds the full ``ModelConfig``
from the same dict (``model/config.py``) and refuses what it does not serve."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shoal.runtime.model_source import gguf_file


def with_overrides(raw: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``--hf-overrides``: config.json with the overrides merged in, as vLLM merges them (a
    dict value updates the nested config it names, key by key; anything else replaces)."""
    out = dict(raw)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = with_overrides(out[key], value)
        else:
            out[key] = value
    return out


def read_config_json(model_dir: str | Path,
                     hf_overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An HF checkpoint directory's config.json, overrides merged; it must name its
    architecture."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    raw = json.loads(config_path.read_text())
    if hf_overrides:
        raw = with_overrides(raw, hf_overrides)
    if not raw.get("architectures"):
        raise ValueError(f"{config_path}: 'architectures' is missing")
    return raw


def architecture_and_model_type(model: str | Path,
                                hf_overrides: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """The architecture a checkpoint names and its model type (the text config's where it
    names one). A GGUF file's come from its metadata, through the model config (its
    tokenizer needs transformers anyway)."""
    if gguf_file(model) is not None:
        from shoal.runtime.model.config import load_model_config

        config = load_model_config(model, hf_overrides)
        return config.architecture, config.model_type
    raw = read_config_json(model, hf_overrides)
    text = raw.get("text_config")
    model_type = (text.get("model_type") if isinstance(text, dict) else None) or \
        raw.get("model_type", "")
    return str(raw["architectures"][0]), str(model_type)
