"""LinearAttnConfig: the Gated DeltaNet layers of a hybrid model (Qwen3-Next), from its config.

Three layers in four of Qwen3-Next are ``linear_attention`` (``layer_types``): no KV cache,
but per request a causal-conv1d window (the last ``conv_kernel - 1`` inputs of the q/k/v
channels) and a recurrent state ``[value heads, key dim, value dim]``. This module knows
which layers those are and what one request's state costs; ``gated_deltanet.py`` runs them
and ``worker/state_slots.py`` gives each running request its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the recurrent state accumulates over the whole sequence: kept in float32 whatever the
# model dtype (transformers' reference scan computes in float32 too)
STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class LinearAttnConfig:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    linear_layers: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention
    # Qwen3.5: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, q|k|v side by side; Qwen3-Next:
    # in_proj_qkvz / in_proj_ba, columns grouped per key head
    separate_projections: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers)

    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.head_k_dim, self.head_v_dim

    def state_bytes_per_request(self, dtype: torch.dtype) -> int:
        """One request's conv window (model dtype) and recurrent state (float32), all linear
        layers: what each of the ``max_num_seqs`` slots holds."""
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        heads, k, v = self.recurrent_state_shape()
        recurrent = heads * k * v * torch.empty((), dtype=STATE_DTYPE).element_size()
        return self.num_linear_layers * (conv + recurrent)


def parse_linear_attn_config(text, architecture: str) -> LinearAttnConfig | None:
    """The linear-attention layers of transformers' text config, or None when every layer
    attends (no ``linear_attention`` in ``layer_types``)."""
    types = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" not in types:
        return None
    k_heads, v_heads = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
    if v_heads % k_heads:
        raise ValueError(f"{architecture}: linear_num_value_heads={v_heads} is not a multiple "
                         f"of linear_num_key_heads={k_heads}")
    act = getattr(text, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{architecture}: hidden_act={act!r} is not supported for the "
                         "linear-attention conv (supported: silu)")
    return LinearAttnConfig(
        num_k_heads=k_heads, num_v_heads=v_heads,
        head_k_dim=int(text.linear_key_head_dim), head_v_dim=int(text.linear_value_head_dim),
        conv_kernel=int(text.linear_conv_kernel_dim),
        linear_layers=tuple(t == "linear_attention" for t in types),
        separate_projections=text.model_type == "qwen3_5_text")
