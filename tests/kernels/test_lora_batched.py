"""The multi-LoRA Triton kernels (under the interpreter) against the LoRA layer's torch path:
several slots of different ranks, adapter rows in random order with base rows among them,
split and fused targets over the segments of a packed qkv and gate/up projection."""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.model.lora import LoraLayer, LoraStepState

from shoal.kernels.lora_batched import BLOCK_M, group_rows_by_slot
from shoal.kernels.reference import lora_shrink_expand_ref

HIDDEN = 40
QKV = [(0, 32), (32, 16), (48, 16)]  # q, k, v
GATE_UP = [(0, 24), (24, 24)]


def random_target(rng, layer: LoraLayer, slot: int, blocks: tuple[int, ...], rank: int,
                  dtype: torch.dtype) -> None:
    out = sum(layer.segments[b][1] for b in blocks)
    lora_a = torch.randn(rank, layer.in_features, generator=rng) * layer.in_features ** -0.5
    scaled_b_t = torch.randn(rank, out, generator=rng) * rank ** -0.5
    layer.set_target(slot, blocks, lora_a.to(dtype), scaled_b_t.to(dtype))


def qkv_and_gate_up(rng, max_rank: int, dtype: torch.dtype) -> tuple[LoraStepState, list]:
    """Slot 0: q and v (own A each) at full rank; 1: a fused qkv_proj / gate_up_proj module;
    2: k only, rank 1 (an adapter that leaves most blocks empty); 3: nothing in these layers."""
    state = LoraStepState()
    qkv = LoraLayer(HIDDEN, QKV, 4, max_rank, state, dtype, "cpu")
    gate_up = LoraLayer(HIDDEN, GATE_UP, 4, max_rank, state, dtype, "cpu")
    low = max(1, max_rank // 2)
    random_target(rng, qkv, 0, (0,), max_rank, dtype)
    random_target(rng, qkv, 0, (2,), max_rank, dtype)
    random_target(rng, qkv, 1, (0, 1, 2), low, dtype)
    random_target(rng, qkv, 2, (1,), 1, dtype)
    random_target(rng, gate_up, 0, (1,), max_rank, dtype)
    random_target(rng, gate_up, 1, (0, 1), low, dtype)
    return state, [qkv, gate_up]


def mixed_slots(rng, counts: dict[int, int]) -> torch.Tensor:
    """Token slots in random order: ``counts[slot]`` rows of each (-1: base)."""
    slots = torch.cat([torch.full((n,), s, dtype=torch.int64) for s, n in counts.items()])
    return slots[torch.randperm(len(slots), generator=rng)]


def both_paths(layer: LoraLayer, x: torch.Tensor, base_out: torch.Tensor):
    by_torch, by_kernels = base_out.clone(), base_out.clone()
    layer.add_with_torch(x, by_torch)
    layer.add_with_kernels(x, by_kernels)
    return by_torch, by_kernels


@pytest.mark.parametrize("max_rank", [8, 16, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_kernels_equal_the_torch_path(rng, max_rank, dtype, tol):
    state, layers = qkv_and_gate_up(rng, max_rank, dtype)
    # slot 0 spans two row blocks; slot 3 is active but holds nothing here
    slots = mixed_slots(rng, {-1: 9, 0: BLOCK_M + 3, 1: 5, 2: 2, 3: 3})
    state.set_step(slots, 4)
    base = slots < 0
    x = torch.randn(len(slots), HIDDEN, generator=rng).to(dtype)
    for layer in layers:
        width = layer.segments[-1][0] + layer.segments[-1][1]
        base_out = torch.randn(len(slots), width, generator=rng).to(dtype)
        by_torch, by_kernels = both_paths(layer, x, base_out)
        torch.testing.assert_close(by_kernels.float(), by_torch.float(), rtol=tol, atol=tol)
        assert torch.equal(by_kernels[base], base_out[base])  # base rows never written
        moved = (by_kernels.float() - base_out.float()).abs().amax(dim=1)
        assert (moved[slots == 0] > 0.05).all() and (moved[slots == 1] > 0.05).all()
        assert torch.equal(by_kernels[slots == 3], base_out[slots == 3])  # empty slot
        expected = base_out.float().clone()
        for block, (offset, size) in enumerate(layer.segments):
            expected[:, offset:offset + size] = lora_shrink_expand_ref(
                x, layer.a[block], layer.b[block], base_out[:, offset:offset + size], max_rank,
                slots)
        torch.testing.assert_close(by_kernels.float(), expected, rtol=tol, atol=tol)


def test_a_step_of_one_slot_and_a_step_of_few_rows(rng):
    state, (qkv, _) = qkv_and_gate_up(rng, 16, torch.float32)
    for slots in (torch.ones(7, dtype=torch.int64), torch.tensor([-1, 2, -1])):
        state.set_step(slots, 3)
        x = torch.randn(len(slots), HIDDEN, generator=rng)
        by_torch, by_kernels = both_paths(qkv, x, torch.randn(len(slots), 64, generator=rng))
        torch.testing.assert_close(by_kernels, by_torch, rtol=1e-4, atol=1e-4)


def test_grouping_gives_each_block_one_slot_and_each_adapter_row_once(rng):
    slots = mixed_slots(rng, {-1: 5, 0: 20, 2: 1})
    sorted_ids, block_slot = group_rows_by_slot(slots, 3)
    blocks = sorted_ids.view(-1, BLOCK_M)
    seen = []
    for ids, slot in zip(blocks.tolist(), block_slot.tolist(), strict=True):
        rows = [i for i in ids if i < len(slots)]
        assert {int(slots[i]) for i in rows} == ({slot} if slot >= 0 else {-1})
        seen += rows if slot >= 0 else []
    assert sorted(seen) == sorted(torch.nonzero(slots >= 0).flatten().tolist())


def test_the_kernels_are_chosen_with_the_other_triton_ops():
    """One rule (ops.choose_kernels): Triton with the triton attention backend on CUDA, so
    --attention-backend torch runs no Triton code; the masked torch matmuls elsewhere."""
    from shoal.runtime.model.ops import choose_kernels

    def lora(device, attention):
        return choose_kernels(device, torch.bfloat16, attention, True, True).lora

    assert lora("cuda", "triton") == "triton"
    assert lora("cuda", "torch") == lora("cuda", "flashinfer") == lora("cpu", "cpu") == "masked"


def test_the_engine_on_the_kernels_equals_peft(tiny_llama, llama_adapters, hf_greedy):
    """The wiring, end to end: the engine's LoRA layers switched to the kernels (what the
    choice does on CUDA; interpreted here), the base and three adapters of ranks 8/4/16 mixed
    in the same steps give transformers + peft's greedy tokens."""
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore
    from shoal.runtime.lora_modules import LoraModule
    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.wire.messages import EngineCoreRequest

    modules = [LoraModule(name, str(path)) for name, path in llama_adapters.items()]
    core = EngineCore(EngineConfig.from_kwargs(
        str(tiny_llama), lora_modules=modules, dtype="float32", device="cpu",
        max_model_len=128, num_kv_blocks=64, enable_lora=True, max_loras=3, max_lora_rank=16))
    layers = core.executor.worker.lora.lora.layers
    assert not any(layer.kernels for layer in layers)  # CPU: the torch path by default
    for layer in layers:
        layer.kernels = True
    prompts = [[5, 77, 301, 12, 9], [400, 2, 31]]
    names: list[str | None] = [None, *llama_adapters]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        for name in names:
            core.add_request(EngineCoreRequest(request_id=f"{name}-{i}", prompt_token_ids=prompt,
                                               sampling_params=params, adapter_id=name))
    outputs: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert not core.take_failures()
    for i, prompt in enumerate(prompts):
        for name in names:
            reference = hf_greedy(tiny_llama, llama_adapters[name] if name else None)
            assert reference.agrees(prompt, outputs[f"{name}-{i}"]), (name, i)
