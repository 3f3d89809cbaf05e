"""Weight-only int4 / int8 matmul on CPU (``int_matmul_cpu.c`` in the native library): the
weights stay packed, activations are float32 or bfloat16, sums are float32.

The layout (``IntPacked``) is the kernel's: ``codes`` uint8 ``[n, k / 2]`` (4-bit, byte i of
each 32-column sub-block holding column i in its low nibble and column 16 + i in its high
one: GGUF's Q4_0/Q4_1 order) or ``[n, k]`` (8-bit, unsigned); ``scales`` and ``offsets``
float32 ``[n, k / group]`` with ``W = code * scale + offset``. ``k`` and ``group`` are
multiples of 32. ``bits == Q6_K`` (6): GGUF Q6_K super-blocks as the file stores them,
``codes`` uint8 ``[n, k / 256 * 210]``, ``group`` 256, ``scales`` and ``offsets`` empty
``[n, 0]`` (the blocks carry theirs; the kernel decodes them).

Few rows (decode) run the kernel, which unpacks a tile of weights into float32 once for all
the rows; more than ``GEMM_MIN_ROWS`` (prefill) dequantize a band of output features at a
time in C and multiply with torch's float32 GEMM, which beats any hand loop there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.kernels.native_cpu import load

SUB = 32  # columns per packed sub-block
Q6_K = 6  # ``bits`` of GGUF Q6_K super-blocks kept as stored
QK = 256  # columns per K-quant super-block
SUPER_BLOCK_BYTES = {Q6_K: 210}
SCALE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernel's sfmt
# rows from which a dequantized band + torch's GEMM beats the kernel. Measured (Zen 3, 2
# threads, load 3.6-4.5), kernel / dequantize + GEMM: 6144x1024 int4 at 64 rows 17.7 / 72.5 ms,
# 128 rows 38.4 / 112, 256 rows 88.3 / 129; 1024x3072 at 128 rows 23.4 / 47.0, 256 48.4 / 45.7
GEMM_MIN_ROWS = 256
BAND_BYTES = 4 << 20  # float32 weights dequantized per band on the GEMM path
NR_ALIGN = 16  # band rows a multiple of this


@dataclass
class IntPacked:
    codes: torch.Tensor  # uint8, see the module's docstring
    scales: torch.Tensor  # float32, float16 or bfloat16 [n, k / group]
    offsets: torch.Tensor  # as scales
    bits: int
    group: int
    in_features: int

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def row_bytes(self) -> int:
        k = self.in_features
        if self.bits in SUPER_BLOCK_BYTES:
            return k // QK * SUPER_BLOCK_BYTES[self.bits]
        return k * self.bits // 8

    def check(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group
        if self.bits in SUPER_BLOCK_BYTES:
            if g != QK or k % QK:
                raise ValueError(f"int matmul: Q6_K takes columns in super-blocks of {QK}, "
                                 f"got {k} columns in groups of {g}")
        elif self.bits not in (4, 8) or k % SUB or g % SUB or k % g:
            raise ValueError(f"int matmul: {self.bits}-bit, {k} columns in groups of {g}: "
                             f"needs 4 or 8 bits and columns and groups multiples of {SUB}")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (
                n, self.row_bytes) or not self.codes.is_contiguous():
            raise ValueError(f"codes must be contiguous uint8 [{n}, {self.row_bytes}]")
        groups = 0 if self.bits in SUPER_BLOCK_BYTES else k // g
        for name, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t.dtype not in SCALE_FORMATS or t.dtype != self.scales.dtype or \
                    tuple(t.shape) != (n, groups) or not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous [{n}, {groups}], float32, float16 "
                                 f"or bfloat16 as the scales")

    @property
    def scale_format(self) -> int:
        return SCALE_FORMATS[self.scales.dtype]


def compact(w: IntPacked) -> IntPacked:
    """``w`` with its scales and offsets in float16 or bfloat16 where every one of both is
    exact there (the weights stay bit for bit the same), else as they are."""
    if w.scales.dtype != torch.float32 or not w.scales.numel():
        return w
    for dtype in (torch.float16, torch.bfloat16):
        scales, offsets = w.scales.to(dtype), w.offsets.to(dtype)
        if torch.equal(scales.float(), w.scales) and torch.equal(offsets.float(), w.offsets):
            return IntPacked(w.codes, scales, offsets, w.bits, w.group, w.in_features)
    return w


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[n, k]`` in [0, 16) -> the kernel's nibbles ``[n, k / 2]``."""
    n, k = codes.shape
    blocks = codes.reshape(n, k // SUB, 2, SUB // 2).to(torch.uint8)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``."""
    n, half = packed.shape
    blocks = packed.reshape(n, half * 2 // SUB, 1, SUB // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=2).reshape(n, half * 2)


def dequantize(w: IntPacked, start: int = 0, end: int | None = None) -> torch.Tensor:
    """float32 ``W[start:end]`` (the reference the kernel is tested against, and the GEMM
    path's band)."""
    end = w.out_features if end is None else end
    out = torch.empty(end - start, w.in_features, dtype=torch.float32)
    if end > start:
        load().shoal_int_dequant_f32(w.codes.data_ptr(), w.scales.data_ptr(),
                                     w.offsets.data_ptr(), start, end, w.in_features, w.group,
                                     w.bits, w.scale_format, out.data_ptr())
    return out


def int_matmul(x: torch.Tensor, w: IntPacked) -> torch.Tensor:
    """``x @ W.T`` for ``x [..., k]`` float32 or bfloat16; the result has x's dtype."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x must be a float32 or bfloat16 CPU tensor, got {x.dtype} on "
                         f"{x.device}")
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {w.in_features}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, w.in_features)
    x32 = rows.float() if rows.dtype != torch.float32 else rows
    if x32.stride(-1) != 1:
        x32 = x32.contiguous()
    n = w.out_features
    out = torch.empty(x32.shape[0], n, dtype=torch.float32)
    if x32.shape[0] >= GEMM_MIN_ROWS:
        step = max(NR_ALIGN, BAND_BYTES // (4 * w.in_features) // NR_ALIGN * NR_ALIGN)
        for start in range(0, n, step):
            end = min(n, start + step)
            out[:, start:end] = x32 @ dequantize(w, start, end).t()
    elif x32.shape[0]:
        load().shoal_int_matmul_f32(x32.data_ptr(), x32.stride(0), x32.shape[0],
                                    w.codes.data_ptr(), w.scales.data_ptr(),
                                    w.offsets.data_ptr(), n, w.in_features, w.group, w.bits,
                                    w.scale_format, out.data_ptr(), out.stride(0))
    result = out if x.dtype == torch.float32 else out.to(x.dtype)
    return result.reshape(*lead, n)

