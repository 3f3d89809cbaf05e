"""Qwen3.5's hybrid on the triton backend (interpreted on CPU) with the model's kernels
chosen as on CUDA (``ops.choose_kernels`` with its device test lifted): the Gated DeltaNet
layers run ``shoal/kernels/gated_delta_rule.py`` (chosen by ``ops``, not by the layer) and
decode
greedily like the torch path through the real scheduler: prompts of different lengths,
prefill chunked under a 16-token budget (states carried across chunks), decodes riding
along with prefill rows, then pure decode steps."""

from __future__ import annotations

import torch
from shoal.runtime.model.make_hybrid_model import cached_hybrid_model

from tests.kernels.test_engine_triton import _assert_same_greedy


def test_hybrid_on_the_triton_backend_decodes_like_torch(monkeypatch):
    import shoal.runtime.model.ops as ops
    from shoal.runtime.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    model_dir = cached_hybrid_model("qwen3_5")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 1024, (n,), generator=gen).tolist() for n in (21, 3, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    assert ops.choose_kernels("cuda", torch.bfloat16, "triton", True, False
                              ).linear_attention == "triton"
    assert ops.choose_kernels("cuda", torch.bfloat16, "torch", True, False
                              ).linear_attention == "torch"
    monkeypatch.setattr(ops, "fused_triton_ops", lambda name, device: name == "triton")
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), attention_backend=backend, device="cpu", block_size=4,
                  max_num_batched_tokens=16, num_kv_blocks=64, max_num_seqs=4)
        choice = llm.engine.executor.worker.runner.model.kernels.choice
        assert choice.linear_attention == backend
        runs[backend] = {
            f"{i}": (o.outputs[0].token_ids,
                     [lp.top_logprobs[0] - lp.top_logprobs[1] for lp in o.outputs[0].logprobs])
            for i, o in enumerate(llm.generate(prompts, params))}

    _assert_same_greedy(runs["torch"], runs["triton"])
    assert all(len(tokens) == 4 for tokens, _ in runs["triton"].values())
