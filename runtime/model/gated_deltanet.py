"""Qwen3-Next's Gated DeltaNet layer: linear attention over a per-request state, no KV cache.

Where an attention layer gets its KV tensors, this layer gets its state tensors in the same
slot of ``kv_caches``: ``(conv windows [slots, C, K-1], recurrent states [slots, H, Dk,
Dv])``, one row per request slot, and the step's rows find theirs in
``AttentionMetadata.state_slots`` (``worker/state_slots.py`` assigns them and zeroes a slot
whenever its request starts from position 0, so recompute after preemption starts clean).

Per token: ``in_proj_qkvz`` gives q, k, v and the output gate z (laid out per key-head
group, as the checkpoint stores them), ``in_proj_ba`` the write strength b and the decay
input a (Qwen3.5 stores the four apart: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``); q/k/v pass a depthwise causal conv + SiLU, then the gated delta rule (a
chunked scan for prefill rows, the one-token update for decode rows); the output is
RMS-normalised per head, times ``silu(z)``, and projected back. The conv and the rule run
as ``ops`` chose them: ``delta_rule.py`` in torch, or the Triton kernels of
``shoal/kernels/gated_delta_rule.py``.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionMetadata
from shoal.runtime.model.delta_rule import l2_normalise
from shoal.runtime.model.layers import _param
from shoal.runtime.model.linear import (
    ReplicatedLinear,
    RowParallelLinear,
    _copy,
    _read,
    _set_loader,
)
from shoal.runtime.model.linear_attn_config import LinearAttnConfig
from shoal.runtime.model.ops import Kernels
from shoal.runtime.model.parallel import ParallelContext
from torch import nn


class _Conv(nn.Module):
    """Holds ``conv1d.weight [C, 1, K]`` under the checkpoint's name."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.weight = _param((channels, 1, kernel), dtype, device)


class _GatedNorm(nn.Module):
    """``norm.weight [Dv]``: RMS over each head's output, times weight (no Gemma offset)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), dtype, device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


def _rank_rows(parallel: ParallelContext, segments: list[int]):
    """A loader taking this rank's share of each segment of a tensor's first dimension
    (checkpoint sizes), concatenated: q|k|v channels split by heads, each part apart."""

    def load(param: nn.Parameter, st_slice, _shard: object) -> None:
        parts, at = [], 0
        for size in segments:
            start, end = parallel.shard_range(size)
            parts.append(_read(st_slice, 0, at + start, at + end))
            at += size
        _copy(param.data, parts[0] if len(parts) == 1 else torch.cat(parts),
              "linear-attention rows")

    return load


class GatedDeltaNet(nn.Module):
    """Tensor parallelism splits the key heads (and with them their value heads) over the
    ranks: every projection into the heads is cut by rows, each rank keeps its heads' state,
    and ``out_proj`` is row-parallel (one all-reduce per layer), as attention is split."""

    def __init__(self, lin: LinearAttnConfig, hidden_size: int, eps: float,
                 parallel: ParallelContext, kernels: Kernels, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.ops = kernels.linear_attention
        world = parallel.world_size
        full = lin
        # this rank's heads; ``linear_layers`` stays global (it indexes the model's layers)
        self.lin = lin = replace(lin, num_k_heads=lin.num_k_heads // world,
                                 num_v_heads=lin.num_v_heads // world)
        self.group = lin.num_v_heads // lin.num_k_heads  # value heads per key head
        qkv_segments = [full.key_dim, full.key_dim, full.value_dim]

        def rows(size: int, segments: list[int]) -> ReplicatedLinear:
            layer = ReplicatedLinear(hidden_size, size, False, dtype, device)
            _set_loader(layer.weight, _rank_rows(parallel, segments))
            return layer

        if lin.separate_projections:  # Qwen3.5
            self.in_proj_qkv = rows(lin.conv_dim, qkv_segments)
            self.in_proj_z = rows(lin.value_dim, [full.value_dim])
            self.in_proj_b = rows(lin.num_v_heads, [full.num_v_heads])
            self.in_proj_a = rows(lin.num_v_heads, [full.num_v_heads])
        else:  # Qwen3-Next: whole key-head groups are contiguous rows
            self.in_proj_qkvz = rows(2 * lin.key_dim + 2 * lin.value_dim,
                                     [2 * full.key_dim + 2 * full.value_dim])
            self.in_proj_ba = rows(2 * lin.num_v_heads, [2 * full.num_v_heads])
        self.conv1d = _Conv(lin.conv_dim, lin.conv_kernel, dtype, device)
        _set_loader(self.conv1d.weight, _rank_rows(parallel, qkv_segments))
        # decay parameters in float32: exp(A_log) in a half dtype can overflow
        self.dt_bias = _param((lin.num_v_heads,), torch.float32, device)
        self.A_log = _param((lin.num_v_heads,), torch.float32, device)
        for param in (self.dt_bias, self.A_log):
            _set_loader(param, _rank_rows(parallel, [full.num_v_heads]))
        self.norm = _GatedNorm(lin.head_v_dim, eps, dtype, device)
        self.out_proj = RowParallelLinear(full.value_dim, hidden_size, False, parallel, dtype,
                                          device)

    def _split(self, x: torch.Tensor):
        """The conv's input q|k|v [T, C], z [T, Hv, Dv], b, a [T, Hv]."""
        lin, tokens = self.lin, x.shape[0]
        if lin.separate_projections:
            return (self.in_proj_qkv(x),
                    self.in_proj_z(x).view(tokens, lin.num_v_heads, lin.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        # Qwen3-Next: each key head's group holds its q, k, then its value heads' v and z
        qkvz = self.in_proj_qkvz(x).view(tokens, lin.num_k_heads, -1)
        width = self.group * lin.head_v_dim
        q, k, v, z = torch.split(qkvz, [lin.head_k_dim, lin.head_k_dim, width, width], dim=-1)
        b, a = torch.split(self.in_proj_ba(x).view(tokens, lin.num_k_heads, -1),
                           [self.group, self.group], dim=-1)
        mixed = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)],
                          dim=-1)
        return (mixed, z.reshape(tokens, lin.num_v_heads, lin.head_v_dim),
                b.reshape(tokens, -1), a.reshape(tokens, -1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                rope: object = None) -> torch.Tensor:
        lin = self.lin
        conv_states, recurrent_states = state
        assert meta.state_slots is not None, \
            "a linear-attention layer needs AttentionMetadata.state_slots"
        mixed, z, b, a = self._split(x)  # mixed [T, C]: the conv's channels, q|k|v
        conv_out = self.ops.conv(mixed, conv_states, self.conv1d.weight[:, 0, :], meta)
        q, k, v = torch.split(conv_out, [lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        tokens = x.shape[0]
        # per key head: the kernels map each value head to its key head
        q = l2_normalise(q.reshape(tokens, lin.num_k_heads, lin.head_k_dim).float())
        q = q * lin.head_k_dim ** -0.5
        k = l2_normalise(k.reshape(tokens, lin.num_k_heads, lin.head_k_dim).float())
        v = v.reshape(tokens, lin.num_v_heads, lin.head_v_dim).float()
        beta = b.float().sigmoid()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        out = self.ops.delta_rule(q, k, v, g, beta, recurrent_states, meta)
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.reshape(tokens, lin.value_dim))
