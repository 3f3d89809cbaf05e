"""Block-scaled FP8 weights (``quant_method: fp8`` with ``weight_block_size``).

The checkpoint stores ``weight`` in float8_e4m3fn and ``weight_scale_inv`` in float32, one
per [block_out, block_in] tile (the last tiles may be partial): ``W = fp8 * scale_inv`` per
tile, as transformers' and DeepSeek's dequantization compute it. Weights stay FP8 in memory
(1 byte each). Scales are kept one row per output row (``[out, ceil(in / block_in)]``,
3% of the FP8 bytes at 128-wide blocks), so q/k/v or gate/up parts fused into one layer need
not start on a block boundary. On CPU the matmul is the native int kernel's FP8 form (whole 32-column blocks;
``int_matmul_cpu``); otherwise it dequantizes a band of output rows at a time into the
activation dtype and multiplies it, so no full-precision copy of a layer ever exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from shoal.runtime.model.linear import _Linear
from shoal.runtime.model.quant.linear_method import check_tensor, quant_param, total_rows
from shoal.runtime.model.quant.spec import Fp8BlockScheme

# output rows dequantized per band: 256 x 4096 float32 = 4 MiB, cache-sized on a server CPU
BAND_ELEMENTS = 1 << 20
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class Fp8BlockMethod:
    def __init__(self, scheme: Fp8BlockScheme) -> None:
        self.block_out = scheme.block_out
        self.block_in = scheme.block_in

    def create_weights(self, layer: _Linear, prefix: str, slots: dict[object, tuple[int, int]],
                       in_features: int, dtype: torch.dtype, device: torch.device) -> None:
        layer.fp8_block_in = self.block_in  # type: ignore[assignment]
        out_rows = total_rows(slots)
        in_blocks = _ceil(in_features, self.block_in)
        quant_param(layer, prefix, "weight", (out_rows, in_features), torch.float8_e4m3fn,
                             device, slots, lambda t, first, rows, what: _place(
                                 layer.weight, t, first, rows, (rows, in_features),
                                 (torch.float8_e4m3fn,), what))

        def load_scale(tensor: torch.Tensor, first: int, rows: int, what: str) -> None:
            check_tensor(tensor, (_ceil(rows, self.block_out), in_blocks), SCALE_DTYPES,
                         what)
            per_row = tensor.float().repeat_interleave(self.block_out, dim=0)[:rows]
            layer.weight_scale_inv.data.narrow(0, first, rows).copy_(per_row)

        quant_param(layer, prefix, "weight_scale_inv", (out_rows, in_blocks), torch.float32, device,
                    slots, load_scale)

    def finalize(self, layer: _Linear) -> None:
        pass  # the checkpoint's layout is the kernel's

    def apply(self, layer: _Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_block_linear(x, layer.weight, layer.weight_scale_inv,
                                layer.fp8_block_in, bias)  # type: ignore[arg-type]


def _place(dst: torch.Tensor, tensor: torch.Tensor, first: int, rows: int,
           shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], what: str) -> None:
    check_tensor(tensor, shape, dtypes, what)
    dst.data.narrow(0, first, rows).copy_(tensor)


def dequantize_rows(weight: torch.Tensor, scale_rows: torch.Tensor, block_in: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows ``[R, in]`` times their per-row block scales ``[R, ceil(in / block_in)]``."""
    rows, in_features = weight.shape
    full = weight.to(torch.float32)
    if in_features % block_in == 0:
        full = (full.view(rows, -1, block_in) * scale_rows.unsqueeze(-1)).view(rows, in_features)
    else:
        full = full * scale_rows.repeat_interleave(block_in, dim=1)[:, :in_features]
    return full.to(dtype)


_NO_OFFSETS = torch.empty(0, dtype=torch.uint8)


def _native_fits(x: torch.Tensor, in_features: int, block_in: int,
                 scale_rows: torch.Tensor) -> bool:
    """The native int kernel reads FP8 codes too (``bits`` FP8: each byte widened exactly,
    times its block's scale) where blocks are whole multiples of 32 columns: one pass from
    the FP8 bytes to the sums, no dequantized band written and re-read."""
    from shoal.kernels.native_cpu import unavailable_reason

    return (x.dtype in (torch.float32, torch.bfloat16) and in_features % 32 == 0
            and block_in % 32 == 0 and in_features % block_in == 0
            and scale_rows.dtype == torch.float32 and scale_rows.is_contiguous()
            and unavailable_reason() is None)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
                     block_in: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(weight).T + bias``, one band of output rows at a time."""
    if x.is_cuda:
        from shoal.kernels.dequant_gemm import FP8, dequant_gemm

        out = dequant_gemm(x, weight, scale_rows, None, FP8, block_in)
        return out if bias is None else out + bias
    out_rows, in_features = weight.shape
    if _native_fits(x, in_features, block_in, scale_rows):
        from shoal.kernels.int_matmul_cpu import FP8 as NATIVE_FP8
        from shoal.kernels.int_matmul_cpu import NO_OFFSET, IntPacked, int_matmul

        out = int_matmul(x, IntPacked(weight.view(torch.uint8), scale_rows,
                                      _NO_OFFSETS, NATIVE_FP8, block_in, in_features,
                                      NO_OFFSET))
        return out if bias is None else out + bias
    band = max(1, BAND_ELEMENTS // max(1, in_features))
    if band >= out_rows:
        return F.linear(x, dequantize_rows(weight, scale_rows, block_in, x.dtype), bias)
    out = torch.empty(*x.shape[:-1], out_rows, dtype=x.dtype, device=x.device)
    for start in range(0, out_rows, band):
        end = min(out_rows, start + band)
        w = dequantize_rows(weight[start:end], scale_rows[start:end], block_in, x.dtype)
        out[..., start:end] = F.linear(x, w, None if bias is None else bias[start:end])
    return out
