"""The flashinfer backend's side of the contract, checked on CPU against a stand-in.

flashinfer itself needs CUDA. The stand-in below implements the documented semantics of
its two paged wrappers (CSR page table, ``causal`` aligned to the end of each request's KV,
``window_left`` keys before the query, ``sm_scale``) in plain torch, so these tests check
what our backend feeds it — the CSR conversion, the KV write, causal=True for prefill, the
window translation — and that it plans once per step, not once per layer.
"""

from __future__ import annotations

import types

import pytest
import torch

from shoal.kernels.reference import paged_attention_ref, reshape_and_cache_ref


class _FakeWrapper:
    plans: list[tuple[str, dict]] = []

    def __init__(self, workspace, layout, **kwargs):
        assert layout == "NHD"
        self.kind = "decode" if "Decode" in type(self).__name__ else "prefill"
        # flashinfer's CUDA-core decode runs GQA groups 1, 2, 3, 4 and 8 only; its tensor-core
        # decode runs any group (Qwen2.5-7B's 7, Qwen3-14B's 5)
        assert self.kind == "prefill" or kwargs == {"use_tensor_cores": True}, kwargs

    def plan(self, *args, **kwargs):
        if self.kind == "prefill":
            self.qo_indptr, args = args[0], args[1:]
        indptr, indices, last_len, hq, hkv, dim, page = args[:7]
        self.csr = (indptr.tolist(), indices.tolist(), last_len.tolist())
        self.page, self.kw = page, kwargs
        _FakeWrapper.plans.append((self.kind, kwargs))

    def run(self, q, paged_kv):
        k_cache, v_cache = paged_kv
        indptr, indices, last_len = self.csr
        qo = (self.qo_indptr.tolist() if self.kind == "prefill"
              else list(range(len(last_len) + 1)))
        causal = self.kw.get("causal", False) if self.kind == "prefill" else True
        window_left = self.kw.get("window_left", -1)
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for i in range(len(last_len)):
            pages = torch.tensor(indices[indptr[i]:indptr[i + 1]])
            kv_len = (len(pages) - 1) * self.page + last_len[i]
            keys = k_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
            vals = v_cache[pages].flatten(0, 1)[:kv_len].repeat_interleave(group, 1)
            queries = q[qo[i]:qo[i + 1]]
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * self.kw["sm_scale"]
            pos = torch.arange(kv_len - len(queries), kv_len)[:, None]
            key = torch.arange(kv_len)[None, :]
            visible = key <= pos if causal else torch.ones_like(key <= pos)
            if window_left >= 0:
                visible &= key >= pos - window_left
            scores = scores.masked_fill(~visible, float("-inf"))
            out[qo[i]:qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = type("BatchPrefillWithPagedKVCacheWrapper", (_FakeWrapper,), {})
    module.BatchDecodeWithPagedKVCacheWrapper = type("BatchDecodeWithPagedKVCacheWrapper", (_FakeWrapper,), {})
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", module)
    _FakeWrapper.plans = []
    return _FakeWrapper


def _meta(batch):
    from shoal.runtime.attention.backend import AttentionMetadata

    starts = batch.query_start_loc.tolist()
    return AttentionMetadata(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                             batch.slot_mapping, max(b - a for a, b in zip(starts, starts[1:], strict=False)),
                             int(batch.seq_lens.max()), batch.k_cache.shape[1], starts,
                             batch.seq_lens.tolist())


@pytest.mark.parametrize("requests,window", [
    ([(6, 4), (0, 9), (17, 1)], None),  # mixed: prefill wrapper, causal
    ([(6, 1), (12, 1), (3, 1)], None),  # pure decode: decode wrapper
    ([(6, 4), (0, 9), (17, 1)], 5),     # sliding window
])
def test_backend_feeds_flashinfer_what_reproduces_the_reference(rng, paged_batch, fake_flashinfer,
                                                                requests, window):
    from shoal.runtime.attention.flashinfer_backend import FlashInferBackend

    batch = paged_batch(rng, requests, 4, 2, 8, shared_prefix_blocks=1)
    k_ref, v_ref = batch.k_cache.clone(), batch.v_cache.clone()
    backend = FlashInferBackend()
    meta = backend.build_metadata(_meta(batch))
    outputs = []
    for _layer in range(2):  # two layers, one step
        q = torch.randn(batch.num_tokens, 4, 8, generator=rng)
        k = torch.randn(batch.num_tokens, 2, 8, generator=rng)
        v = torch.randn(batch.num_tokens, 2, 8, generator=rng)
        out = backend.forward(q, k, v, batch.k_cache, batch.v_cache, meta, 0.3, window)
        reshape_and_cache_ref(k, v, k_ref, v_ref, batch.slot_mapping)
        expected = paged_attention_ref(q, k_ref, v_ref, batch.query_start_loc, batch.seq_lens,
                                       batch.block_tables, 0.3, sliding_window=window)
        outputs.append((out, expected))
        torch.testing.assert_close(batch.k_cache, k_ref, rtol=0, atol=0)

    for out, expected in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert len(fake_flashinfer.plans) == 1, "planned once per step, shared by the layers"
    kind, kwargs = fake_flashinfer.plans[0]
    assert kind == ("decode" if meta.is_pure_decode else "prefill")
    assert kind == "decode" or kwargs["causal"] is True
    assert kwargs["window_left"] == (-1 if window is None else window - 1)


def test_a_new_step_plans_again(rng, paged_batch, fake_flashinfer):
    from shoal.runtime.attention.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend()
    for _ in range(2):
        batch = paged_batch(rng, [(5, 1), (9, 1)], 4, 2, 8)
        meta = backend.build_metadata(_meta(batch))
        q = torch.randn(2, 4, 8, generator=rng)
        kv = torch.randn(2, 2, 8, generator=rng)
        backend.forward(q, kv, kv, batch.k_cache, batch.v_cache, meta, 0.3)
    assert len(fake_flashinfer.plans) == 2


def test_forward_without_build_metadata_is_an_error(rng, paged_batch, fake_flashinfer):
    from shoal.runtime.attention.flashinfer_backend import FlashInferBackend

    batch = paged_batch(rng, [(5, 1)], 4, 2, 8)
    q = torch.randn(1, 4, 8, generator=rng)
    with pytest.raises(RuntimeError, match="build_metadata"):
        FlashInferBackend().forward(q, q[:, :2], q[:, :2], batch.k_cache, batch.v_cache, _meta(batch), 0.3)
