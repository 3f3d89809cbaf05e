"""CUDA graphs for decode steps.

A decode step of a small model is a few hundred short kernel launches; replaying them as
one captured graph removes the launch overhead that dominates at small batch. Graphs are
captured for a ladder of batch sizes, largest first, all in one memory pool (a smaller
graph reuses the larger one's memory). A step with ``n`` decodes runs the graph of the
smallest captured size ``>= n`` with the extra rows padded: slot ``-1`` (the KV write skips
it), one token of context in block 0, output ignored. Mixed or prefill steps, batches
above the largest size and ``--enforce-eager`` run eagerly.

The decisions (ladder, padding) are pure functions; ``DecodeGraphRunner`` owns the static
input buffers a graph reads and the captured graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from shoal.runtime.attention.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, max_capture_size: int = MAX_CAPTURE_SIZE) -> list[int]:
    """[1, 2, 4] + multiples of 8 up to min(max_num_seqs, max_capture_size), ascending.

    The cap itself is added when it is not a multiple of 8, so every batch the scheduler
    can form (up to max_num_seqs, within the cap) has a graph.
    """
    if max_num_seqs < 1 or max_capture_size < 1:
        raise ValueError("max_num_seqs and max_capture_size must be at least 1")
    cap = min(max_num_seqs, max_capture_size)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_batch_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_reqs`` rows; None above the largest."""
    for size in sizes:
        if size >= num_reqs:
            return size
    return None


def graph_batch_size(
    num_reqs: int, max_query_len: int, sizes: list[int], enforce_eager: bool
) -> int | None:
    """The captured size a step replays, or None when the step runs eagerly."""
    if enforce_eager or not sizes or num_reqs == 0 or max_query_len != 1:
        return None
    return padded_batch_size(num_reqs, sizes)


DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphRunner:
    """Static decode inputs plus one captured graph per size.

    ``forward(input_ids, positions, meta)`` is the model's step on the first ``size`` rows
    of the static buffers; it must only read tensors (no host syncs), as captured code does.
    """

    def __init__(
        self,
        sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        if not sizes:
            raise ValueError("no capture sizes")
        self.sizes = sorted(sizes)
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def metadata(self, size: int) -> AttentionMetadata:
        """Views of the static buffers for ``size`` rows: what a captured graph reads."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            # host copies are not refreshed on replay: graph-safe backends do not read them
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
        )

    def capture(self, forward: DecodeForward, prepare: Callable[[AttentionMetadata], AttentionMetadata]) -> float:
        """Capture every size, largest first, in one pool; returns the seconds it took.

        ``prepare`` is the backend's ``build_metadata``, run once per size outside capture.
        """
        with torch.cuda.device(self.device):  # TP ranks: capture on this rank's GPU
            return self._capture_all(forward, prepare)

    def _capture_all(self, forward: DecodeForward,
                     prepare: Callable[[AttentionMetadata], AttentionMetadata]) -> float:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = prepare(self.metadata(size))
            args = (self.input_ids[:size], self.positions[:size], meta)
            forward(*args)  # compile kernels and settle allocations outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = forward(*args)
            self._graphs[size] = (graph, output)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = max(free_before - torch.cuda.mem_get_info()[0], 0)
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.2f s using %.1f MiB",
            len(self.sizes), self.sizes[0], self.largest, self.capture_seconds,
            self.pool_bytes / 2**20,
        )
        return self.capture_seconds

    def stage(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        seq_lens: torch.Tensor,  # [n]
        block_tables: torch.Tensor,  # [n, w]
        slot_mapping: torch.Tensor,  # [n]
    ) -> int:
        """Copy one decode step into the static buffers and pad it; returns the padded size."""
        n = input_ids.shape[0]
        size = padded_batch_size(n, self.sizes)
        if size is None:
            raise ValueError(f"no captured size holds a batch of {n} (largest {self.largest})")
        width = block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"block tables of width {width} exceed the captured {self.block_tables.shape[1]}"
            )
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        if size > n:  # padding rows: no KV write, one token of context in block 0
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
        return size

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Stage one decode step, replay its graph; the first ``n`` output rows."""
        size = self.stage(input_ids, positions, seq_lens, block_tables, slot_mapping)
        if size not in self._graphs:
            raise RuntimeError(f"the graph for batch {size} was not captured")
        graph, output = self._graphs[size]
        graph.replay()
        return output[: input_ids.shape[0]]


def try_replay(
    graphs: DecodeGraphRunner | None,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor | None:
    """Hidden states from a graph replay, or None when this step must run eagerly."""
    if graphs is None or input_ids.shape[0] != meta.num_reqs or meta.group_metas is not None:
        return None
    if graph_batch_size(meta.num_reqs, meta.max_query_len, graphs.sizes, enforce_eager=False) is None:
        return None
    if meta.block_tables.shape[1] > graphs.block_tables.shape[1]:
        return None
    return graphs.run(input_ids, positions, meta.seq_lens, meta.block_tables, meta.slot_mapping)


def capture_decode_graphs(
    model: Callable[..., torch.Tensor],
    kv_caches: list,
    backend: AttentionBackend,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    enforce_eager: bool,
) -> DecodeGraphRunner | None:
    """Capture the decode ladder for ``model(input_ids, positions, kv_caches, meta)``.

    None (decode runs eagerly) off CUDA, with ``--enforce-eager``, or when the attention
    backend does host work per step (torch, flashinfer here) and so cannot be replayed.
    """
    if device.type != "cuda":
        return None
    if enforce_eager:
        logger.info("enforce_eager: decode steps run without CUDA graphs")
        return None
    if not getattr(backend, "cuda_graph_safe", False):
        logger.info("attention backend %s is not CUDA-graph safe: decode runs eagerly",
                    getattr(backend, "name", type(backend).__name__))
        return None
    graphs = DecodeGraphRunner(capture_sizes(max_num_seqs), -(-max_model_len // block_size),
                               block_size, max_model_len, device)
    prepare = backend.build_metadata
    with torch.inference_mode():
        graphs.capture(lambda ids, pos, meta: model(ids, pos, kv_caches, meta), prepare)
    return graphs
