"""A model that cannot be split over the asked rank count is refused before any rank
starts, with every dimension at fault named."""

from __future__ import annotations

import psutil
import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.distributed.shardability import shard_problems
from shoal.runtime.executor.factory import create_executor
from shoal.runtime.model.config import ModelConfig


def model(heads: int, kv_heads: int, intermediate: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=1001, hidden_size=64,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=16,
                       intermediate_size=intermediate, max_position_embeddings=128,
                       eos_token_ids=[0])


@pytest.mark.parametrize("heads, kv, inter, world", [
    (4, 1, 128, 2),  # one KV head: replicated on both ranks
    (4, 2, 128, 4),  # two KV heads over four ranks: each replicated twice
    (8, 4, 128, 4),  # everything splits
    (4, 2, 128, 1),
])
def test_shapes_that_split(heads, kv, inter, world):
    assert shard_problems(model(heads, kv, inter), world) == []


def test_every_dimension_that_does_not_split_is_named():
    problems = shard_problems(model(heads=4, kv_heads=2, intermediate=100), 3)
    text = "; ".join(problems)
    assert "4 attention heads" in text
    assert "3 ranks cannot replicate 2 KV heads" in text
    assert "intermediate size 100" in text
    assert shard_problems(model(8, 6, 128), 4) == ["6 KV heads do not divide across 4 ranks"]
    assert "at least 1" in shard_problems(model(4, 2, 128), 0)[0]


def test_the_executor_refuses_before_starting_any_rank(tiny_llama):
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="cannot split LlamaForCausalLM over "
                                         "tensor_parallel_size=3: 4 attention heads"):
        create_executor(EngineConfig(model=str(tiny_llama), tensor_parallel_size=3))
    started = {p.pid for p in psutil.Process().children(recursive=True)} - children_before
    assert started == set()  # no rank process was started
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        create_executor(EngineConfig(model=str(tiny_llama), tensor_parallel_size=0))
