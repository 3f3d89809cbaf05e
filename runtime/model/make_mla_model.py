"""Tiny DeepSeek-V3 checkpoints (multi-head latent attention + DeepSeek's MoE), random weights,
made by transformers' own ``DeepseekV3Config`` / ``DeepseekV3ForCausalLM``.

Two variants cover both query paths and both rotary layouts:

- ``deepseek_v3``: low-rank queries (``q_lora_rank``), interleaved rotary, DeepSeek's yarn
  with an original context of 32 positions (inside the test prompts) and ``mscale_all_dim``
  (the softmax scale's ``mscale ** 2``) different from ``mscale`` (the table's attention
  factor), sigmoid routing over 2 groups with a random correction bias, routed scaling, one
  shared expert and a first dense layer.
- ``deepseek_v3_plain_q``: one ``q_proj`` (``q_lora_rank`` None), neox rotary
  (``rope_interleave`` False), plain rope, ``v_head_dim`` unlike ``qk_nope_head_dim``, biases
  on the latent and output projections (``attention_bias``), 4 groups, two first dense layers.

The tokenizer is the one ``make_model`` trains, so the checkpoints serve over HTTP too.
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

MLA_ARCHS = ("deepseek_v3", "deepseek_v3_plain_q")
FORMAT_VERSION = 1


def mla_hf_config(arch: str):  # -> transformers.DeepseekV3Config
    from transformers import DeepseekV3Config

    if arch not in MLA_ARCHS:
        raise ValueError(f"unknown MLA checkpoint {arch!r}; choose one of {', '.join(MLA_ARCHS)}")
    common: dict[str, Any] = dict(
        vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        norm_topk_prob=True, max_position_embeddings=1024, tie_word_embeddings=False,
        **shared_config())
    if arch == "deepseek_v3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.8}
        common["max_position_embeddings"] = 128  # = factor x the original 32
        return DeepseekV3Config(**common, num_hidden_layers=3, q_lora_rank=48, v_head_dim=16,
                                n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                first_k_dense_replace=1, rope_interleave=True,
                                rope_parameters=rope)
    return DeepseekV3Config(**common, num_hidden_layers=3, q_lora_rank=None, v_head_dim=24,
                            n_group=4, topk_group=2, routed_scaling_factor=1.5,
                            first_k_dense_replace=2, rope_interleave=False,
                            attention_bias=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_mla_model(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a checkpoint to ``out_dir`` (created; must be empty if it exists)."""
    import torch

    out = empty_dir(out_dir)
    config = mla_hf_config(arch)
    model = random_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # zeros at init: make it move choices
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    return save_checkpoint(model, out, config.vocab_size)


def cached_mla_model(arch: str, seed: int = 0) -> Path:
    """Build once into the shared model cache."""
    return cached_build(f"{arch}-tiny-s{seed}-mla{FORMAT_VERSION}",
                        lambda out: make_mla_model(arch, out, seed))
