"""MlaConfig: multi-head latent attention's shapes (DeepSeek-V2/V3 family), from config.json.

MLA compresses each token's keys and values into one latent vector of ``kv_lora_rank``
(normalised by ``kv_a_layernorm``) plus one rotary key of ``qk_rope_head_dim`` shared by all
heads; the per-head keys (``qk_nope_head_dim``) and values (``v_head_dim``) are expanded from
the latent by ``kv_b_proj``. Only the latent and the rotary key are cached, so a token costs
``kv_lora_rank + qk_rope_head_dim`` elements per layer whatever the head count.

The softmax scale is ``qk_head_dim ** -0.5``, times ``mscale ** 2`` under DeepSeek's yarn
(``mscale_all_dim`` in the rope parameters: the scaling applies to the whole query-key
product, not only to the rotary part the table already scales), as transformers'
``yarn_apply_mscale`` folds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MlaConfig:
    kv_lora_rank: int
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # the softmax scale, mscale folded in
    bias: bool = False  # ``attention_bias``: q_a_proj, kv_a_proj_with_mqa and o_proj
    mtp_layers: int = 0  # ``num_nextn_predict_layers``: multi-token-prediction layers, unused

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Elements one token occupies in one layer's cache: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn magnitude correction (transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    scale = qk_head_dim ** -0.5
    params = rope_parameters or {}
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


def parse_mla_config(text, architecture: str) -> MlaConfig | None:
    """The MLA shapes of a transformers text config, or None when it has no latent
    attention (no ``kv_lora_rank``)."""
    kv_lora_rank = getattr(text, "kv_lora_rank", None)
    if not kv_lora_rank:
        return None
    q_lora_rank = getattr(text, "q_lora_rank", None)
    nope, rope = int(text.qk_nope_head_dim), int(text.qk_rope_head_dim)
    v_head_dim = int(getattr(text, "v_head_dim", None) or nope)
    if rope % 2 or rope <= 0:
        raise ValueError(f"{architecture}: qk_rope_head_dim={rope} must be a positive even "
                         "number")
    heads, kv_heads = int(text.num_attention_heads), getattr(text, "num_key_value_heads", None)
    if kv_heads and int(kv_heads) != heads:  # every head reads the one latent; no GQA here
        raise ValueError(f"{architecture}: num_key_value_heads={kv_heads} differs from "
                         f"num_attention_heads={heads}, which multi-head latent attention "
                         "does not use")
    return MlaConfig(
        kv_lora_rank=int(kv_lora_rank),
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v_head_dim,
        scale=softmax_scale(nope + rope, getattr(text, "rope_parameters", None)),
        bias=bool(getattr(text, "attention_bias", False)),
        mtp_layers=int(getattr(text, "num_nextn_predict_layers", None) or 0),
    )
