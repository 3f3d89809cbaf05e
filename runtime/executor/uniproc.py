"""One Worker in the engine-core process: TP = 1 on CPU or one GPU."""

from __future__ import annotations

from shoal.runtime.config import EngineConfig
from shoal.runtime.executor.base import Executor
from shoal.runtime.kv_transfer.connector import KVBlockIO
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.wire.plan import StepPlan, StepResult


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError("UniProcExecutor runs one rank; use the multiprocess executor "
                             f"for tensor_parallel_size={config.tensor_parallel_size}")
        from shoal.runtime.worker.worker import Worker

        self.worker = Worker(config, rank=0, world_size=1)
        self.worker.load_model()

    @property
    def model_config(self) -> ModelConfig:
        return self.worker.model_config()

    def kv_bytes_per_block(self) -> int:
        return self.worker.kv_bytes_per_block()

    def profile_num_kv_blocks(self) -> int | None:
        return self.worker.profile_num_kv_blocks()

    def state_bytes_per_request(self) -> int:
        return self.worker.state_bytes_per_request()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)
        self.worker.warmup()

    def grammar_backend(self) -> GrammarBackend | None:
        return self.worker.grammars()  # shared: what the core compiles, the step finds

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def add_lora(self, name: str, path: str) -> None:
        self.worker.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        self.worker.remove_lora(name)

    def kv_block_io(self) -> KVBlockIO:
        from shoal.runtime.worker.kv_block_io import KVBlockIO as TensorBlockIO

        runner = self.worker.runner
        if runner is None:
            raise RuntimeError("the model is not loaded")
        return TensorBlockIO(runner.kv_caches)

    def check_health(self, timeout_s: float | None = None) -> None:
        """In-process: a dead worker would already have raised from ``execute``."""

    def shutdown(self) -> None:
        self.worker.runner = None  # drop the model and KV tensors
