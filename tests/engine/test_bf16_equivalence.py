"""bfloat16 on CPU through the native path (the ``cpu`` attention backend over a bfloat16 KV
cache, linear layers on the bfloat16 kernel) against HF transformers in bfloat16.

bfloat16 has 8 bits of mantissa: two implementations that round in different places pick
different tokens wherever the top two logits are close, and after one different token the
continuations have nothing in common. So the comparison is teacher-forced: the engine
generates greedily, HF (bfloat16, its default attention) scores the engine's own sequence in
one forward pass, and at every step the engine's token is compared with HF's argmax given
the same prefix. The acceptance (issue 29): at least 90% of steps agree, on two
architectures; every step that does not is one where HF's own top-2 margin is within bfloat16
noise (``BF16_NEAR_TIE``); and the engine's logprob of each token it picked is within
``LOGPROB_TOLERANCE`` of HF's for the same token.

A mixture of experts (gpt-oss) adds a discontinuity: where a token's k-th and (k+1)-th router
logits are within bfloat16 noise, the two implementations may send it to different experts,
and from there on that request's K/V differ, so full-attention layers carry the difference
to every later position (measured on the tiny gpt-oss: a logprob 0.37 off at a position
whose own routing agreed, after a token 9 positions earlier went to another expert at a
router gap of 0.004; HF bfloat16 and HF float32 agreed there within 0.002). So the test
records which experts the engine chose for every token of every step and compares them with
HF's own bfloat16 routing of the same sequence: every different choice must be at a router
near-tie (``ROUTER_NEAR_TIE``), and the logprob bound holds for each step before its
request's first different choice.
"""

from __future__ import annotations

import random

import pytest
import torch
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

# top-2 logit margin (in HF's bfloat16 logits) under which two bfloat16 implementations may
# rank the two tokens either way: a few bfloat16 ulps of logits of size ~10
BF16_NEAR_TIE = 0.25
# |engine logprob - HF logprob| of the same token, both in bfloat16 (measured 0.033 on llama,
# 0.045 on qwen3: 92/96 and 95/96 steps agreed)
LOGPROB_TOLERANCE = 0.1
# gap between a token's k-th and (k+1)-th router logits (HF bfloat16, logits of size ~1)
# under which two bfloat16 implementations may choose either way: HF bfloat16 itself differs
# from HF float32 by up to 0.07 in the first layer's router logits and 0.28 (99th percentile)
# in the second's (tiny gpt-oss, 116 tokens)
ROUTER_NEAR_TIE = 0.25


def _bf16_engine(model_dir) -> EngineCore:
    return EngineCore(EngineConfig.from_kwargs(
        str(model_dir), dtype="bfloat16", device="cpu", max_model_len=256, num_kv_blocks=128,
        max_num_batched_tokens=64))  # chunks: prefill steps mix with decodes


def greedy_with_logprobs(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    for req_id, prompt in prompts.items():
        core.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                           sampling_params=params))
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    logprobs: dict[str, list[float]] = {r: [] for r in prompts}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(lp.logprob for lp in out.new_logprobs or [])
        steps += 1
        assert steps < 1000
    return tokens, logprobs


class EngineRouting:
    """The experts the engine's routers chose, per (request, position): records each step's
    plan and each MoE layer's expert ids (uniproc executor, in-process hooks)."""

    def __init__(self, core: EngineCore) -> None:
        self.chosen: dict[tuple[str, int], list[frozenset[int]]] = {}
        self._plan = None
        executor = core.executor
        execute = executor.execute

        def recording(plan):
            self._plan = plan
            return execute(plan)

        executor.execute = recording
        model = executor.worker.runner.model
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.register_forward_hook(self._record)

    def _record(self, module, inputs, outputs) -> None:
        plan = self._plan
        ids = outputs[1].tolist()
        starts = plan.query_start_loc.tolist()
        for row, req_id in enumerate(plan.req_ids):
            for t in range(starts[row], starts[row + 1]):
                key = (req_id, int(plan.positions[t]))
                self.chosen.setdefault(key, []).append(frozenset(ids[t]))


