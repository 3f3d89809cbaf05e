"""Tensor parallelism needs one GPU per rank: fewer is refused before any rank starts, with
the counts in the message (ranks sharing a GPU would fail later inside NCCL, unclearly)."""

from __future__ import annotations

import pytest
from shoal.runtime.executor.preflight import check_gpus_for_ranks


@pytest.mark.parametrize("tp,device,visible", [
    (2, "cuda", 2), (8, "cuda", 8), (4, "cpu", 0), (1, "cuda", 1), (1, "cuda:3", 4),
])
def test_enough_gpus_or_no_gpus_needed_passes(tp, device, visible):
    check_gpus_for_ranks(tp, device, visible)


def test_fewer_gpus_than_ranks_is_refused_with_the_counts(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 needs 2 GPUs, 1 visible "
                                         r"\(CUDA_VISIBLE_DEVICES=0\)"):
        check_gpus_for_ranks(2, "cuda", 1)


def test_one_pinned_gpu_for_several_ranks_is_refused():
    with pytest.raises(ValueError, match="one GPU per rank"):
        check_gpus_for_ranks(2, "cuda:0", 8)


def test_the_executor_checks_before_starting_ranks(monkeypatch, tmp_path):
    import shoal.runtime.executor.multiproc as multiproc
    from shoal.runtime.config import EngineConfig

    started = []
    monkeypatch.setattr(multiproc, "load_model_config", lambda model, hf_overrides=None: None)
    monkeypatch.setattr(multiproc, "check_shardable", lambda config, world: None)
    monkeypatch.setattr(multiproc, "_resolved_device", lambda name: "cuda")
    monkeypatch.setattr(multiproc, "_visible_gpus", lambda: 1)
    monkeypatch.setattr(multiproc.MultiprocExecutor, "_spawn_ranks", lambda self: started.append(1))
    with pytest.raises(ValueError, match="needs 2 GPUs, 1 visible"):
        multiproc.MultiprocExecutor(EngineConfig(model=str(tmp_path), tensor_parallel_size=2))
    assert not started
