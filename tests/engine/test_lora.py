"""Multi-LoRA in the engine: PEFT adapters made by peft on a tiny base, served mixed with the
base in the same steps, equal to transformers + peft greedy; more adapters than slots (they
wait, never fail; the invariant checker asserts no step runs more than --max-loras of them);
more than --max-cpu-loras (re-read from disk); bad adapters refused naming why, the engine
still serving; the adapter in the prefix-cache identity and in KV events; unloading waits
for the requests that hold the adapter."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.kv.events import BlockStored
from shoal.runtime.lora_modules import LoraModule
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest


def engine(model_dir, adapters: dict, **kwargs) -> EngineCore:
    kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "num_kv_blocks": 128,
              "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, **kwargs}
    modules = [LoraModule(name, str(path)) for name, path in adapters.items()]
    return EngineCore(EngineConfig.from_kwargs(str(model_dir), lora_modules=modules, **kwargs))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(core: EngineCore, requests: list[tuple[str, list[int], str | None, int]]
        ) -> dict[str, list[int]]:
    """requests: (req_id, prompt, adapter or None, max_tokens), all added at once."""
    for req_id, prompt, adapter, max_tokens in requests:
        core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                           sampling_params=greedy(max_tokens),
                                           adapter_id=adapter))
    outputs: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert not core.take_failures()
        core.check_invariants()  # includes: at most max_loras adapters running
        steps += 1
        assert steps < 2000
    return outputs


def test_base_and_three_adapters_mixed_equal_peft(tiny_llama, llama_adapters, hf_greedy):
    """Three adapters and the base, four prompts each, all arriving together: 2 slots, so
    adapters wait for one; 2 parsed in memory, so one is read again from disk."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 17, 33, 50)]
    names: list[str | None] = [None, *llama_adapters]
    requests = [(f"{name or 'base'}-{i}", prompt, name, 8)
                for i, prompt in enumerate(prompts) for name in names]
    core = engine(tiny_llama, llama_adapters, max_cpu_loras=2)
    outputs = run(core, requests)
    lora = core.executor.worker.lora
    assert lora.slot_loads >= 3  # every adapter went through a slot
    for req_id, prompt, name, _ in requests:
        reference = hf_greedy(tiny_llama, llama_adapters[name] if name else None)
        assert reference.agrees(prompt, outputs[req_id]), (req_id, outputs[req_id],
                                                            reference.generate(prompt, 8))
    for name in llama_adapters:  # each adapter really changes what the model says
        moved = sum(outputs[f"{name}-{i}"] != outputs[f"base-{i}"] for i in range(4))
        assert moved >= 2, name


def test_fused_qkv_adapter_equals_the_split_one(tiny_llama, llama_adapters, tmp_path):
    """Phi-3-style fused ``qkv_proj`` LoRA: the split q/v adapter rewritten as one fused
    module (A stacked, B block-diagonal, alpha kept per rank) gives the same tokens."""
    import torch
    from safetensors.torch import load_file, save_file

    split = llama_adapters["qv8"]
    config = json.loads((split / "adapter_config.json").read_text())
    tensors = load_file(str(split / "adapter_model.safetensors"))
    q_out, kv_out = 64, 16  # tiny llama: 4 heads x 16, one KV head
    fused = {}
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}.self_attn"
        a_q, b_q = tensors[f"{prefix}.q_proj.lora_A.weight"], tensors[f"{prefix}.q_proj.lora_B.weight"]
        a_v, b_v = tensors[f"{prefix}.v_proj.lora_A.weight"], tensors[f"{prefix}.v_proj.lora_B.weight"]
        rank = a_q.shape[0]
        b = torch.zeros(q_out + 2 * kv_out, 2 * rank)
        b[:q_out, :rank] = b_q
        b[q_out + kv_out:, rank:] = b_v
        fused[f"{prefix}.qkv_proj.lora_A.weight"] = torch.cat([a_q, a_v]).contiguous()
        fused[f"{prefix}.qkv_proj.lora_B.weight"] = b
    # scale alpha / (2r) on the fused module equals alpha / r on the split ones
    config.update(r=16, lora_alpha=2 * config["lora_alpha"], target_modules=["qkv_proj"])
    out = tmp_path / "fused"
    out.mkdir()
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(fused, str(out / "adapter_model.safetensors"))
    prompt = [5, 9, 200, 31, 77, 12]
    core = engine(tiny_llama, {"split": split, "fused": out})
    got = run(core, [("s", prompt, "split", 8), ("f", prompt, "fused", 8)])
    assert got["s"] == got["f"]


