"""The CPU benchmarks' floor (bench/floor.py): what a workload makes the model do, priced at
given rates. The rates are set here, not measured, so the arithmetic is what is checked."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from shoal.runtime.model.config import ModelConfig

FLOOR = Path(__file__).resolve().parents[2] / "bench" / "floor.py"


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("bench_floor", FLOOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# one layer, hidden 4, 2 heads of 2 (1 kv head), MLP 8, vocab 10
MC = ModelConfig("LlamaForCausalLM", vocab_size=10, hidden_size=4, num_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=2, intermediate_size=8)


def test_a_request_feeds_its_prompt_and_all_but_its_last_output_token(floor):
    work = floor.Work.of_requests([3], [2])
    assert work.tokens == 4  # 3 prompt + output token 1 fed back; token 2 is never fed
    assert work.sampled == 2
    assert work.prompt_pairs == 6  # causal: 1 + 2 + 3
    assert work.decode_contexts == 4  # output token 1 attends over the prompt and itself


def test_requests_add_up(floor):
    one, two = floor.Work.of_requests([3], [2]), floor.Work.of_requests([5], [4])
    both = floor.Work.of_requests([3, 5], [2, 4])
    assert both.tokens == one.tokens + two.tokens
    assert both.decode_contexts == one.decode_contexts + two.decode_contexts == 4 + 6 + 7 + 8


def test_matmul_flops_count_linear_layers_lm_head_and_prompt_attention(floor):
    # per token: qkv 4x(4+2+2) + o 4x4 + gate_up 4x16 + down 8x4 = 32 + 16 + 64 + 32 = 144 MACs
    work = floor.Work(tokens=1)
    assert work.matmul_flops(MC) == 2 * 144
    assert floor.Work(sampled=1).matmul_flops(MC) == 2 * 4 * 10
    assert floor.Work(prompt_pairs=1).matmul_flops(MC) == 4 * 2 * 2  # QK^T and PV, 2 heads


def test_decode_reads_k_and_v_of_every_layer_for_each_context_token(floor):
    assert floor.Work(decode_contexts=3).kv_bytes(MC) == 3 * 2 * 1 * 2 * 4  # fp32


def test_the_floor_is_matmul_time_plus_kv_read_time(floor):
    rates = floor.Floor(MC, {128: 1e3, 512: 2e3}, read_bytes_per_s=48.0)
    work = floor.Work(tokens=10, decode_contexts=3)  # 2880 FLOPs, 48 bytes
    assert rates.split(work) == pytest.approx((2880 / 2e3, 1.0))  # the best matmul rate
    assert rates.seconds(work) == pytest.approx(1.44 + 1.0)


def test_a_workload_reads_every_weight_once_per_pass_of_its_longest_output(floor):
    work = floor.Work.of_requests([3, 5], [2, 4])
    assert work.passes == 4
    # per pass: the layer's 144 weights + the LM head's 4 x 10, 2 bytes each in bfloat16
    assert work.weight_bytes(MC, dtype_bytes=2) == 4 * (144 + 40) * 2


def test_weight_reads_bound_the_floor_where_they_outlast_the_matmuls(floor):
    rates = floor.Floor(MC, {128: 1e3}, read_bytes_per_s=184.0, dtype_bytes=2)
    # 2 passes read 2 x 184 x 2 bytes (4 s) against 2 x 144 FLOPs (0.29 s)
    assert rates.split(floor.Work(tokens=1, passes=2))[0] == pytest.approx(4.0)
    # K/V at the dtype's size: 3 contexts x 2 (K and V) x 1 layer x 1 head x 2 dims x 2 bytes
    assert rates.split(floor.Work(decode_contexts=3))[1] == pytest.approx(24 / 184.0)
