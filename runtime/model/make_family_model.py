"""Tiny dense checkpoints of the families the feature-built decoder serves, made by
transformers' own config and model classes (random weights, float32), for the equivalence
tests against HF.

Each config turns on the features its family is known for, at sizes where they matter: a
sliding window (16) shorter than the test prompts (on every layer in ``mistral_sliding``, so
its blocks behind the window are freed), softcaps low enough to bend the scores,
multipliers away from 1, a longrope / yarn original context and a Ministral 3 query-scaling
period inside the generated lengths. The tokenizer is the one ``make_model`` trains, so the
checkpoints also serve over HTTP.
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

FAMILIES = ("gemma2", "gemma3", "gemma3_nested", "mistral3_nested", "phi3_longrope", "olmo2", "granite", "glm4",
            "smollm3", "arcee", "ministral", "ministral3", "llama_biases", "qwen2_yarn",
            "mistral_sliding")
FORMAT_VERSION = 1
WINDOW = 16
_SLIDING_FULL = ["sliding_attention", "full_attention"]


def _common(head_dim: int = 16) -> dict[str, Any]:
    return dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                max_position_embeddings=1024, **shared_config())


def _gemma3_text(**extra):
    from transformers import Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    return Gemma3TextConfig(**_common(), query_pre_attn_scalar=24, sliding_window=WINDOW,
                            layer_types=_SLIDING_FULL, rope_parameters=rope, **extra)


def family_hf_config(name: str):  # -> transformers.PretrainedConfig
    import transformers as tf

    if name not in FAMILIES:
        raise ValueError(f"unknown family checkpoint {name!r}; choose one of "
                         f"{', '.join(FAMILIES)}")
    c = _common()
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    if name == "gemma2":
        return tf.Gemma2Config(**c, query_pre_attn_scalar=24, sliding_window=WINDOW,
                               layer_types=_SLIDING_FULL, attn_logit_softcapping=5.0,
                               final_logit_softcapping=8.0)
    if name == "gemma3":
        return _gemma3_text()
    if name == "gemma3_nested":
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14)
        return tf.Gemma3Config(text_config=_gemma3_text().to_dict(),
                               vision_config=vision.to_dict(), mm_tokens_per_image=4,
                               image_token_index=1000, boi_token_index=1001,
                               eoi_token_index=1002)
    if name == "mistral3_nested":  # Mistral-Small-3.1's shape: a Pixtral tower, text inside
        pixtral = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         image_size=28, patch_size=14)
        text = tf.MinistralConfig(**c, sliding_window=WINDOW, layer_types=_SLIDING_FULL,
                                  rope_parameters=default_rope)
        return tf.Mistral3Config(text_config=text.to_dict(), vision_config=pixtral.to_dict(),
                                 image_token_index=1000)
    if name == "phi3_longrope":
        # Phi-4-mini's shape: 3/4 of each head rotates; longrope short factors below 256
        rotary_half = 6  # head_dim 16 * 0.75 / 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.3 * i for i in range(rotary_half)],
                "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)],
                "original_max_position_embeddings": 256, "factor": 4.0}
        return tf.Phi3Config(**c, rope_parameters=rope)
    if name == "olmo2":
        return tf.Olmo2Config(**c, rope_parameters=default_rope)
    if name == "granite":
        return tf.GraniteConfig(**c, embedding_multiplier=3.0, residual_multiplier=0.6,
                                attention_multiplier=0.2, logits_scaling=2.5,
                                rope_parameters=default_rope)
    if name == "glm4":
        return tf.Glm4Config(**c, attention_bias=True,
                             rope_parameters={**default_rope, "partial_rotary_factor": 0.5})
    if name == "smollm3":
        return tf.SmolLM3Config(**c, no_rope_layers=[1, 0], use_sliding_window=False,
                                rope_parameters=default_rope)
    if name == "arcee":  # a plain (ungated) MLP with ReLU^2, biases
        return tf.ArceeConfig(**c, hidden_act="relu2", mlp_bias=True, attention_bias=True,
                              rope_parameters=default_rope)
    if name == "ministral":
        return tf.MinistralConfig(**c, sliding_window=WINDOW, layer_types=_SLIDING_FULL,
                                  rope_parameters=default_rope)
    if name == "ministral3":
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
        return tf.Ministral3Config(**{**c, "max_position_embeddings": 128},
                                   rope_parameters=rope)
    if name == "mistral_sliding":  # every layer windowed: blocks behind the window are freed
        return tf.MistralConfig(**c, sliding_window=WINDOW, rope_parameters=default_rope)
    if name == "llama_biases":
        return tf.LlamaConfig(**c, attention_bias=True, mlp_bias=True,
                              rope_parameters=default_rope)
    # qwen2_yarn
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 64}
    return tf.Qwen2Config(**{**c, "max_position_embeddings": 256}, rope_parameters=rope,
                          use_sliding_window=False)


def make_family_model(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a checkpoint to ``out_dir`` (created; must be empty if it exists)."""
    from transformers import Gemma3ForConditionalGeneration, Mistral3ForConditionalGeneration

    out = empty_dir(out_dir)
    nested = {"gemma3_nested": Gemma3ForConditionalGeneration,
              "mistral3_nested": Mistral3ForConditionalGeneration}
    model = random_model(family_hf_config(name), seed, nested.get(name))
    return save_checkpoint(model, out, 1024)


def cached_family_model(name: str, seed: int = 0) -> Path:
    """Build once into the shared model cache."""
    return cached_build(f"family-{name}-s{seed}-f{FORMAT_VERSION}",
                        lambda out: make_family_model(name, out, seed))
