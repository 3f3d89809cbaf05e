"""KV-cache sizing arithmetic from a profiled maximum-size step."""

from __future__ import annotations

import pytest
from shoal.runtime.worker.memory_profile import GiB, StepProfile, kv_cache_budget


def _profile(**overrides) -> StepProfile:
    values = dict(total_bytes=80 * GiB, weights_bytes=16 * GiB,
                  activation_peak_bytes=2 * GiB, non_torch_bytes=GiB)
    values.update(overrides)
    return StepProfile(**values)


def test_kv_gets_what_utilization_leaves_after_weights_activations_and_overheads():
    budget = kv_cache_budget(_profile(), utilization=0.9, bytes_per_block=2 * 2**20, block_size=16)
    # 72 GiB usable - 16 - 2 - 1 = 53 GiB; 2 MiB blocks -> 53 * 512 blocks
    assert budget.kv_bytes == 53 * GiB
    assert budget.num_blocks == 53 * 512
    assert budget.num_tokens == 53 * 512 * 16


def test_graph_reserve_comes_out_of_the_kv_budget():
    without = kv_cache_budget(_profile(), 0.9, 2**20, 16)
    with_graphs = kv_cache_budget(_profile(), 0.9, 2**20, 16, graph_reserve_bytes=GiB)
    assert without.num_blocks - with_graphs.num_blocks == 1024


def test_the_log_line_shows_the_arithmetic():
    text = kv_cache_budget(_profile(), 0.9, 2**20, 16).describe()
    for part in ("80.00 GiB x 0.9", "weights 16.00 GiB", "activations 2.00 GiB",
                 "non-torch 1.00 GiB", "blocks", "tokens"):
        assert part in text


def test_no_room_is_an_error_that_says_what_to_change():
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        kv_cache_budget(_profile(weights_bytes=75 * GiB), 0.9, 2**20, 16)


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_utilization_outside_the_unit_interval_is_rejected(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_budget(_profile(), utilization, 2**20, 16)
