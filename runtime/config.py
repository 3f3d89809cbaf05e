"""Engine configuration: one typed object built from CLI flags (vLLM's names) or kwargs.

It holds each engine default once (``shoal serve``'s flags and the scheduler take theirs from
here) and checks itself when built or replaced: a value out of range is a ``ValueError``
naming the field, before any process starts or any memory is sized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shoal.runtime.kv_transfer.params import KVTransferConfig
from shoal.runtime.lora_modules import LoraModule
from shoal.runtime.pooling_config import PoolerConfig

from shoal.contract.kv import DEFAULT_BLOCK_SIZE

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# --kv-cache-dtype (vLLM's names): auto = the model's dtype; fp8 = fp8_e4m3 (one byte each)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")

# field -> (lowest allowed, highest allowed or None, whether the lowest itself is allowed);
# None values (meaning "derive it") are not checked
RANGES: dict[str, tuple[float, float | None, bool]] = {
    "max_num_seqs": (1, None, True),
    "max_num_batched_tokens": (1, None, True),
    "block_size": (1, None, True),
    "max_model_len": (2, None, True),
    "kv_cache_memory": (0, None, False),
    "num_kv_blocks": (1, None, True),
    "gpu_memory_utilization": (0.0, 1.0, False),
    "tensor_parallel_size": (1, None, True),
    "max_logprobs": (0, None, True),
    "rank_timeout": (0.0, None, False),
    "grammar_compile_timeout": (0.0, None, False),
}


class ConfigRangeError(ValueError):
    """A field out of its range; ``field`` and ``rule`` let a CLI name its own flag."""

    def __init__(self, field: str, rule: str, value: float) -> None:
        super().__init__(f"{field} must be {rule}, got {value}")
        self.field, self.rule, self.value = field, rule, value

    def as_flag(self) -> str:
        return f"--{self.field.replace('_', '-')} must be {self.rule}, got {self.value}"


def check_range(name: str, value: float | None) -> None:
    """Raises ConfigRangeError naming ``name`` when ``value`` lies outside ``RANGES[name]``."""
    if value is None:
        return
    low, high, low_allowed = RANGES[name]
    if value < low or (value == low and not low_allowed):
        raise ConfigRangeError(name, f"at least {low}" if low_allowed else f"greater than {low}",
                               value)
    if high is not None and value > high:
        raise ConfigRangeError(name, f"at most {high}", value)


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    model_revision: str = ""  # part of every block hash: a new revision never reuses old KV
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: the checkpoint's on CPU, bf16 on GPU)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None  # None: from config.json
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    # vLLM's flag: one block table for every layer even when sliding and full layers mix
    # (each layer then keeps every block; ``kv/kv_groups.py``)
    disable_hybrid_kv_cache_manager: bool = False
    kv_cache_memory: int | None = None  # bytes of KV cache (CPU); None: a default budget
    num_kv_blocks: int | None = None  # exact block count, overrides the memory budget (tests)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    load_format: str = "auto"  # auto: the checkpoint | dummy: random weights from config.json alone
    quantization: str | None = None  # the checkpoint's method, checked (None: as it says)
    attention_backend: str = "auto"  # auto | torch | cpu | triton | flashinfer
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES: fp8 halves a KV block's bytes
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
    # P/D disaggregation (vLLM's --kv-transfer-config): this engine's KV connector
    kv_transfer_config: KVTransferConfig | None = None
    # --hf-overrides: merged into config.json wherever the model's config is read
    hf_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in RANGES:
            check_range(name, getattr(self, name))
        if self.kv_transfer_config is not None:
            # as vLLM does with a KV connector: a transfer moves one block table per request,
            # so a model mixing sliding and full layers keeps one table for every layer
            self.disable_hybrid_kv_cache_manager = True
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)  # type: ignore[arg-type]
