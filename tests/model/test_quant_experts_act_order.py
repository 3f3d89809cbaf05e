"""GPTQ act-order experts (``desc_act``: each linear's ``g_idx`` maps its input columns to
groups in the order of the Hessian): packed with each part's columns sorted by group, the down
projection's order moved onto the gate and up rows, the gate/up order gathering the hidden
state per (token, expert). Checked against GPTQ's reference dequantization
(``(q - (qzeros + 1)) * scales[g_idx]``) of each expert, run as a plain torch MoE, at an
intermediate size of several groups (the tiny checkpoints' experts have one group there)."""

from __future__ import annotations

import torch
from shoal.runtime.model.quant.spec import IntWeightScheme, QuantSpec
from shoal.runtime.model.quant_makers.gptq_awq import GROUP, _codes, _pack

from tests.api.test_quantized_over_http import _fields

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 96, 4, 2, 7


def _gptq_linear(weight: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One act-order linear as AutoGPTQ stores it: columns in their own order, g_idx the
    group of each (a random permutation's groups)."""
    in_features = weight.shape[1]
    index = torch.empty(in_features, dtype=torch.long)
    index[torch.randperm(in_features, generator=gen)] = torch.arange(in_features) // GROUP
    codes, scales, zeros = _codes(weight, index, in_features // GROUP, symmetric=True)
    return {"qweight": _pack(codes.t(), 0), "qzeros": _pack((zeros - 1).t(), 1),
            "scales": scales.t().contiguous(), "g_idx": index.to(torch.int32)}


def _reference_weight(t: dict[str, torch.Tensor]) -> torch.Tensor:
    q = _fields(t["qweight"].t()).t()
    zeros = _fields(t["qzeros"]) + 1
    index = t["g_idx"].long()
    return ((q - zeros[index]) * t["scales"].float()[index]).t()


def test_act_order_experts_equal_gptq_reference_dequantization() -> None:
    from shoal.runtime.model.moe import FusedExperts
    from shoal.runtime.model.moe_config import MoeConfig
    from shoal.runtime.model.parallel import ParallelContext

    gen = torch.Generator().manual_seed(3)
    spec = QuantSpec("gptq", IntWeightScheme(4, GROUP, True, "gptq", desc_act=True), ())
    experts = FusedExperts(MoeConfig(EXPERTS, TOP_K, INTER, True), HIDDEN, ParallelContext(),
                           torch.float32, "cpu")
    experts.quantize(spec, "mlp.experts", torch.device("cpu"))
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for e in range(EXPERTS):
        gate_up_gen = torch.Generator().manual_seed(100 + e)  # gate and up share their order
        for kind, shape in (("gate", (INTER, HIDDEN)), ("up", (INTER, HIDDEN)),
                            ("down", (HIDDEN, INTER))):
            order_gen = gen if kind == "down" else gate_up_gen.manual_seed(100 + e)
            parts[(e, kind)] = _gptq_linear(torch.randn(shape, generator=gen) * 0.2, order_gen)
            target = experts.down_proj if kind == "down" else experts.gate_up_proj
            for name, tensor in parts[(e, kind)].items():
                getattr(target, name).weight_loader(None, tensor, (e, kind))
    experts.finalize_quant()
    assert experts.input_orders is not None

    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    got = experts(x, (weights, ids))

    want = torch.zeros_like(x)
    for t in range(TOKENS):
        for k in range(TOP_K):
            e = int(ids[t, k])
            gate, up, down = (_reference_weight(parts[(e, kind)]) for kind in
                              ("gate", "up", "down"))
            h = torch.nn.functional.silu(gate @ x[t]) * (up @ x[t])
            want[t] += weights[t, k] * (down @ h)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
