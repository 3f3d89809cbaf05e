"""ModelConfig: the model's shape and features, read from an HF checkpoint's config.json.

transformers' own config classes parse the file (``AutoConfig``): they fill the defaults a
checkpoint leaves out, standardise the rope fields (``rope_scaling`` / ``rope_parameters``,
per layer type for Gemma 3), derive ``layer_types`` and resolve a multimodal checkpoint's
nested ``text_config``. Their field names are the spec; this module turns them into feature
switches for the one decoder (``decoder.py``), and refuses at startup, naming the
architecture and the field, whatever the decoder cannot honour.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from shoal.runtime.checkpoint_json import read_config_json, with_overrides
from shoal.runtime.model.families import PRE_NORM, Family, NormPlacement, QKNorm, family_for
from shoal.runtime.model.linear_attn_config import LinearAttnConfig, parse_linear_attn_config
from shoal.runtime.model.mla_config import MlaConfig, parse_mla_config
from shoal.runtime.model.moe_config import MoeConfig, parse_moe_config
from shoal.runtime.model.quant.spec import QuantSpec, parse_quantization
from shoal.runtime.model.rope import RopeSpec, rope_specs
from shoal.runtime.model_source import gguf_file

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# hidden_act / hidden_activation values the MLP implements (transformers' ACT2FN names)
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast", "relu",
               "relu2")
# layer_types entries the decoder serves (others, e.g. chunked attention, refused); linear
# attention only in a family with Gated DeltaNet layers (``Family.linear_attention``)
_LAYER_TYPES = ("full_attention", "sliding_attention")
_HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")


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
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: torch.dtype = torch.float32
    model_type: str = ""
    # -- features (defaults: a plain Llama) ---------------------------------------------------
    norms: NormPlacement = PRE_NORM
    norm_weight_offset: float = 0.0  # Gemma: weights stored as (scale - 1)
    qk_norm: QKNorm | None = None
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    gated_mlp: bool = True
    embed_scale: float = 1.0  # Gemma sqrt(hidden), Granite embedding_multiplier
    residual_multiplier: float = 1.0  # Granite: sub-block outputs scaled before the add
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcap: float | None = None
    attention_sinks: bool = False  # gpt-oss: self_attn.sinks [num_heads] join each softmax
    logits_divisor: float = 1.0  # Granite logits_scaling
    query_scaling_beta: float | None = None  # Ministral 3: q *= 1 + beta*log(1+floor(p/orig))
    query_scaling_original: int = 1
    # per layer: the sliding window (None: full attention), the rope table (None: no rope)
    layer_windows: tuple[int | None, ...] = ()
    layer_ropes: tuple[str | None, ...] = ()
    ropes: dict[str, RopeSpec] = field(default_factory=dict)
    # the checkpoint's weights sit under this prefix instead of "model." (text-only wrappers)
    weight_prefix: str | None = None
    hf_config: Any = None  # transformers' text config: the rope init functions read it
    moe: MoeConfig | None = None  # mixture of experts: see moe_config.py
    mla: MlaConfig | None = None  # multi-head latent attention (DeepSeek): see mla_config.py
    # Qwen3-Next: Gated DeltaNet layers with per-request state (linear_attn_config.py), and a
    # sigmoid output gate on the full-attention layers (q_proj twice as wide)
    linear_attn: LinearAttnConfig | None = None
    attn_output_gate: bool = False
    quantization: QuantSpec | None = None  # a quantized checkpoint: see quant/spec.py

    def __post_init__(self) -> None:
        if not self.layer_windows:
            self.layer_windows = (None,) * self.num_layers
        if not self.layer_ropes:
            self.layer_ropes = ("default",) * self.num_layers
        if not self.ropes:
            self.ropes = {"default": RopeSpec(self.head_dim, {"rope_type": "default",
                                                              "rope_theta": 10000.0})}

    @property
    def sliding_window(self) -> int | None:
        """The largest window of any layer, or None when some layer attends to everything."""
        windows = set(self.layer_windows)
        return None if None in windows or not windows else max(w for w in windows if w)

    @property
    def attention_features(self) -> frozenset[str]:
        """What the attention kernels must implement for this model (the backend choice's
        ``needs``)."""
        features = set()
        if any(w is not None for w in self.layer_windows):
            features.add("sliding_window")
        if self.attn_logit_softcap is not None:
            features.add("softcap")
        if self.attention_sinks:
            features.add("sinks")
        if self.mla is not None:
            features.add("latent_attention")
        return frozenset(features)

    def kv_bytes_per_token(self, dtype: torch.dtype, tp_size: int = 1) -> int:
        """K and V bytes one token occupies on one rank, all layers (KV heads replicated
        when there are fewer than ranks). Latent attention caches the latent and the rotary
        key instead, the same on every rank: ``kv_lora_rank + qk_rope_head_dim`` per layer."""
        elem = torch.empty((), dtype=dtype).element_size()
        if self.mla is not None:
            return self.num_layers * self.mla.cache_width * elem
        heads_per_rank = max(1, self.num_kv_heads // tp_size)
        return 2 * self.num_attention_layers * heads_per_rank * self.head_dim * elem

    @property
    def num_attention_layers(self) -> int:
        """Layers with a KV cache: all but a hybrid model's linear-attention layers."""
        if self.linear_attn is None:
            return self.num_layers
        return self.num_layers - self.linear_attn.num_linear_layers


