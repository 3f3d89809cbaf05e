"""LoRA on the decoder's projections: every slot's adapter applied in one batched computation.

``attach_lora`` gives each targetable projection (the packed qkv, o, the packed gate/up, up,
down) a ``LoraLayer``, registered as a forward hook, so the linear layers themselves never
change. A layer has one *block* per output segment (qkv: q, k, v; gate/up: gate, up). Per
slot, its blocks' A are stacked in one ``[blocks * max_rank, in]`` and their B in one
``[blocks * max_rank, out]`` (scaled, transposed, each block's rows zero outside its segment's
columns); the slots are stacked on a leading axis, so the active slots are a prefix. A fused
adapter module (Phi-3's ``qkv_proj``) fills every block of its layer: the same A, its B cut
at the segment boundaries.

The step, per layer that some active slot uses, in a fixed number of ops whatever the mix of
adapters (never a loop over adapters or tokens); base-model tokens get nothing added:

- a small step (decode): ``out += ((x @ A.T) * mask) @ B`` with all active slots' A and B
  flattened, ``mask[t, c]`` keeping only the columns of token t's slot. Three ops: at decode
  sizes the op count costs more than computing the other slots' columns (on a shared CPU each
  parallel op can also wait for a descheduled thread).
- a large step (a prefill): the adapter tokens grouped by slot (``SlotGroups``, padded to the
  largest group), two ``torch.bmm`` per segment and an ``index_add_`` back: each token meets
  only its own adapter, and B's zero columns cost no FLOPs.

The mask or the groups are built once per step, not once per layer. A step with no adapter
token skips the hooks' work entirely.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from shoal.runtime.model.decoder import DecoderForCausalLM

# steps up to this many tokens take the masked path, larger ones the grouped path
MASKED_MAX_TOKENS = 128


@dataclass(frozen=True)
class SlotGroups:
    """The step's adapter tokens grouped by slot, each group padded to the largest one, so
    that one batched matmul per weight serves every slot with its own tokens only."""

    gather: torch.Tensor  # long [num_active * width]: the token at each padded position
    tokens: torch.Tensor  # long [n]: the adapter tokens, grouped by slot
    positions: torch.Tensor  # long [n]: each one's padded position
    width: int  # the largest group


def group_by_slot(token_slots: torch.Tensor, num_active: int) -> SlotGroups | None:
    on_adapter = (token_slots >= 0).nonzero().squeeze(1)
    if on_adapter.numel() == 0:
        return None
    slots, order = torch.sort(token_slots[on_adapter], stable=True)
    tokens = on_adapter[order]
    counts = torch.bincount(slots, minlength=num_active)
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(slots.numel(), device=slots.device) - starts[slots]
    positions = slots * width + rank_in_group
    # padding reads token 0; what it computes is never added anywhere
    gather = torch.zeros(num_active * width, dtype=torch.long, device=slots.device)
    gather[positions] = tokens
    return SlotGroups(gather, tokens, positions, width)


@dataclass
class LoraStepState:
    """Set by the worker before each forward; shared by every LoraLayer of the model."""

    token_slots: torch.Tensor | None = None  # long [T]; None: no adapter token this step
    num_active: int = 0  # slots 0..num_active-1 may appear in token_slots
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)
    _groups: SlotGroups | None = None

    def set_step(self, token_slots: torch.Tensor | None, num_active: int) -> None:
        self.token_slots = token_slots
        self.num_active = num_active if token_slots is not None else 0
        self._masks = {}
        self._groups = None

    def mask(self, rows_per_slot: int, dtype: torch.dtype) -> torch.Tensor:
        """``[T, num_active * rows_per_slot]``: 1 where the column belongs to the token's slot
        (one per step per row count: a few distinct ones)."""
        found = self._masks.get(rows_per_slot)
        if found is None:
            assert self.token_slots is not None
            column_slot = torch.arange(self.num_active * rows_per_slot,
                                       device=self.token_slots.device) // rows_per_slot
            found = (self.token_slots[:, None] == column_slot[None, :]).to(dtype)
            self._masks[rows_per_slot] = found
        return found

    def groups(self) -> SlotGroups | None:
        if self._groups is None:
            assert self.token_slots is not None
            self._groups = group_by_slot(self.token_slots, self.num_active)
        return self._groups


class LoraLayer:
    """The stacked adapters of one projection: A ``[slot, block*rank, in]``, B ``[slot,
    block*rank, out]``."""

    def __init__(self, in_features: int, segments: list[tuple[int, int]], max_loras: int,
                 max_rank: int, state: LoraStepState, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.in_features = in_features
        self.segments = segments  # (out_offset, size) of each block
        self.max_rank = max_rank
        self.state = state
        self.rows_per_slot = len(segments) * max_rank
        self.out_features = max(offset + size for offset, size in segments)
        self.a = torch.zeros(max_loras, self.rows_per_slot, in_features, dtype=dtype,
                             device=device)
        self.b = torch.zeros(max_loras, self.rows_per_slot, self.out_features, dtype=dtype,
                             device=device)
        self.used = [False] * max_loras  # slots holding something here: others are skipped

    def clear_slot(self, slot: int) -> None:
        if self.used[slot]:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.used[slot] = False

    def set_target(self, slot: int, blocks: tuple[int, ...], lora_a: torch.Tensor,
                   scaled_b_t: torch.Tensor) -> None:
        """``lora_a [r, in]``, ``scaled_b_t [r, sum of the blocks' sizes]`` (B transposed,
        times the scale): the same A in each block, B cut at the segment boundaries."""
        rank = lora_a.shape[0]
        column = 0
        for block in blocks:
            offset, size = self.segments[block]
            start = block * self.max_rank
            self.a[slot, start:start + rank].copy_(lora_a)
            self.b[slot, start:start + rank, offset:offset + size].copy_(
                scaled_b_t[:, column:column + size])
            column += size
        self.used[slot] = True

    def hook(self, _module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.token_slots is None or not any(self.used[:state.num_active]):
            return out
        x = args[0]
        if x.shape[0] <= MASKED_MAX_TOKENS:
            self._masked(x, out)
        else:
            self._grouped(x, out)
        return out

    def _masked(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows = self.state.num_active * self.rows_per_slot
        a = self.a[:self.state.num_active].view(rows, self.in_features)
        shrunk = F.linear(x, a).mul_(self.state.mask(self.rows_per_slot, x.dtype))
        out.addmm_(shrunk, self.b[:self.state.num_active].view(rows, self.out_features))

    def _grouped(self, x: torch.Tensor, out: torch.Tensor) -> None:
        groups = self.state.groups()
        if groups is None:
            return
        active = self.state.num_active
        grouped = x.index_select(0, groups.gather).view(active, groups.width, -1)
        shrunk = torch.bmm(grouped, self.a[:active].transpose(1, 2))  # [slots, width, rows]
        rank = self.max_rank
        for block, (offset, size) in enumerate(self.segments):
            rows = slice(block * rank, (block + 1) * rank)
            grown = torch.bmm(shrunk[:, :, rows], self.b[:active, rows, offset:offset + size])
            added = grown.view(-1, size).index_select(0, groups.positions)
            out[:, offset:offset + size].index_add_(0, groups.tokens, added)


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

    @property
    def target_names(self) -> set[str]:
        return {name for _, name in self.targets}


def _register(module: nn.Module, segments: list[tuple[int, int]],
              targets: dict[str, tuple[int, ...]], in_features: int, layer_index: int,
              made: LoraModel, dtype: torch.dtype, device: torch.device | str) -> None:
    """``segments``: (out_offset, size) per block; ``targets``: PEFT name -> its blocks."""
    layer = LoraLayer(in_features, segments, made.max_loras, made.max_rank, made.state, dtype,
                      device)
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

    made = LoraModel(LoraStepState(), [], {}, max_loras, max_rank)
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
