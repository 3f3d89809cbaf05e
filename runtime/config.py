"""Engine configuration: one typed object built from CLI flags (vLLM's names) or kwargs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from shoal.runtime.lora_modules import LoraModule
from shoal.runtime.pooling_config import PoolerConfig


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    model_revision: str = ""  # part of every block hash: a new revision never reuses old KV
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: the checkpoint's on CPU, bf16 on GPU)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # None: from config.json
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes of KV cache (CPU); None: a default budget
    num_kv_blocks: int | None = None  # exact block count, overrides the memory budget (tests)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    load_format: str = "auto"  # auto: the checkpoint | dummy: random weights from config.json alone
    quantization: str | None = None  # the checkpoint's method, checked (None: as it says)
    attention_backend: str = "auto"  # auto | torch | cpu | triton | flashinfer
    scheduling_policy: str = "fcfs"  # fcfs | priority
    max_logprobs: int = 20
    rank_timeout: float = 30.0  # seconds a rank may make no progress before the engine is fatal
    kv_events_endpoint: str | None = None  # zmq PUB address for block stored/removed events
    kv_events_topic: str | None = None  # None: kv@<pod>@<served model name>, as llm-d reads
    grammar_compile_timeout: float = 10.0  # seconds one grammar may compile; over it: a 400
    # LoRA (vLLM's flags): adapters served beside the base, batched in one step
    enable_lora: bool = False
    lora_modules: list[LoraModule] = field(default_factory=list)  # loaded at startup
    max_loras: int = 1  # adapter slots one step may use
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept parsed in memory (LRU); None: max_loras
    # --runner pooling: every request is an embedding (its prompt pooled, nothing sampled)
    pooler: PoolerConfig | None = None

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]