def _eos_ids(raw: dict, generation: dict) -> list[int]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _hf_config(source: Path | dict, architecture: str):
    """transformers' config of a checkpoint directory, or of a config dict."""
    from transformers import AutoConfig

    try:
        if isinstance(source, dict):
            return AutoConfig.for_model(**source)
        return AutoConfig.from_pretrained(str(source))
    except (ValueError, KeyError) as exc:  # an unknown model_type, a malformed field
        raise ValueError(f"unsupported architecture {architecture!r}: transformers cannot "
                         f"read its config.json ({exc})") from None


def _text_config(hf, architecture: str):
    text = hf.get_text_config(decoder=True)
    for name in ("num_attention_heads", "hidden_size", "num_hidden_layers", "vocab_size",
                 "intermediate_size"):
        if getattr(text, name, None) is None:
            raise ValueError(f"{architecture}: config.json has no {name!r} "
                             "(nor under 'text_config')")
    return text


def _windows(text, family: Family, architecture: str) -> tuple[int | None, ...]:
    layers = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None) if family.reads_layer_types else None
    if types is None:
        uses = getattr(text, "use_sliding_window", True)
        return (int(window) if window and uses else None,) * layers
    if len(types) != layers:
        raise ValueError(f"{architecture}: 'layer_types' lists {len(types)} layers, "
                         f"num_hidden_layers is {layers}")
    served = _HYBRID_LAYER_TYPES if family.linear_attention else _LAYER_TYPES
    unknown = sorted(set(types) - set(served))
    if unknown:
        raise ValueError(f"{architecture}: 'layer_types' {unknown} not supported "
                         f"(supported: {', '.join(served)})")
    if "sliding_attention" in types and not window:
        raise ValueError(f"{architecture}: 'layer_types' has sliding layers but "
                         "'sliding_window' is not set")
    return tuple(int(window or 0) if t == "sliding_attention" else None for t in types)


