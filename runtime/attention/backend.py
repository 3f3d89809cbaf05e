"""Attention backend interface: the only thing the model knows about paged KV.

The model runner builds one ``AttentionMetadata`` per step (``backend.build_metadata``,
where flashinfer would ``plan()``), and every layer calls ``backend.forward``, which writes
the new K/V through ``slot_mapping`` and attends over each request's context read through
its block table. Backends (torch reference, Triton, flashinfer) drop in without touching
the model.

Attention sinks (gpt-oss): a learned logit per query head that joins every softmax's
denominator and attends to nothing: ``p_i = exp(s_i) / (exp(sink) + sum_j exp(s_j))``.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` each
``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD), in the model's dtype or, with
``--kv-cache-dtype fp8``, in float8 with the layer's ``kv_scales`` (``kv_cache_dtype.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1] on device
    seq_lens: torch.Tensor  # int32 [B]: context length after this step
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # host copies: backends that loop over requests on CPU avoid device syncs
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # backend-specific prepared state (flashinfer wrappers, split decode/prefill, ...)
    extra: object | None = None
    # hybrid models (Gated DeltaNet layers): each row's slot in the per-request state tensors
    # (``worker/state_slots.py``); None for models whose every layer attends
    state_slots: torch.Tensor | None = None  # int64 [B]
    state_slots_cpu: list[int] | None = None
    # a model with several KV cache groups (``kv/kv_groups.py``): each group's metadata (its
    # block tables and slot mapping; entry 0 is this one) and each model layer's group
    group_metas: list[AttentionMetadata] | None = None
    layer_group: tuple[int, ...] = ()

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Called once per step before the forward pass; may fill ``meta.extra``."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # attend to the last this-many positions only
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
        sinks: torch.Tensor | None = None,  # float32 [num_heads]: gpt-oss's attention sinks
        kv_scales: torch.Tensor | None = None,  # float32 [2]: (k, v) scales of a float8 cache
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
