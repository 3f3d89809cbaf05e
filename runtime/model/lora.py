"""LoRA on the decoder's projections: every slot's adapter applied in one batched computation.

``attach_lora`` gives each targetable projection (the packed qkv, o, the packed gate/up, up,
down) a ``LoraLayer`` holding the stacked A and B matrices of all ``max_loras`` slots,
registered as a forward hook, so the linear layers themselves never change. A layer packing
several logical matrices (qkv: q, k, v) gives each one its own block of ``max_rank`` rows per
slot; a fused adapter module (Phi-3's ``qkv_proj``) uses the first block across all outputs.

The step: ``LoraStepState`` holds each token's slot (-1: the base model). A layer computes
``delta = ((x @ A_all.T) * mask) @ B_all`` where ``A_all`` stacks the active slots' A rows and
``mask[t, c]`` keeps only the columns of token t's slot: two dense matmuls over the whole flat
batch whatever the mix of adapters (no loop over adapters, no per-token gather of matrices),
costing ``active_slots * rows_per_slot * (in + out)`` per token. B is stored pre-scaled
(alpha / r, or alpha / sqrt(r) for rsLoRA) and transposed to ``[rank, out]``. A step with no
adapter token skips the hooks' work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from shoal.runtime.model.decoder import DecoderForCausalLM


@dataclass
class LoraStepState:
    """Set by the worker before each forward; shared by every LoraLayer of the model."""

    token_slots: torch.Tensor | None = None  # long [T]; None: no adapter token this step
    num_active: int = 0  # slots 0..num_active-1 may appear in token_slots
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def set_step(self, token_slots: torch.Tensor | None, num_active: int) -> None:
        self.token_slots = token_slots
        self.num_active = num_active if token_slots is not None else 0
        self._masks = {}

    def mask(self, rows_per_slot: int, dtype: torch.dtype) -> torch.Tensor:
        """``[T, num_active * rows_per_slot]``: 1 where the column belongs to the token's slot.
        Built once per step per row count (a few distinct ones), not once per layer."""
        found = self._masks.get(rows_per_slot)
        if found is None:
            assert self.token_slots is not None
            column_slot = torch.arange(self.num_active * rows_per_slot,
                                       device=self.token_slots.device) // rows_per_slot
            found = (self.token_slots[:, None] == column_slot[None, :]).to(dtype)
            self._masks[rows_per_slot] = found
        return found


class LoraLayer:
    """The stacked adapters of one projection: ``a [slots * rows, in]``, ``b [slots * rows,
    out]`` with ``rows = num_blocks * max_rank`` per slot, zero where nothing is loaded."""

    def __init__(self, in_features: int, out_features: int, num_blocks: int, max_loras: int,
                 max_rank: int, state: LoraStepState, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.in_features, self.out_features = in_features, out_features
        self.max_rank = max_rank
        self.rows_per_slot = num_blocks * max_rank
        self.state = state
        self.a = torch.zeros(max_loras * self.rows_per_slot, in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(max_loras * self.rows_per_slot, out_features, dtype=dtype,
                             device=device)

    def clear_slot(self, slot: int) -> None:
        rows = slice(slot * self.rows_per_slot, (slot + 1) * self.rows_per_slot)
        self.a[rows].zero_()
        self.b[rows].zero_()

    def set_block(self, slot: int, block: int, lora_a: torch.Tensor, scaled_b_t: torch.Tensor,
                  out_offset: int) -> None:
        """``lora_a [r, in]``, ``scaled_b_t [r, out_size]`` (B transposed, times the scale)."""
        rank = lora_a.shape[0]
        start = slot * self.rows_per_slot + block * self.max_rank
        self.a[start:start + rank].copy_(lora_a)
        self.b[start:start + rank, out_offset:out_offset + scaled_b_t.shape[1]].copy_(scaled_b_t)

    def hook(self, _module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.token_slots is None:
            return out
        x = args[0]
        rows = state.num_active * self.rows_per_slot
        shrunk = x @ self.a[:rows].T  # [T, rows]: every active slot's A at once
        shrunk = shrunk * state.mask(self.rows_per_slot, shrunk.dtype)
        return torch.addmm(out, shrunk, self.b[:rows])


@dataclass(frozen=True)
class LoraTarget:
    """Where one PEFT module name of one decoder layer lands."""

    layer: LoraLayer
    block: int  # the rank block within the slot
    out_offset: int  # the first output column it writes
    out_size: int

    @property
    def in_size(self) -> int:
        return self.layer.in_features


@dataclass
class LoraModel:
    """What ``attach_lora`` made: the step state and the targets by (layer, PEFT name)."""

    state: LoraStepState
    layers: list[LoraLayer]
    targets: dict[tuple[int, str], LoraTarget]
    max_loras: int
    max_rank: int

    @property
    def target_names(self) -> set[str]:
        return {name for _, name in self.targets}


def _register(module: nn.Module, blocks: dict[str, tuple[int, int, int]], in_features: int,
              out_features: int, layer_index: int, made: LoraModel, dtype: torch.dtype,
              device: torch.device | str) -> None:
    """``blocks``: PEFT name -> (block, out_offset, out_size)."""
    num_blocks = 1 + max(b for b, _, _ in blocks.values())
    layer = LoraLayer(in_features, out_features, num_blocks, made.max_loras, made.max_rank,
                      made.state, dtype, device)
    module.register_forward_hook(layer.hook)
    made.layers.append(layer)
    for name, (block, offset, size) in blocks.items():
        made.targets[(layer_index, name)] = LoraTarget(layer, block, offset, size)


def attach_lora(model: DecoderForCausalLM, max_loras: int, max_rank: int, dtype: torch.dtype,
                device: torch.device | str) -> LoraModel:
    """Hook a LoraLayer onto every targetable projection of ``model``. Mixture-of-experts
    feed-forward blocks take no adapter (an adapter targeting them is refused by name when
    it loads)."""
    from shoal.runtime.model.decoder import DecoderLayer
    from shoal.runtime.model.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    made = LoraModel(LoraStepState(), [], {}, max_loras, max_rank)
    hidden = model.config.hidden_size
    for index, decoder_layer in enumerate(model.model.layers):
        assert isinstance(decoder_layer, DecoderLayer)
        qkv, o_proj = decoder_layer.self_attn.qkv_proj, decoder_layer.self_attn.o_proj
        assert isinstance(qkv, QKVParallelLinear) and isinstance(o_proj, RowParallelLinear)
        q, kv = qkv.q_size, qkv.kv_size
        total = q + 2 * kv
        _register(qkv, {"q_proj": (0, 0, q), "k_proj": (1, q, kv), "v_proj": (2, q + kv, kv),
                        "qkv_proj": (0, 0, total)}, hidden, total, index, made, dtype, device)
        _register(o_proj, {"o_proj": (0, 0, hidden)}, o_proj.in_size, hidden, index, made,
                  dtype, device)
        mlp = decoder_layer.mlp
        gate_up = getattr(mlp, "gate_up_proj", None)
        up = getattr(mlp, "up_proj", None)
        down = getattr(mlp, "down_proj", None)
        if isinstance(gate_up, ColumnParallelLinear):
            size = gate_up.local_sizes[0]
            _register(gate_up, {"gate_proj": (0, 0, size), "up_proj": (1, size, size),
                                "gate_up_proj": (0, 0, 2 * size)}, hidden, 2 * size, index,
                      made, dtype, device)
        elif isinstance(up, ColumnParallelLinear):
            size = up.local_sizes[0]
            _register(up, {"up_proj": (0, 0, size)}, hidden, size, index, made, dtype, device)
        if isinstance(down, RowParallelLinear) and (gate_up is not None or up is not None):
            _register(down, {"down_proj": (0, 0, hidden)}, down.in_size, hidden, index, made,
                      dtype, device)
    return made
