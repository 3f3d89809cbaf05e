"""ModelConfig: the model's shape, read from an HF checkpoint's config.json.

Accepts both spellings of rotary settings: ``rope_theta`` + ``rope_scaling`` (published
checkpoints) and ``rope_parameters`` (written by transformers >= 5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from shoal.runtime.model.moe_config import MoeConfig, parse_moe_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...} or None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype = torch.float32
    model_type: str = ""
    moe: MoeConfig | None = None  # mixture of experts: see moe_config.py

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1) -> int:
        """K and V bytes one token occupies on one rank, all layers (KV heads replicated
        when there are fewer than ranks)."""
        heads_per_rank = max(1, self.num_kv_heads // tp_size)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * heads_per_rank * self.head_dim * elem


def _rope(raw: dict) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = None if kind == "default" else {k: v for k, v in params.items()
                                                  if k != "rope_theta"}
        return theta, scaling
    theta = float(raw.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
        if scaling["rope_type"] == "default":
            scaling = None
    return theta, scaling


def _eos_ids(raw: dict, generation: dict) -> list[int]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    raw = json.loads(config_path.read_text())
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{config_path}: 'architectures' is missing")
    model_type = raw.get("model_type", "")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling = _rope(raw)
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(f"{config_path}: unsupported dtype {dtype_name!r}")
    use_window = raw.get("use_sliding_window", model_type in ("mistral", "mixtral"))
    return ModelConfig(
        architecture=archs[0],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        intermediate_size=int(raw["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has a qkv bias; Llama/Mistral/Qwen3 say so in attention_bias
        attention_bias=bool(raw.get("attention_bias", raw.get(
            "qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        sliding_window=int(raw["sliding_window"]) if use_window and raw.get("sliding_window")
        else None,
        eos_token_ids=_eos_ids(raw, generation),
        torch_dtype=_DTYPES[dtype_name],
        model_type=model_type,
        moe=parse_moe_config(raw, archs[0]),
    )
