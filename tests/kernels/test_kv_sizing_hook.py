"""GPU KV sizing reaches the engine: a profiled block count wins unless a size is configured."""

from __future__ import annotations

from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.executor.base import Executor
from shoal.runtime.model.config import load_model_config


class ProfilingExecutor(Executor):
    """Reports a profiled size like a GPU worker would; runs no steps."""

    def __init__(self, model_dir, profiled: int | None) -> None:
        self._model_config = load_model_config(model_dir)
        self.profiled = profiled
        self.profile_calls = 0
        self.allocated: int | None = None

    @property
    def model_config(self):
        return self._model_config

    def kv_bytes_per_block(self) -> int:
        return 1024

    def profile_num_kv_blocks(self) -> int | None:
        self.profile_calls += 1
        return self.profiled

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.allocated = num_blocks

    def execute(self, plan):
        raise AssertionError("no steps in this test")

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_the_profiled_block_count_sizes_the_cache(tiny_qwen3):
    executor = ProfilingExecutor(tiny_qwen3, profiled=77)
    EngineCore(EngineConfig(model=str(tiny_qwen3)), executor)
    assert executor.allocated == 77


def test_an_explicit_size_is_not_second_guessed_by_profiling(tiny_qwen3):
    executor = ProfilingExecutor(tiny_qwen3, profiled=77)
    EngineCore(EngineConfig(model=str(tiny_qwen3), num_kv_blocks=12), executor)
    assert executor.allocated == 12 and executor.profile_calls == 0

    executor = ProfilingExecutor(tiny_qwen3, profiled=77)
    EngineCore(EngineConfig(model=str(tiny_qwen3), kv_cache_memory=1024 * 30), executor)
    assert executor.allocated == 30 and executor.profile_calls == 0


def test_cpu_workers_do_not_profile_and_the_configured_budget_applies(tiny_qwen3):
    from shoal.runtime.worker.worker import Worker

    worker = Worker(EngineConfig(model=str(tiny_qwen3), device="cpu"))
    worker.load_model()
    assert worker.profile_num_kv_blocks() is None

    executor = ProfilingExecutor(tiny_qwen3, profiled=None)
    EngineCore(EngineConfig(model=str(tiny_qwen3), kv_cache_memory=1024 * 40), executor)
    assert executor.allocated == 40
    executor = ProfilingExecutor(tiny_qwen3, profiled=None)
    EngineCore(EngineConfig(model=str(tiny_qwen3)), executor)
    assert executor.profile_calls == 1 and executor.allocated and executor.allocated > 0