def hf_routing(model, ids: torch.Tensor) -> list[tuple[list[frozenset[int]], list[float]]]:
    """Per position of ``ids``: the experts HF's bfloat16 routers chose in each MoE layer,
    and each layer's gap between its k-th and (k+1)-th router logits."""
    # gpt-oss's ``mlp.router``, Qwen3-MoE's ``mlp.gate``: both return the logits first
    routers = [m for name, m in model.named_modules()
               if name.endswith(("mlp.router", "mlp.gate")) and hasattr(m, "top_k")]
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, inputs, outputs) -> None:
        values, experts = torch.topk(outputs[0].float(), module.top_k + 1, dim=-1)
        layers.append((experts[:, :-1], values[:, -2] - values[:, -1]))

    hooks = [router.register_forward_hook(keep) for router in routers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [([frozenset(experts[p].tolist()) for experts, _ in layers],
             [float(gaps[p]) for _, gaps in layers]) for p in range(ids.shape[1])]


def first_routing_difference(engine: EngineRouting, req_id: str, hf,
                             length: int) -> int:
    """The first position where the engine sent a token to other experts than HF did
    (``length`` if none). That first difference must be a router near-tie in HF; after it
    the hidden states differ, so later choices may differ for that reason alone."""
    for pos in range(length):
        hf_sets, gaps = hf[pos]
        ours = engine.chosen[(req_id, pos)]
        assert len(ours) == len(hf_sets), f"{req_id} position {pos}: {len(ours)} MoE layers"
        for layer, (mine, theirs) in enumerate(zip(ours, hf_sets, strict=True)):
            if mine != theirs:
                assert gaps[layer] < ROUTER_NEAR_TIE, (
                    f"{req_id} position {pos} layer {layer}: experts {sorted(mine)}, HF "
                    f"{sorted(theirs)} with a router gap of {gaps[layer]:.3g}")
                return pos
    return length


# gpt-oss's experts run torch's grouped GEMMs (biases, clamped SwiGLU); Qwen3-MoE's the native
# experts kernel (moe_experts_cpu), which sums in float32 and rounds once
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_oss", "qwen3_moe"])
def test_bf16_greedy_agrees_with_hf_bf16_teacher_forced(arch, tiny_model_dirs,
                                                         tiny_moe_model_dirs):
    from shoal.runtime.model.ops import panel_linears_here
    from transformers import AutoModelForCausalLM

    model_dir = {**tiny_model_dirs, **tiny_moe_model_dirs}[arch]
    rng = random.Random(7)
    prompts = {f"r{i}": [rng.randrange(3, 1000) for _ in range(n)]
               for i, n in enumerate([1, 5, 17, 33, 64, 100])}
    core = _bf16_engine(model_dir)
    model = core.executor.worker.runner.model
    # the native path ran: attention kernels over a bfloat16 cache, the bf16 linear kernel
    # (the panel kernel on an AVX2 CPU such as this pool's)
    assert model.kernels.choice.attention == "cpu"
    assert model.kernels.choice.linear in ("native_bf16", "onednn")
    assert model.kernels.choice.linear_panels == panel_linears_here()
    assert core.executor.worker.runner.kv_caches[0][0].dtype == torch.bfloat16
    routing = EngineRouting(core)
    tokens, logprobs = greedy_with_logprobs(core, prompts, 16)
    moe = bool(routing.chosen)
    assert moe == (arch in ("gpt_oss", "qwen3_moe"))
    if arch == "qwen3_moe":
        assert {layer.mlp.experts.impl for layer in model.model.layers} == {"native_cpu"}
        # prepacked at load (moe.pack_cpu_experts): the panel order, the same bytes
        assert all(layer.mlp.experts.prepacked for layer in model.model.layers)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    agree = steps = rerouted = 0
    worst_logprob = 0.0
    for req_id, prompt in prompts.items():
        got = tokens[req_id]
        assert len(got) == len(logprobs[req_id]) == 16
        ids = torch.tensor([prompt + got])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
        hf_logprobs = torch.log_softmax(logits, dim=-1)
        # the last token is sampled, never computed: routing is known up to the one before
        first_rerouted = first_routing_difference(routing, req_id, hf_routing(hf, ids),
                                                  ids.shape[1] - 1) if moe else ids.shape[1]
        for i, token in enumerate(got):
            top2 = torch.topk(logits[i], 2)
            steps += 1
            after_reroute = len(prompt) - 1 + i >= first_rerouted
            rerouted += after_reroute
            if int(top2.indices[0]) == token:
                agree += 1
            else:
                assert after_reroute or float(top2.values[0] - top2.values[1]) < BF16_NEAR_TIE, (
                    f"{req_id} step {i}: engine picked {token}, HF bf16 argmax "
                    f"{int(top2.indices[0])} by a margin of {float(top2.values[0] - top2.values[1]):.3g}")
            if not after_reroute:
                worst_logprob = max(worst_logprob,
                                    abs(logprobs[req_id][i] - float(hf_logprobs[i, token])))
    print(f"{arch}: {agree}/{steps} steps agree with HF bf16; worst |logprob difference| "
          f"{worst_logprob:.3g} over {steps - rerouted} steps before any routing difference")
    assert agree / steps >= 0.9, f"{agree}/{steps} steps agree with HF bf16"
    # gpt-oss: 37 of 96 steps come before their request's first routing difference (the
    # long prompts reach a router near-tie before their first generated token)
    assert steps - rerouted >= steps // 4, f"only {steps - rerouted} steps routed as HF did"
    assert worst_logprob < LOGPROB_TOLERANCE, worst_logprob
