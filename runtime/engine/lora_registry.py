"""The engine core's record of the LoRA adapters it serves, and their unloading.

An adapter is added on every rank first (parsed and checked there: a bad one raises
ValueError naming why and nothing is recorded). Unloading retires it: new requests naming it
are refused at once, while the requests already holding it run to their end; the worker
forgets it after the last of them (``retire_unused``, checked after each step only while
something is retiring), so an unload never drops a request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class _HasAdapter(Protocol):
    lora_name: str | None


class _Executor(Protocol):
    def add_lora(self, name: str, path: str) -> None: ...

    def remove_lora(self, name: str) -> None: ...


class LoraRegistry:
    def __init__(self, executor: _Executor) -> None:
        self.executor = executor
        self.paths: dict[str, str] = {}
        self.retiring: set[str] = set()

    def serves(self, name: str) -> bool:
        return name in self.paths and name not in self.retiring

    def add(self, name: str, path: str) -> None:
        if name in self.retiring:
            raise ValueError(f"The lora adapter '{name}' is being unloaded; retry once its "
                             "requests have finished.")
        if name in self.paths:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        self.executor.add_lora(name, path)
        self.paths[name] = path

    def retire(self, name: str) -> None:
        if not self.serves(name):
            raise KeyError(name)
        self.retiring.add(name)

    def retire_unused(self, requests: Iterable[_HasAdapter]) -> None:
        in_use = {r.lora_name for r in requests}
        for name in sorted(self.retiring - in_use):
            self.executor.remove_lora(name)
            del self.paths[name]
            self.retiring.discard(name)
