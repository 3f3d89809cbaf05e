"""The integer weight-only CPU matmuls against the unpacked weights' own dequantization, and
the GPTQ / AWQ unpacking against the packers that write the test checkpoints."""

from __future__ import annotations

import pytest
import torch
from shoal.runtime.model.quant.int_kernels import (
    DequantRows,
    Int4Packed,
    Int8Channel,
    NativeInt,
    int4_group,
    int_kernel,
)
from shoal.runtime.model.quant.int_weight import IntWeights, unpack_int32
from torch import nn

from shoal.kernels.native_cpu import unavailable_reason


def _weights(out: int, inp: int, bits: int, group: int, symmetric: bool,
             act_order: bool = False, seed: int = 0) -> IntWeights:
    gen = torch.Generator().manual_seed(seed)
    n_groups = inp // group
    codes = torch.randint(0, 1 << bits, (out, inp), generator=gen).to(torch.uint8)
    scales = torch.rand(out, n_groups, generator=gen) * 0.05 + 0.01
    zeros = (torch.full((out, n_groups), float(1 << (bits - 1))) if symmetric else
             torch.randint(0, 1 << bits, (out, n_groups), generator=gen).float())
    index = None
    if act_order:
        index = torch.empty(inp, dtype=torch.int64)
        index[torch.randperm(inp, generator=gen)] = torch.arange(inp) // group
    return IntWeights(codes, scales, zeros, bits, group, index)


CASES = [  # weights, torch's kernel for them, whether the native kernel takes them
    (dict(out=64, inp=128, bits=4, group=32, symmetric=True), Int4Packed, True),
    (dict(out=48, inp=512, bits=4, group=512, symmetric=False), Int4Packed, True),  # split
    (dict(out=32, inp=128, bits=4, group=32, symmetric=True, act_order=True), Int4Packed, True),
    (dict(out=40, inp=64, bits=4, group=32, symmetric=False), DequantRows, True),  # 40 % 16
    (dict(out=32, inp=64, bits=4, group=16, symmetric=True), DequantRows, False),  # group < 32
    (dict(out=32, inp=96, bits=8, group=96, symmetric=True), Int8Channel, True),
    (dict(out=32, inp=96, bits=8, group=96, symmetric=False), Int8Channel, True),
    (dict(out=24, inp=96, bits=8, group=32, symmetric=False, act_order=True), DequantRows, True),
]
NATIVE = unavailable_reason() is None


def _torch_kernel(weights: IntWeights, kind: type, dtype: torch.dtype):
    """The torch fallback a process without the native library runs."""
    if kind is Int4Packed:
        group = int4_group(weights)
        assert group is not None
        return Int4Packed(weights, group, dtype)
    return kind(weights, dtype)


@pytest.mark.parametrize("case, kind, native", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["chosen", "torch"])
def test_kernel_equals_dequantized_weights(case: dict, kind: type, native: bool,
                                           dtype: torch.dtype, path: str) -> None:
    weights = _weights(**case)
    reference = weights.dequantize()
    if path == "chosen":
        kernel = int_kernel(weights, dtype)
        assert isinstance(kernel, NativeInt if native and NATIVE else kind)
    else:
        kernel = _torch_kernel(weights, kind, dtype)
    layer = nn.Module()
    kernel.register(layer)
    x = torch.randn(2, 3, case["inp"], generator=torch.Generator().manual_seed(1))
    out = kernel.matmul(layer, x.to(dtype)).float()
    want = x.to(dtype).float() @ reference.t()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert out.shape == want.shape
    assert torch.allclose(out, want, rtol=tolerance, atol=tolerance * want.abs().max())


def test_int4_weights_stay_packed() -> None:
    layer = nn.Module()
    int_kernel(_weights(64, 256, 4, 128, True)).register(layer)
    codes = layer.int_packed_codes if NATIVE else layer.int4_weight
    assert codes.dtype == torch.uint8
    assert codes.numel() == 64 * 256 // 2  # two codes a byte


def test_gptq_and_awq_packing_round_trips() -> None:
    from shoal.runtime.model.quant.awq import AWQ_ORDER
    from shoal.runtime.model.quant_makers.gptq_awq import _pack

    codes = torch.randint(0, 16, (24, 40), generator=torch.Generator().manual_seed(2))
    along_rows = _pack(codes, 0)
    assert along_rows.shape == (3, 40) and along_rows.dtype == torch.int32
    assert torch.equal(unpack_int32(along_rows, 4, 0).long(), codes)
    interleaved = _pack(codes, 1, AWQ_ORDER)
    assert torch.equal(unpack_int32(interleaved, 4, 1, AWQ_ORDER).long(), codes)
    # AutoAWQ's order: the first int32 holds columns 0, 2, 4, 6, 1, 3, 5, 7 from its low bits
    first = int(interleaved[0, 0]) & 0xFFFFFFFF
    assert [(first >> (4 * i)) & 15 for i in range(8)] == [int(codes[0, c]) for c in AWQ_ORDER]