def _copy(adapter, tmp_path, name):
    target = tmp_path / name
    shutil.copytree(adapter, target)
    return target


def test_bad_adapters_are_refused_naming_why_and_the_engine_keeps_serving(
        tiny_llama, tiny_qwen3, llama_adapters, make_lora_adapter, tmp_path):
    core = engine(tiny_llama, {"qv8": llama_adapters["qv8"]}, max_lora_rank=8)
    missing = _copy(llama_adapters["all4"], tmp_path, "missing")
    (missing / "adapter_model.safetensors").unlink()
    other_base = make_lora_adapter(tiny_qwen3, "qwen", 4, 8, ["q_proj"], seed=4)
    lm_head = make_lora_adapter(tiny_llama, "head", 4, 8, ["lm_head"], seed=5)
    cases = {
        "rank": (llama_adapters["mlp16"], "rank 16, above --max-lora-rank 8"),
        "missing": (missing, "has no adapter_model.safetensors"),
        "nowhere": (tmp_path / "nowhere", "is not a directory"),
        "shape": (other_base, "do not match the base model's q_proj"),
        "target": (lm_head, "unknown target module(s) lm_head"),
    }
    for name, (path, why) in cases.items():
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            core.add_lora(name, str(path))
        assert not core.adapters.serves(name)
    with pytest.raises(ValueError, match="already been loaded"):
        core.add_lora("qv8", str(llama_adapters["qv8"]))
    core.add_lora("all4", str(llama_adapters["all4"]))  # a good one still loads
    outputs = run(core, [("a", [4, 5, 6], "all4", 4), ("b", [4, 5, 6], None, 4)])
    assert len(outputs["a"]) == len(outputs["b"]) == 4


def test_adapter_is_part_of_prefix_cache_identity_and_kv_events(tiny_llama, llama_adapters):
    core = engine(tiny_llama, llama_adapters)
    core.scheduler.kv.pool.record_events = True
    prompt = list(range(10, 10 + 40))  # two full blocks of 16
    run(core, [("first", prompt, "qv8", 2)])
    stored = [e for e in core.drain_kv_events() if isinstance(e, BlockStored)]
    assert stored and all(e.lora_name == "qv8" for e in stored)
    cached = {}
    for req_id, adapter in (("same", "qv8"), ("other", "all4"), ("base", None)):
        core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                           sampling_params=greedy(2), adapter_id=adapter))
        while core.has_unfinished_requests():
            for out in core.step():
                if out.request_id == req_id and len(out.new_token_ids) and req_id not in cached:
                    cached[req_id] = out.num_cached_tokens
    assert cached == {"same": 32, "other": 0, "base": 0}
    stored = [e for e in core.drain_kv_events() if isinstance(e, BlockStored)]
    assert {e.lora_name for e in stored} == {"all4", None}


def test_unloading_waits_for_the_requests_holding_the_adapter(tiny_llama, llama_adapters):
    core = engine(tiny_llama, {"qv8": llama_adapters["qv8"]})
    core.add_request(EngineCoreRequest(request_id="r", prompt_token_ids=[3, 4, 5],
                                       sampling_params=greedy(6), adapter_id="qv8"))
    outputs = [t for out in core.step() for t in out.new_token_ids]
    core.remove_lora("qv8")
    with pytest.raises(ValueError, match="does not exist"):  # no new request for it
        core.add_request(EngineCoreRequest(request_id="s", prompt_token_ids=[3],
                                           sampling_params=greedy(1), adapter_id="qv8"))
    assert "qv8" in core.executor.worker.lora.paths  # the running request still holds it
    while core.has_unfinished_requests():
        outputs += [t for out in core.step() for t in out.new_token_ids]
    assert len(outputs) == 6
    assert "qv8" not in core.executor.worker.lora.paths
    with pytest.raises(KeyError):
        core.remove_lora("qv8")
