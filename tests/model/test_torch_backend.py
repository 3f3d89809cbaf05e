"""The torch paged-attention backend against a dense reference computed without any cache.

Every case poisons the cache with NaN first, so reading a slot outside a request's context
(or one not written yet) turns the output into NaN and fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from shoal.runtime.attention.backend import AttentionMetadata
from shoal.runtime.attention.selector import get_attention_backend
from shoal.runtime.attention.torch_backend import TorchAttentionBackend

HEAD_DIM = 16


def dense_reference(q, k_ctx, v_ctx, prefix, scale, window=None, softcap=None):
    """q [L, Hq, D] at positions prefix..prefix+L-1 over k/v [S, Hk, D] at 0..S-1."""
    group = q.shape[1] // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(group, dim=1)
    v = v_ctx.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k.double()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(prefix, prefix + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v.double()).float()


class Case:
    """Requests described by (cached prefix length, new tokens); builds cache and metadata."""

    def __init__(self, specs, num_heads, num_kv_heads, block_size, num_blocks=64, seed=0,
                 share_first_blocks=0):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.k_cache = torch.full((num_blocks, block_size, num_kv_heads, HEAD_DIM), float("nan"))
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.contexts, tables, slots, qsl, seq_lens = [], [], [], [0], []
        q_parts, k_parts, v_parts = [], [], []
        shared: list[int] = []
        for i, (prefix, new) in enumerate(specs):
            total = prefix + new
            nb = math.ceil(total / block_size)
            if i > 0 and share_first_blocks:
                blocks = shared[:share_first_blocks] + [free.pop() for _ in
                                                        range(nb - share_first_blocks)]
            else:
                blocks = [free.pop() for _ in range(nb)]
            if i == 0:
                shared = blocks
            k_all = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
            v_all = torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen)
            if i > 0 and share_first_blocks:  # a shared prefix has the same KV
                n = share_first_blocks * block_size
                k_all[:n], v_all[:n] = self.contexts[0][0][:n], self.contexts[0][1][:n]
            for p in range(prefix):  # the cached prefix is already in the cache
                b, o = blocks[p // block_size], p % block_size
                self.k_cache[b, o], self.v_cache[b, o] = k_all[p], v_all[p]
            for p in range(prefix, total):
                slots.append(blocks[p // block_size] * block_size + p % block_size)
            q_parts.append(torch.randn(new, num_heads, HEAD_DIM, generator=gen))
            k_parts.append(k_all[prefix:])
            v_parts.append(v_all[prefix:])
            self.contexts.append((k_all, v_all, prefix))
            tables.append(blocks)
            qsl.append(qsl[-1] + new)
            seq_lens.append(total)
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.q, self.k, self.v = torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts)
        self.qsl = qsl
        self.meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=bt,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens),
            block_size=block_size, query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)

    def poison_blocks_before_windows(self, window: int) -> int:
        """NaN into every block of a request that lies wholly before the window of its first
        query of the step: a backend that reads one fails the comparison. Returns how many."""
        poisoned = 0
        for i, (_, _, prefix) in enumerate(self.contexts):
            first_needed = max(0, prefix - window + 1)
            for j in range(first_needed // self.block_size):
                block = int(self.meta.block_tables[i, j])
                self.k_cache[block] = float("nan")
                self.v_cache[block] = float("nan")
                poisoned += 1
        return poisoned

    def run(self, window=None, softcap=None):
        backend = TorchAttentionBackend()
        meta = backend.build_metadata(self.meta)
        scale = HEAD_DIM ** -0.5
        out = backend.forward(self.q, self.k, self.v, self.k_cache, self.v_cache, meta, scale,
                              window, softcap)
        for i, (k_all, v_all, prefix) in enumerate(self.contexts):
            lo, hi = self.qsl[i], self.qsl[i + 1]
            ref = dense_reference(self.q[lo:hi], k_all, v_all, prefix, scale, window, softcap)
            torch.testing.assert_close(out[lo:hi], ref, atol=1e-5, rtol=1e-4)
        return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_ragged_prefill_batch_without_cache(num_heads, num_kv_heads):
    Case([(0, 7), (0, 1), (0, 33), (0, 16)], num_heads, num_kv_heads, block_size=16).run()


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_rows_of_different_lengths(block_size):
    Case([(5, 1), (40, 1), (0, 1), (16, 1), (17, 1)], 8, 2, block_size, num_blocks=128).run()


def test_chunked_prefill_after_a_cached_prefix_mixed_with_decode():
    # a chunk continuing at position 13, a chunk continuing at a block boundary, decodes
    Case([(13, 9), (20, 1), (16, 16), (3, 1), (0, 5)], 4, 2, block_size=4).run()


def test_requests_sharing_prefix_blocks_read_the_same_kv():
    # the second and third request reuse the first request's first two full blocks
    case = Case([(8, 4), (8, 1), (8, 6)], 4, 2, block_size=4, share_first_blocks=2)
    assert (case.meta.block_tables[1, :2] == case.meta.block_tables[0, :2]).all()
    case.run()


def test_sliding_window_limits_what_each_query_sees():
    Case([(10, 6), (30, 1), (0, 12)], 4, 2, block_size=4).run(window=5)


def test_a_windowed_layer_never_reads_a_block_before_its_window():
    """Blocks wholly before each request's window hold NaN: decode rows and prefill chunks
    after a cached prefix still equal the reference (item 3 of issue 28)."""
    case = Case([(30, 1), (17, 1), (21, 6), (12, 9), (0, 12)], 4, 2, block_size=4)
    assert case.poison_blocks_before_windows(window=5) >= 12
    case.run(window=5)


@pytest.mark.parametrize("window", [None, 6])
def test_softcapped_scores_match_the_reference(window):
    """Gemma 2's attention softcap, cap * tanh(scores / cap), in decode rows, a fresh prompt
    and chunks after a cached prefix; with and without a window."""
    Case([(10, 6), (30, 1), (0, 12), (5, 1)], 4, 2, block_size=4).run(window=window,
                                                                        softcap=1.5)


def test_many_decode_rows_split_into_gather_chunks(monkeypatch):
    import shoal.runtime.attention.torch_backend as tb

    monkeypatch.setattr(tb, "_DECODE_CHUNK_TOKENS", 64)  # forces several chunks
    specs = [(n % 23, 1) for n in range(20)] + [(4, 3)]
    Case(specs, 4, 2, block_size=4, num_blocks=128).run()


def test_new_kv_lands_in_the_slots_of_the_mapping():
    case = Case([(3, 2), (0, 4)], 4, 2, block_size=4)
    case.run()
    flat = case.k_cache.view(-1, 2, HEAD_DIM)
    torch.testing.assert_close(flat[case.meta.slot_mapping], case.k)


def test_reading_unwritten_memory_would_be_caught():
    """The poison works: a context claimed one token longer than written yields NaN."""
    case = Case([(6, 1)], 4, 2, block_size=4)
    case.meta.seq_lens_cpu = [8]
    case.meta.seq_lens = torch.tensor([8], dtype=torch.int32)
    backend = TorchAttentionBackend()
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache,
                          backend.build_metadata(case.meta), HEAD_DIM ** -0.5)
    assert torch.isnan(out).any()


def test_selector_names():
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    assert get_attention_backend("auto", torch.device("cpu"), torch.float16).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope", torch.device("cpu"))
