"""Qwen3-Next and Qwen3.5's text model (Gated DeltaNet linear attention with per-request
state, gated full attention over the paged KV cache; Qwen3-Next's MoE with a sigmoid-gated
shared expert) through the real engine: greedy output token for token equal to
transformers' ``Qwen3NextForCausalLM`` / ``Qwen3_5ForCausalLM`` (float32, CPU) with
requests of different lengths arriving together and staggered, prefill chunked small
(states carried across chunks), preemption forced by a tiny KV cache (the state restarts
from zero on recompute), and fewer state slots than requests (max_num_seqs)."""

from __future__ import annotations

import logging
import random

import pytest
from shoal.runtime.model.make_hybrid_model import HYBRID_ARCHS, cached_hybrid_model

from tests.engine.test_hf_equivalence import check, engine, random_prompt, run


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_everything_at_once_matches_hf(arch, hf_greedy, assert_matches_hf):
    model_dir = cached_hybrid_model(arch)
    rng = random.Random(7)
    arrivals = [(2 * i, f"r{i}", random_prompt(rng, rng.randint(1, 60)), rng.randint(8, 24))
                for i in range(6)]
    arrivals.append((0, "long", random_prompt(rng, 150), 12))  # past one 64-token scan block
    core = engine(model_dir, block_size=4, num_kv_blocks=48, max_num_batched_tokens=24,
                  max_model_len=176, max_num_seqs=4)
    outputs = run(core, arrivals)
    assert core.stats().num_preemptions > 0
    states = core.executor.worker.runner.states
    # every slot given back, but the last finisher's: its release rides the next plan's
    # finished_req_ids, as the worker's sampling state does
    assert states is not None and states.num_held == len(core.executor.worker.states) <= 1
    assert check(hf_greedy(model_dir), assert_matches_hf, arrivals, outputs) <= 1


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_decode_batches_of_mixed_lengths_match_hf(arch, hf_greedy, assert_matches_hf):
    """Everything prefilled in one step (one scan per row), then batched one-token updates."""
    model_dir = cached_hybrid_model(arch)
    rng = random.Random(8)
    arrivals = [(0, f"r{i}", random_prompt(rng, n), 20) for i, n in enumerate((1, 3, 9, 30, 70))]
    outputs = run(engine(model_dir, block_size=8, max_model_len=128), arrivals)
    assert check(hf_greedy(model_dir), assert_matches_hf, arrivals, outputs) <= 1


def test_startup_reports_state_bytes_and_turns_prefix_caching_off(caplog):
    from shoal.runtime.model.config import load_model_config

    model_dir = cached_hybrid_model()
    with caplog.at_level(logging.INFO):
        core = engine(model_dir, block_size=4, num_kv_blocks=16, max_model_len=64,
                      max_num_seqs=3)
    mc = load_model_config(model_dir)
    lin = mc.linear_attn
    assert lin is not None and lin.num_linear_layers == 3 and mc.num_attention_layers == 1
    # per request, per linear layer: the conv window of q, k, v and the float32 state
    conv = (2 * 2 * 16 + 4 * 16) * (4 - 1) * 4
    recurrent = 4 * 16 * 16 * 4
    assert core.executor.state_bytes_per_request() == 3 * (conv + recurrent)
    # per token: K and V of the one full-attention layer only
    assert core.executor.kv_bytes_per_block() == 4 * 2 * 1 * 2 * 32 * 4
    assert f"3 slots (max_num_seqs) of {3 * (conv + recurrent)} bytes per request" in caplog.text
    assert "prefix caching disabled for Qwen3NextForCausalLM" in caplog.text
    assert not core.scheduler.kv.enable_prefix_caching


def test_tensor_parallelism_splits_whole_key_heads_or_is_refused_naming_them():
    from shoal.runtime.distributed.shardability import shard_problems
    from shoal.runtime.model.config import load_model_config

    mc = load_model_config(cached_hybrid_model())  # 2 key heads, 4 value heads
    assert shard_problems(mc, 1) == [] and shard_problems(mc, 2) == []
    assert any("2 linear-attention key heads (linear_num_key_heads) do not divide across 4"
               in p for p in shard_problems(mc, 4))


def test_lora_and_kv_transfer_are_refused_naming_the_linear_layers():
    from shoal.runtime.kv_transfer.params import KVTransferConfig

    model_dir = cached_hybrid_model()
    with pytest.raises(ValueError, match="LoRA adapters on a hybrid model"):
        engine(model_dir, max_model_len=64, num_kv_blocks=16, enable_lora=True)
    with pytest.raises(ValueError, match="linear-attention state outside the KV blocks"):
        engine(model_dir, max_model_len=64, num_kv_blocks=16,
               kv_transfer_config=KVTransferConfig(kv_connector="TcpConnector",
                                                   kv_role="kv_producer"))
