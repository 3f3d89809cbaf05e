"""The Worker's forward pass (paged KV, flat mixed batches) against HF transformers: through
the plain-torch path, and through the native CPU kernels (the ``cpu`` backend: decode and
prefill attention, RMSNorm + residual, SiLU-and-mul, rotary)."""

from __future__ import annotations

import pytest
import torch

ARCHS = ["llama", "qwen2", "qwen3"]


def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def assert_rel_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel <= tol, f"max relative difference {rel:.2e} > {tol:.0e}"


def random_prompts(lengths, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_length_prefill_then_decode_matches_hf(arch, backend, tiny_model_dirs, load_worker,
                                                     hf_model, planner_factory, new_request):
    model_dir = tiny_model_dirs[arch]
    worker = load_worker(model_dir, num_blocks=64, block_size=4, attention_backend=backend)
    layer = worker.runner.model.model.layers[0]
    assert (layer.mlp.act_fn.__module__ == "shoal.kernels.cpu_ops") == (backend == "cpu")
    hf = hf_model(model_dir)
    prompts = random_prompts([5, 11, 1, 8, 23], worker.model_config().vocab_size)
    planner = planner_factory(64, 4)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p)
    plan = planner.plan({f"r{i}": len(p) for i, p in enumerate(prompts)},
                        new=[new_request(f"r{i}", p, temperature=0.0)
                             for i, p in enumerate(prompts)])
    logits = worker.runner.forward(plan)
    assert logits.shape == (len(prompts), worker.model_config().vocab_size)
    for i, p in enumerate(prompts):
        assert_rel_close(logits[i], hf_last_logits(hf, p))
    # one decode step: each request appends a token
    extra = [[7 + i] for i in range(len(prompts))]
    plan = planner.plan({f"r{i}": extra[i] for i in range(len(prompts))})
    logits = worker.runner.forward(plan)
    for i, p in enumerate(prompts):
        assert_rel_close(logits[i], hf_last_logits(hf, p + extra[i]))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_shared_prefix_match_hf(arch, tiny_model_dirs, load_worker, hf_model,
                                                    planner_factory, new_request):
    model_dir = tiny_model_dirs[arch]
    worker = load_worker(model_dir, num_blocks=64, block_size=4)
    hf = hf_model(model_dir)
    vocab = worker.model_config().vocab_size
    a, b = random_prompts([18, 6], vocab, seed=1)
    planner = planner_factory(64, 4)
    planner.add("a", a)
    planner.add("b", b)
    # a's prompt in chunks of 7, 7, 4 while b prefills and then decodes beside it
    worker.runner.forward(planner.plan({"a": 7, "b": 6}, new=[new_request("a", a),
                                                               new_request("b", b)]))
    logits = worker.runner.forward(planner.plan({"a": 7, "b": [9]}, sample={"a": False}))
    assert logits.shape[0] == 1
    assert_rel_close(logits[0], hf_last_logits(hf, b + [9]))
    logits = worker.runner.forward(planner.plan({"a": 4, "b": [10]}))
    assert_rel_close(logits[0], hf_last_logits(hf, a))
    assert_rel_close(logits[1], hf_last_logits(hf, b + [9, 10]))
    # c shares a's first three full blocks (12 tokens) and computes only the rest
    c = a[:12] + random_prompts([5], vocab, seed=2)[0]
    planner.add("c", c, shared_from="a", shared_blocks=3)
    logits = worker.runner.forward(planner.plan({"c": 5}, new=[new_request("c", c)]))
    assert_rel_close(logits[0], hf_last_logits(hf, c))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_hf_generate(arch, tiny_model_dirs, load_worker, hf_model,
                                               planner_factory, new_request):
    model_dir = tiny_model_dirs[arch]
    worker = load_worker(model_dir, num_blocks=128, block_size=4)
    hf = hf_model(model_dir)
    prompts = random_prompts([3, 17, 9], worker.model_config().vocab_size, seed=3)
    steps = 12
    planner = planner_factory(128, 4)
    for i, p in enumerate(prompts):
        planner.add(f"r{i}", p)
    result = worker.execute(planner.plan(
        {f"r{i}": len(p) for i, p in enumerate(prompts)},
        new=[new_request(f"r{i}", p, temperature=0.0, ignore_eos=True)
             for i, p in enumerate(prompts)]))
    generated = [[t] for t in result.sampled_token_ids.tolist()]
    for _ in range(steps - 1):
        result = worker.execute(planner.plan({f"r{i}": [g[-1]] for i, g in enumerate(generated)}))
        for g, t in zip(generated, result.sampled_token_ids.tolist(), strict=True):
            g.append(t)
    for p, g in zip(prompts, generated, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert g == ref