def _activation(text, architecture: str) -> str:
    for name in ("hidden_activation", "hidden_act"):
        value = getattr(text, name, None)
        if value is not None:
            if value not in ACTIVATIONS:
                raise ValueError(f"{architecture}: {name}={value!r} is not supported "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
            return value
    return "silu"


def _optional(text, name: str) -> float | None:
    value = getattr(text, name, None)
    return float(value) if value else None


def load_model_config(model_dir: str | Path,
                      hf_overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    gguf = gguf_file(model_dir)
    if gguf is not None:  # config from the file's metadata
        from shoal.runtime.model.gguf_checkpoint import open_gguf

        raw = with_overrides(open_gguf(gguf).hf_config(), hf_overrides or {})
        return model_config_from_dict(raw, {}, gguf, _hf_config(raw, raw["architectures"][0]))
    model_dir = Path(model_dir)
    raw = read_config_json(model_dir, hf_overrides)
    gen_path = model_dir / "generation_config.json"
    generation = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return model_config_from_dict(raw, generation, model_dir / "config.json", _hf_config(
        raw if hf_overrides else model_dir, raw["architectures"][0]))


def model_config_from_dict(raw: dict, generation: dict, config_path: Path, hf) -> ModelConfig:
    """``raw`` is config.json's content (or the same built from a GGUF's metadata), ``hf``
    transformers' config object of it."""
    architecture = raw["architectures"][0]
    text = _text_config(hf, architecture)
    family = family_for(architecture, text.model_type)
    nested = text is not hf
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    layers = int(text.num_hidden_layers)
    attention_bias = bool(getattr(text, "attention_bias", getattr(text, "qkv_bias", False)))
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ValueError(f"{config_path}: unsupported dtype {dtype_name!r}")
    # DeepSeek: ``rope_interleave`` (pairs, as GLM) is a config field, True by default
    interleaved = family.rope_interleaved or bool(getattr(text, "rope_interleave", False))
    ropes, layer_ropes = rope_specs(text, head_dim, interleaved, architecture)
    embed_scale = float(getattr(text, "embedding_multiplier", None) or 1.0)
    if family.embed_scale_sqrt_hidden:
        embed_scale = math.sqrt(hidden)
    scalar = getattr(text, "query_pre_attn_scalar", None)
    attention_scale = getattr(text, "attention_multiplier", None)
    beta = None
    if family.query_position_scaling:
        beta = text.rope_parameters.get("llama_4_scaling_beta")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(text.vocab_size),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        intermediate_size=int(text.intermediate_size),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-6),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.tie_word_embeddings)),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
        eos_token_ids=_eos_ids(raw, generation) or _eos_ids(raw.get("text_config") or {}, {}),
        torch_dtype=_DTYPES[dtype_name],
        model_type=text.model_type,
        norms=family.norms,
        norm_weight_offset=family.norm_weight_offset,
        qk_norm=family.qk_norm or ("per_head" if getattr(text, "use_qk_norm", False) else None),
        qkv_bias=attention_bias if family.qkv_bias is None else family.qkv_bias,
        o_proj_bias=attention_bias if family.o_proj_bias is None else family.o_proj_bias,
        mlp_bias=bool(getattr(text, "mlp_bias", False)) if family.reads_mlp_bias else False,
        hidden_act=_activation(text, architecture),
        gated_mlp=family.gated_mlp,
        embed_scale=embed_scale,
        residual_multiplier=float(getattr(text, "residual_multiplier", None) or 1.0),
        attention_scale=float(scalar) ** -0.5 if scalar else (
            float(attention_scale) if attention_scale is not None else None),
        attn_logit_softcap=_optional(text, "attn_logit_softcapping"),
        final_logit_softcap=_optional(text, "final_logit_softcapping"),
        attention_sinks=family.attention_sinks,
        logits_divisor=float(getattr(text, "logits_scaling", None) or 1.0),
        query_scaling_beta=float(beta) if beta else None,
        query_scaling_original=int(text.rope_parameters.get(
            "original_max_position_embeddings") or 1) if beta else 1,
        layer_windows=_windows(text, family, architecture),
        layer_ropes=layer_ropes,
        ropes=ropes,
        weight_prefix="language_model" if nested else None,
        hf_config=text,
        moe=parse_moe_config(raw.get("text_config") or raw if nested else raw, architecture),
        mla=parse_mla_config(text, architecture) if family.latent_attention else None,
        linear_attn=parse_linear_attn_config(text, architecture)
        if family.linear_attention else None,
        attn_output_gate=family.attention_output_gate,
        quantization=parse_quantization(raw),
    )
