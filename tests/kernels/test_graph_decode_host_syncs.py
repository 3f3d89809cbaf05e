"""The decode step a CUDA graph captures makes no host sync: run here on CPU (kernels under
the interpreter) with every Triton path the GPU takes switched on (fused position-wise ops,
split-K decode), under a guard that raises on .item/.tolist/.cpu/.numpy/bool/int/float of a
tensor and on torch.cuda.synchronize from any code but triton's interpreter (which copies
tensors to numpy to run a kernel; on a GPU that copy does not exist)."""

from __future__ import annotations

import contextlib
import sys

import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.worker.cuda_graphs import DecodeGraphRunner
from shoal.runtime.worker.worker import Worker

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_syncs(monkeypatch):
    def guarded(name, original):
        def call(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith("triton"):
                raise HostSync(f"Tensor.{name} called from {caller}")
            return original(self, *args, **kwargs)
        return call

    with monkeypatch.context() as patch:
        for name in SYNCS:
            patch.setattr(torch.Tensor, name, guarded(name, getattr(torch.Tensor, name)))

        def synchronize(*args, **kwargs):
            raise HostSync("torch.cuda.synchronize")
        patch.setattr(torch.cuda, "synchronize", synchronize)
        yield


def test_the_guard_catches_a_sync(monkeypatch):
    with no_host_syncs(monkeypatch):
        try:
            torch.ones(2).sum().item()
        except HostSync:
            pass
        else:
            raise AssertionError("the guard let .item() through")
    assert torch.ones(2).sum().item() == 2.0  # restored


def test_graph_captured_decode_forward_makes_no_host_sync(tiny_qwen3, monkeypatch):
    import shoal.runtime.model.ops as ops

    import shoal.kernels.paged_attention as pa

    # what the GPU runs: Triton norms/activation/qk-norm+rotary, and the split-K decode
    monkeypatch.setattr(ops, "fused_triton_ops", lambda backend, device: backend == "triton")
    monkeypatch.setattr(pa, "_sm_count", lambda device: 132)
    monkeypatch.setattr(pa, "MIN_SPLIT_KEYS", 32)
    block_size, max_model_len = 16, 512
    worker = Worker(EngineConfig(model=str(tiny_qwen3), device="cpu", dtype="float32",
                                 block_size=block_size, attention_backend="triton",
                                 num_kv_blocks=64, max_num_batched_tokens=16,
                                 max_model_len=max_model_len))
    worker.load_model()
    worker.init_kv_cache(64)
    runner = worker.runner
    assert runner.model.kernels.choice.norm == "triton"

    graphs = DecodeGraphRunner([4], max_model_len // block_size, block_size, max_model_len,
                               torch.device("cpu"))
    seq_lens = torch.tensor([5, 300, 40], dtype=torch.int32)
    tables = torch.zeros(3, 19, dtype=torch.int32)
    tables[0, :1] = torch.tensor([1])
    tables[1, :19] = torch.arange(2, 21)
    tables[2, :3] = torch.arange(21, 24)
    slots = (tables[torch.arange(3), (seq_lens - 1) // block_size].long() * block_size
             + (seq_lens - 1) % block_size)
    size = graphs.stage(torch.tensor([7, 8, 9]), (seq_lens - 1).long(), seq_lens, tables, slots)
    meta = runner.backend.build_metadata(graphs.metadata(size))
    assert pa.choose_splits(meta.max_query_len, size, 2, pa._sm_count(None)) > 1

    def step():  # what capture_decode_graphs captures
        with torch.inference_mode():
            return runner.model(graphs.input_ids[:size], graphs.positions[:size],
                                runner.kv_caches, meta)

    with no_host_syncs(monkeypatch):
        hidden = step()
    assert hidden.shape[0] == size and hidden.isfinite().all()
