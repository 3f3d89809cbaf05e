"""The executor: how the engine core reaches its worker(s).

One interface for one in-process worker (``UniProcExecutor``) and, later, a worker process
per tensor-parallel rank: the engine core sizes the KV cache from ``kv_bytes_per_block``,
calls ``initialize_kv_cache`` once, then ``execute`` once per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from shoal.runtime.kv_transfer.connector import KVBlockIO
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.wire.plan import StepPlan, StepResult


class Executor(ABC):
    @property
    @abstractmethod
    def model_config(self) -> ModelConfig: ...

    @abstractmethod
    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block takes on one rank (all layers, K and V)."""

    def state_bytes_per_request(self) -> int:
        """Bytes of linear-attention state one request slot holds on one rank (hybrid models;
        0 for the others)."""
        return 0

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every rank, then warm up."""

    def profile_num_kv_blocks(self) -> int | None:
        """KV blocks that fit the device after a profiled max-size step (GPU); None when the
        engine's configured budget applies (CPU)."""
        return None

    def grammar_backend(self) -> GrammarBackend | None:
        """Where the engine core compiles grammars before scheduling their requests (off its
        loop: ``runtime/structured/compiler.py``); the worker's own in one process, so the
        step finds them compiled. None: the worker compiles on the step."""
        return None

    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def add_lora(self, name: str, path: str) -> None:
        """Parse, check and register a LoRA adapter on every rank (``LoraAdapterError``
        naming why a bad one is refused)."""
        raise NotImplementedError("this executor serves no LoRA adapters")

    def remove_lora(self, name: str) -> None:
        raise NotImplementedError("this executor serves no LoRA adapters")

    def kv_block_io(self) -> KVBlockIO:
        """The KV tensors as bytes, block by block, for a KV connector (one rank only)."""
        raise NotImplementedError("this executor cannot move KV blocks between engines")

    def workers_cpu_seconds(self) -> float:
        """CPU seconds used so far by the worker processes this executor runs apart from the
        caller's (0 when the model runs in the caller's process): the engine's watchdog
        counts them as the step's progress. Safe to call from another thread."""
        return 0.0

    @abstractmethod
    def check_health(self, timeout_s: float | None = None) -> None:
        """Raise if a rank is dead, stopped or does not answer within ``timeout_s``
        (default: the config's rank_timeout)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers; safe to call twice."""
