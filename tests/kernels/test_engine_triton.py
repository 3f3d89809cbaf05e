"""End to end: the model on the triton backend (interpreted on CPU) decodes greedily
exactly like the torch backend, through mixed steps, chunked prefill and a prefix hit.

Random-weight models can have near-tied logits where rounding differences legitimately
flip the argmax; a divergence is a failure unless the torch run's top-2 margin at that
position is a near-tie (then the rest of that request is no longer comparable).
"""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.worker.worker import Worker

NEAR_TIE = 1e-3
BLOCK_SIZE = 4


def _worker(model_dir, backend: str) -> Worker:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                          attention_backend=backend, num_kv_blocks=96, max_num_batched_tokens=16)
    worker = Worker(config)
    worker.load_model()
    worker.init_kv_cache(96)
    return worker


def _assert_same_greedy(expected, actual):
    for req, (tokens, margins) in expected.items():
        got = actual[req][0]
        for i, (want, have) in enumerate(zip(tokens, got, strict=True)):
            if want != have:
                assert margins[i] < NEAR_TIE, (
                    f"{req} diverged at token {i}: torch {want} (top-2 margin {margins[i]:.4f}), "
                    f"triton {have}")
                break


def test_triton_backend_is_greedy_identical_to_torch_on_a_tiny_qwen3(tiny_qwen3, continuous_batch):
    gen = torch.Generator().manual_seed(7)
    vocab = 1024
    base = torch.randint(3, vocab, (23,), generator=gen).tolist()
    prompts = {
        "a": base,  # 23 tokens: two chunks under a 16-token budget
        "b": torch.randint(3, vocab, (6,), generator=gen).tolist(),
        "c": base[:12] + torch.randint(3, vocab, (5,), generator=gen).tolist(),  # shares 3 blocks of a
        "d": torch.randint(3, vocab, (1,), generator=gen).tolist(),
    }
    shared = {"c": ("a", 3)}
    runs = {}
    for backend in ("torch", "triton"):
        worker = _worker(tiny_qwen3, backend)
        assert worker.runner.backend.name == backend
        runs[backend] = continuous_batch(worker, BLOCK_SIZE, token_budget=16, max_new=6).run(prompts, shared)

    _assert_same_greedy(runs["torch"], runs["triton"])
    assert all(len(tokens) == 6 for tokens, _ in runs["triton"].values())


def test_llm_with_the_triton_backend_matches_torch_through_the_real_scheduler(tiny_qwen3):
    """Scheduler-made steps: chunked prefill under a 16-token budget, decodes riding along,
    and a repeated prompt served from the prefix cache (its blocks shared, read-only)."""
    from shoal.runtime.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 1024, (13,), generator=gen).tolist()
    first = [prefix + torch.randint(3, 1024, (n,), generator=gen).tolist() for n in (9, 2, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(tiny_qwen3, attention_backend=backend, device="cpu", block_size=BLOCK_SIZE,
                  max_num_batched_tokens=16, num_kv_blocks=64)
        outputs = llm.generate(first, params) + llm.generate([first[0]], params)
        assert outputs[-1].num_cached_tokens >= 8, "the repeated prompt should hit the prefix cache"
        runs[backend] = {
            f"{i}": (o.outputs[0].token_ids,
                     [lp.top_logprobs[0] - lp.top_logprobs[1] for lp in o.outputs[0].logprobs])
            for i, o in enumerate(outputs)
        }

    _assert_same_greedy(runs["torch"], runs["triton"])


def test_the_models_fused_kernel_path_decodes_like_the_unfused_one(tiny_qwen3, continuous_batch):
    """On CUDA the model runs Qwen3's q/k norm + rotary, every RMSNorm and the SwiGLU
    activation as Triton kernels;
    here they are switched on by hand (interpreted) to prove the wiring: same greedy tokens
    and top-2 margins as the torch ops."""
    from dataclasses import replace

    from shoal.runtime.model.layers import RMSNorm
    from shoal.runtime.model.ops import Kernels

    gen = torch.Generator().manual_seed(5)
    prompts = {"a": torch.randint(3, 1024, (9,), generator=gen).tolist(),
               "b": torch.randint(3, 1024, (4,), generator=gen).tolist()}
    runs = {}
    for fused in (False, True):
        worker = _worker(tiny_qwen3, "torch")
        layers = worker.runner.model.model.layers
        assert all(layer.self_attn.fused_qk_norm_rotary is None for layer in layers)  # CPU default
        norms = [m for m in worker.runner.model.modules() if isinstance(m, RMSNorm)]
        assert len(norms) == 4 * len(layers) + 1
        assert worker.runner.model.kernels.choice.norm == "torch"
        if fused:  # what choose_kernels picks on CUDA with Triton
            choice = replace(worker.runner.model.kernels.choice, norm="triton",
                             silu_and_mul="triton", qk_norm_rotary="triton")
            kernels = Kernels(choice)
            for layer in layers:
                layer.self_attn.fused_qk_norm_rotary = kernels.qk_norm_rotary
                layer.mlp.act_fn = kernels.gated_activation("silu")
            for norm in norms:
                norm.kernels = kernels
        runs[fused] = continuous_batch(worker, BLOCK_SIZE, token_budget=16, max_new=4).run(prompts)

    for req in prompts:
        assert runs[True][req][0] == runs[False][req][0]
        torch.testing.assert_close(runs[True][req][1], runs[False][req][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_fused_position_wise_kernels_follow_the_attention_backend(tiny_qwen3, monkeypatch,
                                                                      backend):
    """choose_kernels asks backend_choice.fused_triton_ops (triton backend on CUDA); with its
    device test lifted (CPU here), the triton backend brings every fused kernel into the model
    and the torch backend none, so --attention-backend torch runs no Triton code."""
    import shoal.runtime.model.ops as ops
    from shoal.runtime.model.ops import choose_kernels

    for name in ("torch", "flashinfer"):
        choice = choose_kernels("cuda", torch.bfloat16, name, True, False)
        assert (choice.norm, choice.silu_and_mul, choice.qk_norm_rotary) == ("torch",) * 3
    choice = choose_kernels("cuda", torch.bfloat16, "triton", True, False)
    assert (choice.norm, choice.silu_and_mul, choice.qk_norm_rotary) == ("triton",) * 3

    monkeypatch.setattr(ops, "fused_triton_ops", lambda name, device: name == "triton")
    worker = _worker(tiny_qwen3, backend)
    model = worker.runner.model
    fused = backend == "triton"
    assert (model.kernels.choice.norm == "triton") == fused
    assert all((layer.self_attn.fused_qk_norm_rotary is not None) == fused
               for layer in model.model.layers)
