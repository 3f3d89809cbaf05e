"""Which executor an engine gets: in-process for one rank, one process per rank beyond."""

from __future__ import annotations

from shoal.runtime.config import EngineConfig
from shoal.runtime.executor.base import Executor


def create_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size == 1:  # at least 1: EngineConfig checked it when built
        from shoal.runtime.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)
    from shoal.runtime.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
