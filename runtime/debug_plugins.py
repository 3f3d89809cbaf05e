"""Debug plugins: code loaded by path into the processes that run an engine, to observe or
perturb it (the fault-isolation tests inject their faults this way; a debugging session can
trace steps the same way). Product code holds only the hook points, never a test's knobs.

``SHOAL_DEBUG_PLUGINS`` names Python files (``/path/to/plugin.py``) or importable modules,
comma-separated. The engine core (in ``shoal serve``'s core process or in-process for ``LLM``)
and every tensor-parallel rank load them once at start-up; child processes inherit the
variable. A plugin calls ``register(hooks)`` at import with an ``EngineHooks`` subclass that
overrides the points it needs. Unset (the default), nothing is loaded and every hook point
costs one empty-list check.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

PLUGINS_ENV = "SHOAL_DEBUG_PLUGINS"


class EngineHooks:
    """Hook points; each default does nothing. A hook that raises acts as the code around it
    failing there: ``before_step`` as the step failing (the engine isolates the request that
    caused it), ``rank_started``/``before_rank_step`` as that rank failing."""

    def request_added(self, request: Any) -> None:
        """An ``EngineCoreRequest`` was accepted by the engine core."""

    def requests_gone(self, request_ids: list[str]) -> None:
        """These requests left the engine core (aborted or failed)."""

    def before_step(self, plan: Any) -> None:
        """The engine core is about to execute this ``StepPlan``."""

    def rank_started(self, rank: int) -> None:
        """A tensor-parallel rank process joined its group, before loading its shard."""

    def before_rank_step(self, rank: int, plan: Any) -> None:
        """A tensor-parallel rank is about to execute this ``StepPlan``."""


_hooks: list[EngineHooks] = []
_loaded: set[str] = set()


def register(hooks: EngineHooks) -> None:
    _hooks.append(hooks)


def hooks() -> list[EngineHooks]:
    return _hooks


def load_plugins() -> None:
    """Import what ``SHOAL_DEBUG_PLUGINS`` names, each at most once per process."""
    for entry in (e.strip() for e in os.environ.get(PLUGINS_ENV, "").split(",")):
        if not entry or entry in _loaded:
            continue
        _loaded.add(entry)
        if entry.endswith(".py"):
            spec = importlib.util.spec_from_file_location(
                f"shoal_debug_plugin_{len(_loaded)}", entry)
            if spec is None or spec.loader is None:
                raise ImportError(f"{PLUGINS_ENV}: cannot load {entry}")
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        else:
            importlib.import_module(entry)
