"""Mixture-of-experts checkpoints with random weights, made by transformers' own classes.

Three families, each exercising a different part of the MoE block: ``qwen3_moe`` (softmax
top-k renormalised, q/k norm), ``qwen2_moe`` (softmax top-k not renormalised, a gated
shared expert, a dense layer from ``mlp_only_layers``, qkv bias) and ``mixtral``
(``block_sparse_moe.experts.N.w1/w2/w3`` tensor names), ``glm4_moe`` (GLM-4.5: sigmoid
scores, a random correction bias, group-limited top-k, routed scaling, an ungated shared
expert, a first dense layer, partial rotary, qkv bias and q/k norm), ``gpt_oss`` (attention
sinks made large enough to take weight, sliding layers of window 16 alternating with full
ones, yarn with a 32-token original context, q/k/v/o biases, router bias, the clamped SwiGLU
experts with biases and interleaved gate/up columns). Sizes: ``tiny`` for tests, ``bench``
a Qwen3-MoE-shaped model scaled to a CPU machine (16 layers, hidden 1024, 64 experts of 256,
top-8). The tokenizer is the one ``make_model`` trains (Qwen flavour), so the checkpoints
serve over HTTP like the dense ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.runtime.model.make_model import (
    cached_build,
    empty_dir,
    random_model,
    save_checkpoint,
    shared_config,
)

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss")
MOE_SIZES = ("tiny", "bench")
FORMAT_VERSION = 1


def moe_hf_config(arch: str, size: str):  # -> transformers.PretrainedConfig
    from transformers import (
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    if arch not in MOE_ARCHS or size not in MOE_SIZES:
        raise ValueError(f"unknown MoE checkpoint {arch!r}/{size!r}; archs: "
                         f"{', '.join(MOE_ARCHS)}, sizes: {', '.join(MOE_SIZES)}")
    tiny = size == "tiny"
    common: dict[str, Any] = dict(
        vocab_size=1024 if tiny else 8192, hidden_size=64 if tiny else 1024,
        num_hidden_layers=(3 if arch in ("qwen2_moe", "glm4_moe") else 2) if tiny else 16,
        num_attention_heads=4 if tiny else 16, num_key_value_heads=2 if tiny else 4,
        max_position_embeddings=4096, tie_word_embeddings=False, **shared_config(),
        num_experts_per_tok=2 if tiny else 8,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    experts = 8 if tiny else 64
    expert_size = 32 if tiny else 256
    if arch == "gpt_oss":
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}
        return GptOssConfig(**{**common, "rope_parameters": rope},
                            head_dim=16 if tiny else 64, intermediate_size=expert_size,
                            num_local_experts=experts, sliding_window=16 if tiny else 128,
                            layer_types=["sliding_attention", "full_attention"] * (
                                common["num_hidden_layers"] // 2),
                            swiglu_limit=1.5 if tiny else 7.0, attention_bias=True)
    if arch == "mixtral":
        return MixtralConfig(**common, intermediate_size=expert_size, num_local_experts=experts)
    if arch == "glm4_moe":
        glm = Glm4MoeConfig(**{**common, "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
            intermediate_size=96 if tiny else 2048,
            moe_intermediate_size=expert_size, n_routed_experts=experts, n_shared_experts=1,
            n_group=2 if tiny else 8, topk_group=1 if tiny else 4, norm_topk_prob=True,
            routed_scaling_factor=1.5, first_k_dense_replace=1, attention_bias=True,
            use_qk_norm=True)
        glm.head_dim = 32 if tiny else 64
        return glm
    if arch == "qwen2_moe":
        return Qwen2MoeConfig(**common, intermediate_size=96 if tiny else 2048,
                              moe_intermediate_size=expert_size, num_experts=experts,
                              shared_expert_intermediate_size=48 if tiny else 1024,
                              norm_topk_prob=False, mlp_only_layers=[1] if tiny else [],
                              use_sliding_window=False)
    config = Qwen3MoeConfig(**common, intermediate_size=96 if tiny else 2048,
                            moe_intermediate_size=expert_size, num_experts=experts,
                            norm_topk_prob=True, use_sliding_window=False)
    config.head_dim = 32 if tiny else 64  # independent of hidden / heads, as in Qwen3
    return config


def make_moe_model(arch: str, size: str, out_dir: str | Path, seed: int = 0,
                   dtype: str = "float32") -> Path:
    """Write a checkpoint to ``out_dir`` (created; must be empty if it exists)."""
    import torch

    out = empty_dir(out_dir)
    config = moe_hf_config(arch, size)
    model = random_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init: make it move choices
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):  # gpt-oss: around the scores' own scale
                param.copy_(torch.randn(param.shape, generator=gen) + 1.0)
    return save_checkpoint(model.to(getattr(torch, dtype)), out, config.vocab_size)


def cached_moe_model(arch: str, size: str = "tiny", seed: int = 0,
                     dtype: str = "float32") -> Path:
    """Build once into the shared model cache."""
    return cached_build(f"{arch}-{size}-{dtype}-s{seed}-m{FORMAT_VERSION}",
                        lambda out: make_moe_model(arch, size, out, seed, dtype))
