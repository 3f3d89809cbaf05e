"""Tiny Qwen3-Next checkpoints (Gated DeltaNet + gated full attention + MoE), random weights,
made by transformers' own ``Qwen3NextConfig`` / ``Qwen3NextForCausalLM``.

``qwen3_next``: 4 layers, three Gated DeltaNet then one full attention (the published
models' pattern), 2 key heads serving 4 value
heads in the linear layers (the grouped q/k/v/z layout), a conv kernel of 4, partial rotary
(a quarter of each 32-wide head) with per-head q/k norm and the output gate; 8 experts top-2
renormalised with a sigmoid-gated shared expert, layer 1 dense (``mlp_only_layers``). The
decay parameters are drawn so that some heads remember for tens of tokens and some forget
fast, so a wrong state carried between chunks or steps shows in the output.

``qwen3_5``: Qwen3.5's text model (``Qwen3_5ForCausalLM``) of the same shape: the Gated
DeltaNet projections stored apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``), a dense MLP, and its multimodal rope sections (text positions rotate as
plain rope).

The tokenizer is the one ``make_model`` trains, so the checkpoints serve over HTTP too.
"""

from __future__ import annotations

from pathlib import Path

from shoal.runtime.model.make_model import (
    cached_build,
    empty_dir,
    random_model,
    save_checkpoint,
    shared_config,
)

HYBRID_ARCHS = ("qwen3_next", "qwen3_5")
FORMAT_VERSION = 1


def hybrid_hf_config(arch: str):  # -> transformers.Qwen3NextConfig
    from transformers import Qwen3NextConfig

    if arch not in HYBRID_ARCHS:
        raise ValueError(f"unknown hybrid checkpoint {arch!r}; choose one of "
                         f"{', '.join(HYBRID_ARCHS)}")
    common = dict(
        vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=1024, tie_word_embeddings=False, **shared_config())
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**common, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    return Qwen3NextConfig(
        **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25})


def make_hybrid_model(arch: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a checkpoint to ``out_dir`` (created; must be empty if it exists)."""
    import torch

    out = empty_dir(out_dir)
    config = hybrid_hf_config(arch)
    model_class = None
    if arch == "qwen3_5":  # the text model alone (no vision tower)
        from transformers import Qwen3_5ForCausalLM

        model_class = Qwen3_5ForCausalLM
    model = random_model(config, seed, model_class)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):  # decay rates exp(A_log) from 0.02 to 2
                param.copy_(torch.empty(param.shape).uniform_(-4.0, 0.7, generator=gen))
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 - 1.0)
    return save_checkpoint(model, out, config.vocab_size)


def cached_hybrid_model(arch: str = "qwen3_next", seed: int = 0) -> Path:
    """Build once into the shared model cache."""
    return cached_build(f"{arch}-tiny-s{seed}-hybrid{FORMAT_VERSION}",
                        lambda out: make_hybrid_model(arch, out, seed))
