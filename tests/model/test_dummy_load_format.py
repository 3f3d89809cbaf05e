"""--load-format dummy: a model from config.json alone (no checkpoint), random weights made
in memory (vLLM's uniform [-1e-3, 1e-3]), so 8B/70B shapes can be measured without weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.model.loader import DUMMY_RANGE
from shoal.runtime.worker.worker import Worker


def _dummy_worker(model_dir, seed=0, fmt="dummy") -> Worker:
    worker = Worker(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=8,
                                 load_format=fmt, seed=seed, attention_backend="torch"))
    worker.load_model()
    return worker


def _params(worker: Worker) -> dict[str, torch.Tensor]:
    """(CPU float32 linears keep only their oneDNN-packed copy; the dense one is on meta.)"""
    return {n: p.detach().clone() for n, p in worker.runner.model.named_parameters()
            if p.device.type != "meta"}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_config_json_alone_builds_a_model_with_small_random_weights(tiny_model_dirs, tmp_path,
                                                                     arch):
    only_config = tmp_path / arch
    only_config.mkdir()
    shutil.copy(tiny_model_dirs[arch] / "config.json", only_config / "config.json")

    params = _params(_dummy_worker(only_config))
    for name, value in params.items():
        assert value.abs().max() <= DUMMY_RANGE and value.abs().max() > 0, name
        assert value.std() > DUMMY_RANGE / 4, f"{name} is not spread over the range"
    again = _params(_dummy_worker(only_config))
    other = _params(_dummy_worker(only_config, seed=1))
    assert all(torch.equal(params[n], again[n]) for n in params), "same seed, same weights"
    assert not all(torch.equal(params[n], other[n]) for n in params)


def test_the_checkpoint_is_still_read_by_default(tiny_qwen3, tmp_path):
    only_config = tmp_path / "m"
    only_config.mkdir()
    shutil.copy(tiny_qwen3 / "config.json", only_config / "config.json")
    with pytest.raises(Exception, match="safetensors|checkpoint|weights"):
        _dummy_worker(only_config, fmt="auto")
    with pytest.raises(ValueError, match="unknown load format"):
        _dummy_worker(tiny_qwen3, fmt="npz")
