"""LoRA on the decoder's projections: every slot's adapter applied in one batched computation.

``attach_lora`` gives each targetable projection (the packed qkv, o, the packed gate/up, up,
down) a ``LoraLayer``, registered as a forward hook, so the linear layers themselves never
change. A layer has one *block* per output segment (qkv: q, k, v; gate/up: gate, up); a block
stacks the A (``[slots * max_rank, in]``) and B (``[slots * max_rank, segment]``, scaled and
transposed) of all ``max_loras`` slots. A fused adapter module (Phi-3's ``qkv_proj``) fills
every block of the layer: the same A, its B cut at the segment boundaries.

The step: ``LoraStepState`` holds each token's slot (-1: the base model). Per block that some
active slot uses: ``out[:, segment] += ((x @ A.T) * mask) @ B`` over the whole flat batch,
with A and B cut to the active slots and ``mask[t, c]`` (one per step) keeping only the
columns of token t's slot: two dense matmuls per block whatever the mix of adapters (a loop
over a layer's 1-3 segments, never over adapters or tokens). Where ``ops.choose_kernels``
picks Triton (the triton attention backend on CUDA) the same sum is two launches per block
(shoal/kernels/lora_batched.py) over the rows grouped by slot once per step, so each row
multiplies only its own slot's A and B. A step with no adapter token skips the hooks' work
entirely.
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
    _grouped: tuple[torch.Tensor, torch.Tensor] | None = None

    def set_step(self, token_slots: torch.Tensor | None, num_active: int) -> None:
        self.token_slots = token_slots
        self.num_active = num_active if token_slots is not None else 0
        self._masks = {}
        self._grouped = None

    def grouped_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' (row ids grouped by slot, each block's slot), once per step."""
        if self._grouped is None:
            from shoal.kernels.lora_batched import group_rows_by_slot

            assert self.token_slots is not None
            self._grouped = group_rows_by_slot(self.token_slots, self.num_active)
        return self._grouped

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
    """The stacked adapters of one projection, one block per output segment."""

    def __init__(self, in_features: int, segments: list[tuple[int, int]], max_loras: int,
                 max_rank: int, state: LoraStepState, dtype: torch.dtype,
                 device: torch.device | str, kernels: bool = False) -> None:
        self.in_features = in_features
        self.segments = segments  # (out_offset, size) of each block
        self.max_rank = max_rank
        self.state = state
        self.kernels = kernels  # the Triton kernels, else the masked torch matmuls
        rows = max_loras * max_rank
        self.a = [torch.zeros(rows, in_features, dtype=dtype, device=device) for _ in segments]
        self.b = [torch.zeros(rows, size, dtype=dtype, device=device) for _, size in segments]
        # which slots hold something in each block: blocks no active slot uses are skipped
        self.used = [[False] * max_loras for _ in segments]

    def clear_slot(self, slot: int) -> None:
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for a, b, used in zip(self.a, self.b, self.used, strict=True):
            if used[slot]:
                a[rows].zero_()
                b[rows].zero_()
                used[slot] = False

    def set_target(self, slot: int, blocks: tuple[int, ...], lora_a: torch.Tensor,
                   scaled_b_t: torch.Tensor) -> None:
        """``lora_a [r, in]``, ``scaled_b_t [r, sum of the blocks' sizes]`` (B transposed,
        times the scale): the same A in each block, B cut at the segment boundaries."""
        rank = lora_a.shape[0]
        start = slot * self.max_rank
        column = 0
        for block in blocks:
            size = self.segments[block][1]
            self.a[block][start:start + rank].copy_(lora_a)
            self.b[block][start:start + rank].copy_(scaled_b_t[:, column:column + size])
            self.used[block][slot] = True
            column += size

    def hook(self, _module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        if self.state.token_slots is None:
            return out
        if self.kernels:
            self.add_with_kernels(args[0], out)
        else:
            self.add_with_torch(args[0], out)
        return out

    def _used_blocks(self) -> list[int]:
        """Blocks that some active slot fills."""
        active = self.state.num_active
        return [i for i, used in enumerate(self.used) if any(used[:active])]

    def add_with_torch(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out += `` each token's adapter delta: masked dense matmuls over all rows."""
        rows = self.state.num_active * self.max_rank
        mask: torch.Tensor | None = None
        for block in self._used_blocks():
            offset, size = self.segments[block]
            if mask is None:
                mask = self.state.mask(self.max_rank, x.dtype)
            shrunk = torch.mm(x, self.a[block][:rows].T).mul_(mask)  # [T, rows]: every slot's A
            out[:, offset:offset + size].addmm_(shrunk, self.b[block][:rows])

    def add_with_kernels(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The same sum with the Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)."""
        from shoal.kernels.lora_batched import lora_shrink_expand

        blocks = self._used_blocks()
        if not blocks:
            return
        sorted_ids, block_slot = self.state.grouped_rows()
        for block in blocks:
            offset, size = self.segments[block]
            lora_shrink_expand(x, self.a[block], self.b[block], out[:, offset:offset + size],
                               self.max_rank, sorted_ids, block_slot)


@dataclass(frozen=True)
class LoraTarget:
    """Where one PEFT module name of one decoder layer lands."""

    layer: LoraLayer
    blocks: tuple[int, ...]  # the layer's segments it writes (several: a fused module)

    @property
    def in_size(self) -> int:
        return self.layer.in_features

    @property
    def out_size(self) -> int:
        return sum(self.layer.segments[b][1] for b in self.blocks)


@dataclass
class LoraModel:
    """What ``attach_lora`` made: the step state and the targets by (layer, PEFT name)."""

    state: LoraStepState
    layers: list[LoraLayer]
    targets: dict[tuple[int, str], LoraTarget]
    max_loras: int
    max_rank: int
    kernels: bool = False  # the layers run the Triton kernels

    @property
    def target_names(self) -> set[str]:
        return {name for _, name in self.targets}


def _register(module: nn.Module, segments: list[tuple[int, int]],
              targets: dict[str, tuple[int, ...]], in_features: int, layer_index: int,
              made: LoraModel, dtype: torch.dtype, device: torch.device | str) -> None:
    """``segments``: (out_offset, size) per block; ``targets``: PEFT name -> its blocks."""
    layer = LoraLayer(in_features, segments, made.max_loras, made.max_rank, made.state, dtype,
                      device, kernels=made.kernels)
    module.register_forward_hook(layer.hook)
    made.layers.append(layer)
    for name, blocks in targets.items():
        made.targets[(layer_index, name)] = LoraTarget(layer, blocks)


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

    made = LoraModel(LoraStepState(), [], {}, max_loras, max_rank,
                     kernels=model.kernels.choice.lora == "triton")
    hidden = model.config.hidden_size
    for index, decoder_layer in enumerate(model.model.layers):
        assert isinstance(decoder_layer, DecoderLayer)
        qkv, o_proj = decoder_layer.self_attn.qkv_proj, decoder_layer.self_attn.o_proj
        assert isinstance(qkv, QKVParallelLinear) and isinstance(o_proj, RowParallelLinear)
        q, kv = qkv.q_size, qkv.kv_size
        _register(qkv, [(0, q), (q, kv), (q + kv, kv)],
                  {"q_proj": (0,), "k_proj": (1,), "v_proj": (2,), "qkv_proj": (0, 1, 2)},
                  hidden, index, made, dtype, device)
        _register(o_proj, [(0, hidden)], {"o_proj": (0,)}, o_proj.in_size, index, made, dtype,
                  device)
        mlp = decoder_layer.mlp
        gate_up = getattr(mlp, "gate_up_proj", None)
        up = getattr(mlp, "up_proj", None)
        down = getattr(mlp, "down_proj", None)
        if isinstance(gate_up, ColumnParallelLinear):
            size = gate_up.local_sizes[0]
            _register(gate_up, [(0, size), (size, size)],
                      {"gate_proj": (0,), "up_proj": (1,), "gate_up_proj": (0, 1)}, hidden,
                      index, made, dtype, device)
        elif isinstance(up, ColumnParallelLinear):
            _register(up, [(0, up.local_sizes[0])], {"up_proj": (0,)}, hidden, index, made,
                      dtype, device)
        if isinstance(down, RowParallelLinear) and (gate_up is not None or up is not None):
            _register(down, [(0, hidden)], {"down_proj": (0,)}, down.in_size, index, made,
                      dtype, device)
    return made
