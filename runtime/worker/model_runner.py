"""ModelRunner: a StepPlan in, logits for the sampling rows out.

Holds the model, its KV tensors (allocated once, one K and one V tensor per layer, in the
model's dtype or ``--kv-cache-dtype``'s float8; for latent attention the latent and the rotary
key, ``model/mla.py``; for a hybrid model's linear-attention layers, their per-request state
from ``state_slots.py`` in those layers' places) and the attention backend. Each plan array crosses to the device with a single copy; the forward
runs the whole flat batch, and logits are computed only for rows that sample this step.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, replace

import numpy as np
import torch
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata
from shoal.runtime.kv.kv_groups import plan_kv_groups
from shoal.runtime.model.decoder import DecoderForCausalLM
from shoal.runtime.wire.plan import StepPlan
from shoal.runtime.worker.cuda_graphs import DecodeGraphRunner, try_replay
from shoal.runtime.worker.state_slots import StateCache


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros`` for a KV cache tensor. On a CPU it is an anonymous private memory map:
    the kernel hands out each page zeroed when it is first touched, where ``torch.zeros``
    writes every byte at allocation. A cache is sized for the most a replica may hold and
    mostly untouched for long after its start: the default model's 6 GiB default budget
    took 10.6 CPU-s to zero-fill (a third of its ``shoal serve`` start, on a shared
    2-core machine) and stayed resident, unused. A page costs its zeroing when a block
    first lands on it instead (page-aligned, as the native kernels need at least)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor holds a reference to the map; the map is unmapped when the tensor is freed
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # long [S]: last scheduled token of each sampling row


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, backend: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, block_size: int,
                 kv_cache_dtype: torch.dtype | None = None, state_slots: int = 0,
                 hybrid_kv: bool = True) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphRunner | None = None  # captured by Worker.warmup on CUDA
        # this rank's linear-attention heads (tensor parallelism splits them)
        lin = next((layer.linear_attn.lin for layer in model.model.layers
                    if getattr(layer, "mixer_name", None) == "linear_attn"), None)
        # one slot per request that may run at once (max_num_seqs): made once, kept across
        # init_kv_cache calls (the memory profile re-sizes only the KV cache)
        self.states = StateCache(lin, state_slots, dtype, device) if lin is not None else None
        # sliding and full layers in one model: per-group block tables over shared tensors
        # (``kv/kv_groups.py``; the engine core plans the same groups from the same config)
        self.kv_groups = plan_kv_groups(model.config.layer_windows,
                                        split=hybrid_kv and lin is None)

    def _attention_layers(self) -> list[int]:
        """Indices of the layers with a KV cache (all but linear-attention layers)."""
        states = self.states.layers if self.states is not None else {}
        return [i for i in range(len(self.model.model.layers)) if i not in states]

    @property
    def num_kv_heads(self) -> int:
        return self._first_attention().num_kv_heads

    def _first_attention(self):
        return self.model.model.layers[self._attention_layers()[0]].self_attn

    def _cache_dims(self) -> tuple[int, int, int]:
        """(heads, first tensor's width, second's) per token per layer: K and V, or for
        latent attention the latent and the rotary key (``MultiLatentAttention``)."""
        return self._first_attention().kv_cache_dims()

    def kv_bytes_per_block(self) -> int:
        heads, k_width, v_width = self._cache_dims()
        elem = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        per_layer = self.block_size * heads * (k_width + v_width) * elem
        if self.kv_groups.hybrid:  # a block id is a page in each of ``slots`` tensor pairs
            return per_layer * self.kv_groups.slots
        return per_layer * len(self._attention_layers())

    def init_kv_cache(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        heads, k_width, v_width = self._cache_dims()
        self.kv_caches = []  # release the old tensors before allocating new ones
        states = self.states.layers if self.states is not None else {}

        def pair() -> tuple[torch.Tensor, torch.Tensor]:
            return (zeroed((num_blocks, self.block_size, heads, k_width),
                           self.kv_cache_dtype, self.device),
                    zeroed((num_blocks, self.block_size, heads, v_width),
                           self.kv_cache_dtype, self.device))

        if self.kv_groups.hybrid:  # layer j of every group shares tensor pair j
            shared = [pair() for _ in range(self.kv_groups.slots)]
            self.kv_caches = [shared[slot] for slot in self.kv_groups.layer_slot]
            return
        self.kv_caches = [states[i] if i in states else pair()
                          for i in range(len(self.model.model.layers))]

    @property
    def num_blocks(self) -> int:
        if not self.kv_caches:
            return 0
        return self.kv_caches[self._attention_layers()[0]][0].shape[0]

    def release_states(self, req_ids: list[str]) -> None:
        """Free the linear-attention state slots of these requests (no-op otherwise)."""
        if self.states is not None:
            self.states.release(req_ids)

    def prepare(self, plan: StepPlan) -> StepInputs:
        to = self.device
        qsl = np.asarray(plan.query_start_loc)
        qsl_cpu = qsl.tolist()
        seq_lens_cpu = np.asarray(plan.seq_lens).tolist()
        sample_rows = np.asarray(plan.sample_rows, dtype=bool)
        logits_indices = (qsl[1:][sample_rows] - 1).astype(np.int64)
        max_query_len = int(np.max(np.diff(qsl))) if len(qsl) > 1 else 0
        attn = AttentionMetadata(
            query_start_loc=_to(plan.query_start_loc, torch.int32, to),
            seq_lens=_to(plan.seq_lens, torch.int32, to),
            block_tables=_to(plan.block_tables, torch.int32, to),
            slot_mapping=_to(plan.slot_mapping, torch.int64, to),
            max_query_len=max_query_len,
            max_seq_len=max(seq_lens_cpu, default=0),
            block_size=self.block_size,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        if self.states is not None:
            self.states.release(plan.finished_req_ids)
            slots = self.states.assign(plan.req_ids,
                                       np.asarray(plan.positions)[qsl[:-1]] if len(qsl) > 1
                                       else np.zeros(0, np.int64))
            attn.state_slots_cpu = slots
            attn.state_slots = torch.tensor(slots, dtype=torch.int64, device=to)
        attn = self.backend.build_metadata(attn)
        if plan.group_block_tables:  # each KV cache group reads and writes its own blocks
            attn.group_metas = [attn] + [
                self.backend.build_metadata(replace(
                    attn, block_tables=_to(tables, torch.int32, to),
                    slot_mapping=_to(slots, torch.int64, to), extra=None))
                for tables, slots in zip(plan.group_block_tables, plan.group_slot_mappings,
                                         strict=True)]
            attn.layer_group = self.kv_groups.layer_group
        return StepInputs(
            input_ids=_to(plan.input_ids, torch.int64, to),
            positions=_to(plan.positions, torch.int64, to),
            attn=attn,
            logits_indices=_to(logits_indices, torch.int64, to),
        )

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits [S, vocab] for the sampling rows, in row order."""
        return self.forward_with_extra_rows(plan, None)[0]

    def forward_hidden(self, plan: StepPlan) -> torch.Tensor:
        """The final hidden state of every scheduled token [T, hidden] (the pooling runner:
        prompts only, so always eager)."""
        if not self.kv_caches:
            raise RuntimeError("init_kv_cache must run before the first step")
        inputs = self.prepare(plan)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)

    def forward_with_extra_rows(self, plan: StepPlan, extra_token_indices: np.ndarray | None
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling rows' logits, and the logits at ``extra_token_indices`` (flat token
        positions of this step: prompt logprobs) when given."""
        if not self.kv_caches:
            raise RuntimeError("init_kv_cache must run before the first step")
        inputs = self.prepare(plan)
        hidden = try_replay(self.decode_graphs, inputs.input_ids, inputs.positions, inputs.attn)
        if hidden is None:  # not a pure decode step within the captured sizes: eager
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)
        if inputs.logits_indices.numel() == hidden.shape[0]:
            rows = hidden  # every token samples (pure decode): no gather
        else:
            rows = hidden.index_select(0, inputs.logits_indices)
        extra = None
        if extra_token_indices is not None and len(extra_token_indices):
            extra = self.model.compute_logits(hidden.index_select(
                0, _to(extra_token_indices, torch.int64, self.device)))
        return self.model.compute_logits(rows), extra


def _to(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(array))
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t
