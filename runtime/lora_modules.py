"""LoRA adapters as the flags and the load endpoint name them (vLLM's forms).

``--lora-modules`` takes ``NAME=PATH`` or a JSON object ``{"name", "path",
"base_model_name"}`` per value; ``POST /v1/load_lora_adapter`` takes ``lora_name`` and
``lora_path``. Both become a ``LoraModule``. The limits (``--max-loras`` slots in the step,
``--max-lora-rank``, ``--max-cpu-loras`` kept loaded off the step) are checked here once, so
the engine, the worker and the API agree on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoraModule:
    """One ``--lora-modules`` value: ``NAME=PATH`` or the JSON form."""
    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) \
                or not isinstance(data.get("path"), str):
            raise ValueError(f"--lora-modules {value!r}: the JSON form needs string fields "
                             "'name' and 'path' (and optionally 'base_model_name')")
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {value!r}: unknown field(s) {', '.join(unknown)}")
        base = data.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {value!r}: base_model_name must be a string")
        module = LoraModule(data["name"], data["path"], base)
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {value!r}: expected NAME=PATH or a JSON object")
        module = LoraModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"--lora-modules {value!r}: the name and the path must not be empty")
    return module


def parse_lora_modules(values: list[str]) -> list[LoraModule]:
    modules = [parse_lora_module(v) for v in values]
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--lora-modules names adapter(s) twice: {', '.join(duplicates)}")
    return modules


def check_lora_limits(enable_lora: bool, lora_modules: list[LoraModule], max_loras: int,
                      max_lora_rank: int, max_cpu_loras: int | None,
                      tensor_parallel_size: int) -> None:
    """Raise ValueError naming the flag that is wrong (refused at startup)."""
    if lora_modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if not enable_lora:
        return
    if max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1, got {max_loras}")
    if max_lora_rank < 1:
        raise ValueError(f"--max-lora-rank must be at least 1, got {max_lora_rank}")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be at least --max-loras "
                         f"({max_loras})")
    if tensor_parallel_size != 1:
        raise ValueError("--enable-lora is not supported with --tensor-parallel-size > 1 yet")
