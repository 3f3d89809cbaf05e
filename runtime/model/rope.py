"""Rotary position embedding: which table each layer uses, and the tables themselves.

A table holds, for every position, the cos and sin of position x inverse frequency over the
rotated part of a head (``rotary_dim``; Phi-3 / GLM rotate a fraction of it). The inverse
frequencies of the scaled rope types come from transformers' own init functions
(``ROPE_INIT_FUNCTIONS``: linear, llama3, yarn, longrope, dynamic), so every rule is the
reference's; yarn's and longrope's attention factor multiplies the table as in HF.

Two rules depend on the sequence length in HF, which recomputes frequencies per forward from
the largest position in it; a paged engine rotates each key once, when it is written, so they
are kept per position instead: longrope uses its short factors below
``original_max_position_embeddings`` and its long factors from there on, dynamic NTK uses the
base for ``seq_len = position + 1`` past ``max_position_embeddings``. Both equal HF's decode
steps token for token, and its prefill for prompts that stay below the switch; a prompt that
crosses it is rotated by HF with the long (or stretched) table throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeSpec:
    rotary_dim: int  # leading components of each head that rotate; the rest pass through
    params: dict = field(default_factory=dict, hash=False)  # rope_type, rope_theta, factor...
    interleaved: bool = False  # pairs (0,1), (2,3)... (GLM) instead of halves (neox)
    layer_type: str | None = None  # the key of ``rope_parameters`` when it is per layer type

    @property
    def rope_type(self) -> str:
        return str(self.params.get("rope_type", self.params.get("type", "default")))


def rope_specs(text, head_dim: int, interleaved: bool,
               architecture: str) -> tuple[dict[str, RopeSpec], tuple[str | None, ...]]:
    """The distinct rope tables of a transformers text config, and each layer's (None where
    the layer has no rope: SmolLM3's ``no_rope_layers``)."""
    layers = int(text.num_hidden_layers)
    params = getattr(text, "rope_parameters", None) or {"rope_type": "default"}
    per_type = all(isinstance(v, dict) for v in params.values())
    by_key = params if per_type else {"default": params}
    specs: dict[str, RopeSpec] = {}
    for key, p in by_key.items():
        p = dict(p)
        p.setdefault("rope_theta", getattr(text, "rope_theta", None) or 10000.0)
        spec = RopeSpec(_rotary_dim(text, p, head_dim), p, interleaved,
                        key if per_type else None)
        if spec.rope_type not in ROPE_TYPES:
            raise ValueError(f"{architecture}: rope_type {spec.rope_type!r} in "
                             f"'rope_parameters' is not supported (supported: "
                             f"{', '.join(ROPE_TYPES)})")
        specs[key] = spec
    if per_type:
        types = getattr(text, "layer_types", None) or []
        missing = sorted({t for t in types if t not in specs})
        if len(types) != layers or missing:
            raise ValueError(f"{architecture}: 'rope_parameters' has no entry for layer "
                             f"types {missing or types}")
        keys: list[str | None] = list(types)
    else:
        keys = ["default"] * layers
    no_rope = getattr(text, "no_rope_layers", None)
    if no_rope is not None:
        if len(no_rope) != layers:
            raise ValueError(f"{architecture}: 'no_rope_layers' lists {len(no_rope)} layers, "
                             f"num_hidden_layers is {layers}")
        keys = [k if use else None for k, use in zip(keys, no_rope, strict=True)]
    return specs, tuple(keys)


def _rotary_dim(text, params: dict, head_dim: int) -> int:
    factor = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    dim = int(head_dim * float(factor or 1.0))
    return dim - dim % 2


def rope_table(spec: RopeSpec, hf_config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin, ``[max_positions, rotary_dim / 2]`` each."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    kind = spec.rope_type
    if kind == "default":
        inv_freq, factor = _default_inv_freq(spec), 1.0
        freqs = positions[:, None] * inv_freq[None, :]
    elif kind == "longrope":
        freqs, factor = _longrope_freqs(spec, hf_config, positions)
    elif kind == "dynamic":
        freqs, factor = _dynamic_freqs(spec, hf_config, positions), 1.0
    else:  # linear, llama3, yarn: one set of frequencies for every position
        inv_freq, factor = _hf_inv_freq(spec, hf_config, None)
        freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos() * factor, freqs.sin() * factor


def _default_inv_freq(spec: RopeSpec, theta: torch.Tensor | float | None = None) -> torch.Tensor:
    dim = spec.rotary_dim
    base = spec.params["rope_theta"] if theta is None else theta
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base ** exponent)


def _hf_inv_freq(spec: RopeSpec, hf_config, seq_len: int | None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[spec.rope_type]
    inv_freq, factor = init(hf_config, torch.device("cpu"), seq_len=seq_len,
                            layer_type=spec.layer_type)
    return inv_freq.float(), float(factor)


def _longrope_freqs(spec: RopeSpec, hf_config,
                    positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    original = int(spec.params["original_max_position_embeddings"])
    short, factor = _hf_inv_freq(spec, hf_config, None)
    long, _ = _hf_inv_freq(spec, hf_config, original + 1)
    inv_freq = torch.where(positions[:, None] < original, short[None, :], long[None, :])
    return positions[:, None] * inv_freq, factor


def _dynamic_freqs(spec: RopeSpec, hf_config, positions: torch.Tensor) -> torch.Tensor:
    """NTK base stretched for ``seq_len = position + 1`` past max_position_embeddings (the
    formula of transformers' ``_compute_dynamic_ntk_parameters``, per position)."""
    limit = int(hf_config.max_position_embeddings)
    factor, dim = float(spec.params["factor"]), spec.rotary_dim
    seq_len = torch.clamp(positions + 1, min=limit)
    theta = spec.params["rope_theta"] * ((factor * seq_len / limit) - (factor - 1)) \
        ** (dim / (dim - 2))
    inv_freq = _default_inv_freq(spec, theta[:, None])
    return positions[:, None] * inv_freq


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """``x [T, H, D]`` with its first ``2 * cos.shape[-1]`` components rotated; ``cos``/``sin``
    ``[T, 1, rotary_dim / 2]``. A copy; the rest of each head passes through."""
    rot = 2 * cos.shape[-1]
    head, rest = (x, None) if rot == x.shape[-1] else (x[..., :rot], x[..., rot:])
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = head.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if rest is None else torch.cat((out, rest), dim=-1)
