"""Qwen3-Next's full-attention layers: attention whose output is gated per channel.

``q_proj`` is twice as wide as the heads need: each head's row holds its query
(``head_dim``) followed by a gate (``head_dim``), and the attention output is multiplied by
``sigmoid(gate)`` before ``o_proj``. q/k are normalised per head, then rotated on their
leading ``partial_rotary_factor`` part, and attend over the paged KV cache through the same
backend as every other layer; only the gate is new here.
"""

from __future__ import annotations

import torch
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.model.config import ModelConfig
from shoal.runtime.model.decoder import Attention, KVCache, RopeTables
from shoal.runtime.model.layers import RotaryEmbedding
from shoal.runtime.model.linear import QKVParallelLinear
from shoal.runtime.model.ops import Kernels
from shoal.runtime.model.parallel import ParallelContext


class GatedAttention(Attention):
    def __init__(self, config: ModelConfig, layer_index: int, parallel: ParallelContext,
                 rotary: RotaryEmbedding | None, backend: AttentionBackend, kernels: Kernels,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__(config, layer_index, parallel, rotary, backend, kernels, dtype, device)
        # the packed projection's "q" part holds query and gate: twice the query heads' width
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim,
                                          2 * config.num_heads, config.num_kv_heads,
                                          config.qkv_bias, parallel, dtype, device)
        self.kv_size = self.qkv_proj.kv_size
        self.q_gate_size = self.qkv_proj.q_size
        # the fused in-place rotary paths read q straight from the packed rows, where query
        # and gate interleave per head: the plain path is the one that fits
        self.fused_qk_norm_rotary = None
        self.qk_norm_rotary_in_place = None
        self.rotate_in_place = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, rope: RopeTables | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_gate = qkv[:, :self.q_gate_size].view(-1, self.num_heads, 2 * self.head_dim)
        q, gate = q_gate[..., :self.head_dim], q_gate[..., self.head_dim:]
        k = qkv[:, self.q_gate_size:self.q_gate_size + self.kv_size].view(
            -1, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_gate_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.rotary is not None:
            q, k = self.rotary.rotate(rope if rope is not None
                                      else self.rotary.cos_sin(positions), q, k)
        out = self.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache[0],
                                   kv_cache[1], meta, self.scale, self.sliding_window,
                                   self.softcap, self.sinks, self.kv_scales)
        out = out.reshape(out.shape[0], -1) * torch.sigmoid(gate.reshape(gate.shape[0], -1))
        return self.o_proj(out)
