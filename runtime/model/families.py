"""What config.json does not say: the structure each model family's modeling code hard-wires.

Numbers (sizes, windows, multipliers, softcaps, rope) come from the config; but where the
norms sit, whether a Gemma norm scales by ``1 + weight``, whether q/k are normalised per head
or over the whole projection, and how rotary pairs are laid out are written in each family's
transformers modeling file, not in its config. This table is that knowledge, one row per
``model_type``, as feature switches the one decoder reads; nothing else in the model tests a
family's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

QKNorm = Literal["per_head", "whole"]


@dataclass(frozen=True)
class NormPlacement:
    """The checkpoint names of a layer's norms by role (None: the family has no such norm).

    ``attn_in``/``mlp_in`` normalise a sub-block's input (pre-norm); ``attn_out``/``mlp_out``
    its output before it joins the residual stream (post-norm; both: Gemma's sandwich)."""

    attn_in: str | None
    attn_out: str | None
    mlp_in: str | None
    mlp_out: str | None

    def names(self) -> list[str]:
        return [n for n in (self.attn_in, self.attn_out, self.mlp_in, self.mlp_out) if n]


PRE_NORM = NormPlacement("input_layernorm", None, "post_attention_layernorm", None)
# Gemma 2/3: every sub-block normalised on the way in and on the way out
GEMMA_SANDWICH = NormPlacement("input_layernorm", "post_attention_layernorm",
                               "pre_feedforward_layernorm", "post_feedforward_layernorm")
# GLM-4: the same sandwich under other names (its post_attention_layernorm is the MLP's input)
GLM_SANDWICH = NormPlacement("input_layernorm", "post_self_attn_layernorm",
                             "post_attention_layernorm", "post_mlp_layernorm")
# OLMo 2: outputs normalised, inputs not
POST_NORM = NormPlacement(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    norms: NormPlacement = PRE_NORM
    norm_weight_offset: float = 0.0  # Gemma: the norm scales by (1 + weight)
    qk_norm: QKNorm | None = None
    embed_scale_sqrt_hidden: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    rope_interleaved: bool = False  # GLM: rotary on (even, odd) pairs, not on halves
    qkv_bias: bool | None = None  # fixed by the modeling code; None: ``attention_bias``
    o_proj_bias: bool | None = None  # likewise
    reads_mlp_bias: bool = False  # the MLP's bias follows ``mlp_bias``
    reads_layer_types: bool = True  # windows per layer from ``layer_types`` (else all layers)
    query_position_scaling: bool = False  # Ministral 3: llama_4_scaling_beta on q
    gated_mlp: bool = True  # act(gate) * up; False: act(up) alone (Arcee)
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax
    latent_attention: bool = False  # DeepSeek: multi-head latent attention (mla_config.py)
    linear_attention: bool = False  # Qwen3-Next: Gated DeltaNet layers (linear_attn_config.py)
    attention_output_gate: bool = False  # Qwen3-Next: attn_out * sigmoid(gate from q_proj)


FAMILIES: dict[str, Family] = {
    "llama": Family(reads_mlp_bias=True),
    "mistral": Family(qkv_bias=False, o_proj_bias=False, reads_layer_types=False),
    "ministral": Family(qkv_bias=False, o_proj_bias=False),
    "ministral3": Family(qkv_bias=False, o_proj_bias=False, reads_layer_types=False,
                         query_position_scaling=True),
    "qwen2": Family(qkv_bias=True, o_proj_bias=False),
    "qwen3": Family(qk_norm="per_head"),
    "gemma2": Family(norms=GEMMA_SANDWICH, norm_weight_offset=1.0, embed_scale_sqrt_hidden=True),
    "gemma3_text": Family(norms=GEMMA_SANDWICH, norm_weight_offset=1.0, qk_norm="per_head",
                          embed_scale_sqrt_hidden=True),
    "phi3": Family(qkv_bias=False, o_proj_bias=False),
    "olmo2": Family(norms=POST_NORM, qk_norm="whole"),
    "granite": Family(reads_mlp_bias=True),
    "glm4": Family(norms=GLM_SANDWICH, rope_interleaved=True, o_proj_bias=False),
    "smollm3": Family(reads_mlp_bias=True),
    "arcee": Family(reads_mlp_bias=True, gated_mlp=False),
    # mixtures of experts (moe.py fills their MLP slots)
    "mixtral": Family(qkv_bias=False, o_proj_bias=False, reads_layer_types=False),
    "qwen2_moe": Family(o_proj_bias=False),  # qkv bias: ``qkv_bias`` (read in config.py)
    "qwen3_moe": Family(qk_norm="per_head"),
    # GLM-4.5: pre-norm, neox rotary on part of the head, q/k norm when ``use_qk_norm``
    "glm4_moe": Family(o_proj_bias=False),
    # gpt-oss: sinks, alternating sliding/full layers (``layer_types``), yarn, biases on q/k/v
    # and o_proj from ``attention_bias``; its MoE (router bias, clamped SwiGLU) in moe_config
    "gpt_oss": Family(attention_sinks=True),
    # DeepSeek-V3 (and Kimi K2): multi-head latent attention (mla.py) over the latent cache,
    # rotary on interleaved pairs when ``rope_interleave``; sigmoid grouped routing,
    # shared experts and ``first_k_dense_replace`` dense layers in moe_config
    "deepseek_v3": Family(latent_attention=True),
    # Qwen3-Next: three layers in four Gated DeltaNet (gated_deltanet.py), every fourth full
    # attention with an output gate, per-head q/k norm and partial rotary; Gemma-style
    # (1 + weight) RMS norms; Qwen2-MoE's experts with a sigmoid-gated shared expert
    "qwen3_next": Family(norm_weight_offset=1.0, qk_norm="per_head", linear_attention=True,
                         attention_output_gate=True),
    # Qwen3.5's text model: the same layers with the Gated DeltaNet projections stored apart
    # (linear_attn_config.py) and a dense MLP; its multimodal rope (mrope_section) rotates
    # text positions exactly as plain rope does, all three position streams being equal
    "qwen3_5_text": Family(norm_weight_offset=1.0, qk_norm="per_head", linear_attention=True,
                           attention_output_gate=True),
}

# multimodal wrappers whose language model is one of the families above (served text-only)
TEXT_ONLY_WRAPPERS = {
    "Gemma3ForConditionalGeneration": "gemma3_text",
    "Mistral3ForConditionalGeneration": None,  # its text_config says which (mistral, ministral3)
}


def family_for(architecture: str, model_type: str) -> Family:
    """The family row for a checkpoint, or ValueError naming what is not supported."""
    # a base decoder saved without its LM head (``Qwen3Model``: embedding checkpoints) is the
    # same decoder; it can only be served with --runner pooling (no logits to sample)
    base = architecture.endswith("Model") and \
        architecture[:-len("Model")].lower() == model_type.replace("_", "")
    if not (architecture.endswith("ForCausalLM") or base or architecture in TEXT_ONLY_WRAPPERS):
        raise ValueError(f"unsupported architecture {architecture!r} (config.json "
                         f"'architectures'): shoal serves decoder-only *ForCausalLM models "
                         f"(and their *Model base for embeddings) and "
                         f"{', '.join(sorted(TEXT_ONLY_WRAPPERS))} text-only")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"unsupported architecture {architecture!r}: model_type "
                         f"{model_type!r} is not one of {', '.join(sorted(FAMILIES))}")
    return family
