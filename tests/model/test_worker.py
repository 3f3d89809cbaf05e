"""Worker lifecycle: setup order, per-request state, results, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.worker.worker import Worker, resolve_dtype


def test_kv_sizing_follows_the_model_config(tiny_qwen3, load_worker):
    worker = load_worker(tiny_qwen3, num_blocks=10, block_size=8)
    mc = worker.model_config()
    assert worker.kv_bytes_per_block() == mc.kv_bytes_per_token(torch.float32) * 8
    assert worker.kv_bytes_per_block() == 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * 8
    k, v = worker.runner.kv_caches[0]
    assert k.shape == v.shape == (10, 8, mc.num_kv_heads, mc.head_dim)
    assert len(worker.runner.kv_caches) == mc.num_layers
    # TP: KV heads split, or replicated when fewer than ranks
    assert mc.kv_bytes_per_token(torch.float32, tp_size=2) * 2 == mc.kv_bytes_per_token(
        torch.float32)
    assert mc.kv_bytes_per_token(torch.float32, tp_size=4) == mc.kv_bytes_per_token(
        torch.float32, tp_size=2)


def test_a_cpu_kv_cache_is_zero_and_takes_memory_only_where_written(tiny_qwen3, load_worker):
    """The cache's pages are zeroed by the kernel on first touch (``model_runner.zeroed``):
    a large cache costs no resident memory (nor the CPU time of writing it) until blocks
    land on it, and reads as zeros like ``torch.zeros``."""
    import psutil

    worker = load_worker(tiny_qwen3, num_blocks=8)
    per_block = worker.kv_bytes_per_block()
    blocks = (1 << 30) // per_block  # a 1 GiB cache
    process = psutil.Process()
    before = process.memory_info().rss
    worker.init_kv_cache(blocks)
    grown = process.memory_info().rss - before
    assert grown < (1 << 30) // 8, f"allocating a 1 GiB cache made {grown >> 20} MiB resident"
    k, v = worker.runner.kv_caches[0]
    assert k.shape[0] == blocks and k.device.type == "cpu" and k.is_contiguous()
    assert k.data_ptr() % 64 == 0 and v.data_ptr() % 64 == 0
    for tensor in (k, v):
        assert not tensor[[0, blocks // 2, blocks - 1]].any()
    k[blocks // 2] = 1.0  # writable, and only where written
    assert k[blocks // 2].all() and not k[blocks // 2 + 1].any() and not v[blocks // 2].any()


def test_warmup_runs_a_full_size_step_and_leaves_no_state(tiny_llama, load_worker,
                                                          monkeypatch):
    from shoal.runtime.worker import worker as worker_module

    worker = load_worker(tiny_llama, num_blocks=16, block_size=16, max_num_batched_tokens=256)
    monkeypatch.setattr(worker_module, "CPU_WARMUP_SEQ_TOKENS", 64)  # split as a 2048 step is
    plans = []
    real_execute = worker.execute
    monkeypatch.setattr(worker, "execute", lambda plan: plans.append(plan) or real_execute(plan))
    worker.warmup()
    # every token of the largest step, in sequences of at most 64 on a CPU (dummy_step.py)
    assert [(p.num_tokens, p.seq_lens.tolist()) for p in plans] == [(256, [64] * 4)]
    assert worker.states == {}
    # the grammar compiler too: the engine reports ready only after warm-up, and built later
    # it would hold the GIL against the replica's first steps
    assert worker.grammars().prepared


def test_request_state_lives_from_new_requests_to_finished(tiny_qwen2, load_worker,
                                                           planner_factory, new_request):
    worker = load_worker(tiny_qwen2, num_blocks=32, block_size=4)
    planner = planner_factory(32, 4)
    planner.add("a", [5, 6, 7, 8, 9])
    planner.add("b", [10, 11])
    # a's prompt is chunked: no sample this step, but its state exists already
    result = worker.execute(planner.plan({"a": 3, "b": 2}, new=[new_request("a", [5, 6, 7, 8, 9]),
                                                                new_request("b", [10, 11])]))
    assert result.req_ids == ["b"] and result.sampled_token_ids.shape == (1,)
    assert set(worker.states) == {"a", "b"}
    assert worker.states["b"].output_token_ids == result.sampled_token_ids.tolist()
    plan = planner.plan({"a": 2, "b": [int(result.sampled_token_ids[0])]})
    plan.finished_req_ids = []
    result = worker.execute(plan)
    assert result.req_ids == ["a", "b"]
    plan = planner.plan({"a": [int(result.sampled_token_ids[0])]})
    plan.finished_req_ids = ["b"]
    worker.execute(plan)
    assert set(worker.states) == {"a"}


def test_a_request_never_announced_is_a_clear_error(tiny_qwen2, load_worker, planner_factory):
    worker = load_worker(tiny_qwen2, num_blocks=8, block_size=4)
    planner = planner_factory(8, 4)
    planner.add("ghost", [3, 4])
    with pytest.raises(RuntimeError, match="'ghost' was never sent"):
        worker.execute(planner.plan({"ghost": 2}))


def test_logprobs_and_top_alternatives_come_back_in_the_result(tiny_llama, load_worker,
                                                               planner_factory, new_request):
    worker = load_worker(tiny_llama, num_blocks=16, block_size=4)
    planner = planner_factory(16, 4)
    planner.add("x", [3, 4, 5])
    planner.add("y", [6, 7])
    result = worker.execute(planner.plan(
        {"x": 3, "y": 2}, new=[new_request("x", [3, 4, 5], temperature=0.0, logprobs=3),
                               new_request("y", [6, 7], temperature=0.8, seed=1)]))
    assert result.logprobs.shape == (2,) and result.top_token_ids.shape == (2, 3)
    assert result.top_logprobs.dtype == np.float32
    # greedy: the sampled token is the most likely one and its logprob is the top logprob
    assert result.sampled_token_ids[0] == result.top_token_ids[0, 0]
    assert result.logprobs[0] == pytest.approx(result.top_logprobs[0, 0])
    assert (np.diff(result.top_logprobs[0]) <= 0).all()


def test_min_tokens_keeps_the_model_eos_out(tiny_llama, load_worker, planner_factory,
                                            new_request, monkeypatch):
    worker = load_worker(tiny_llama, num_blocks=16, block_size=4)
    eos = worker.model_config().eos_token_ids
    model = worker.runner.model
    plain_logits = model.compute_logits

    def eos_favoured(hidden):  # make EOS the model's clear favourite
        logits = plain_logits(hidden)
        logits[:, eos[0]] += 1000.0
        return logits

    monkeypatch.setattr(model, "compute_logits", eos_favoured)
    planner = planner_factory(16, 4)
    planner.add("m", [3, 4, 5])
    planner.add("n", [3, 4, 5])
    result = worker.execute(planner.plan(
        {"m": 3, "n": 3}, new=[new_request("m", [3, 4, 5], temperature=0.0, min_tokens=2),
                               new_request("n", [3, 4, 5], temperature=0.0)]))
    m_token, n_token = result.sampled_token_ids.tolist()
    assert n_token == eos[0] and m_token not in eos


def test_dtype_and_device_resolution(tiny_llama, tmp_path):
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cpu, torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("float32", cpu, torch.bfloat16) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", cpu)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        Worker(EngineConfig(model="x", device="tpu"))
    # --dtype auto on CPU follows config.json: a bfloat16 checkpoint serves in bfloat16
    assert Worker(EngineConfig(model=str(tiny_llama), device="cpu")).dtype == torch.float32
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_llama, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(config))
    assert Worker(EngineConfig(model=str(bf16), device="cpu")).dtype == torch.bfloat16
    assert Worker(EngineConfig(model=str(bf16), device="cpu",
                               dtype="float32")).dtype == torch.float32


def test_steps_before_setup_are_refused(tiny_llama, engine_config):
    worker = Worker(engine_config(tiny_llama))
    with pytest.raises(RuntimeError, match="load_model must run first"):
        worker.kv_bytes_per_block()
    worker.load_model()
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        worker.init_kv_cache(0)


def test_missing_model_directory_names_the_path(tmp_path, engine_config):
    worker = Worker(engine_config(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        worker.load_model()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_cpu_linear_layers_hold_one_repacked_weight_with_the_same_results(
        arch, backend, tiny_model_dirs, load_worker, monkeypatch):
    """The torch backend: oneDNN-packed weights. The native ``cpu`` backend where the panel
    kernel is faster (``panel_linears_here``, forced here so any CPU runs the check): every
    layer and the LM head on panels, a tied head's embedding reading its rows there too."""
    from shoal.runtime.model import ops
    from shoal.runtime.model.loader import load_weights

    from shoal.kernels.native_cpu import unavailable_reason

    if backend == "cpu" and unavailable_reason() is not None:
        pytest.skip(f"native library: {unavailable_reason()}")
    monkeypatch.setattr(ops, "panel_linears_here", lambda: True)
    worker = load_worker(tiny_model_dirs[arch], attention_backend=backend)
    model = worker.runner.model
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    layers = model.config.num_layers
    packed = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    panels = [m for m in model.modules() if getattr(m, "panels", None) is not None]
    if backend == "torch":
        assert not panels and len(packed) == 4 * layers + 1  # qkv, o, gate_up, down, head
    else:
        assert not packed and len(panels) == 4 * layers + 1 + tied  # a tied table shares one
    for module in packed:
        assert module.packed.is_mkldnn, type(module).__name__
    for module in packed + panels:
        # the dense copy is dropped (its shape kept), but oneDNN's tied head is the table
        assert module.weight.is_meta == (not (module is model.lm_head and tied and packed))
    embed = model.model.embed_tokens
    assert embed.weight.is_meta == (tied and backend == "cpu")  # else lookups read its rows
    if tied and backend == "cpu":
        assert embed.panels is model.lm_head.panels and embed.weight is model.lm_head.weight

    # The same layers with the checkpoint's dense weights through MKL's F.linear: the sums
    # round differently, so equal to float32 tolerance, not bit for bit.
    reference = type(model)(model.config, model.model.layers[0].self_attn.qkv_proj.parallel,
                            model.model.layers[0].self_attn.backend, 64, torch.float32, "cpu")
    load_weights(reference, tiny_model_dirs[arch])
    x = torch.randn(5, model.config.hidden_size)
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours, dense = model.model.layers[0].get_submodule(name), \
            reference.model.layers[0].get_submodule(name)
        rows = torch.randn(5, dense.weight.shape[1])
        torch.testing.assert_close(ours(rows), dense(rows), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.compute_logits(x), reference.compute_logits(x),
                               rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[0, 1, 17], [model.config.vocab_size - 1, 16, 15]])
    assert torch.equal(embed(ids), reference.model.embed_tokens(ids))
