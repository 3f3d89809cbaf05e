"""Weight-only int4 / int8 matmul on CPU (``int_matmul_cpu.c`` in the native library): the
weights stay packed, activations are float32 or bfloat16, sums are float32.

The layout (``IntPacked``) is the kernel's: ``codes`` uint8 ``[n, k / 2]`` (4-bit, byte i of
each 32-column sub-block holding column i in its low nibble and column 16 + i in its high
one: GGUF's Q4_0/Q4_1 order) or ``[n, k]`` (8-bit, unsigned); ``scales`` and ``offsets``
float32 ``[n, k / group]`` with ``W = code * scale + offset``. ``k`` and ``group`` are
multiples of 32. ``offsets`` may instead hold zero points (``zero_mode``, see ``OFFSETS``):
``W = (code - z) * scale``, the offset ``-z * scale`` formed in the kernel, so a 4-bit zero
point costs an eighth of a bit a weight at group 32 where a float32 offset costs one.
``bits == FP8`` (0): float8_e4m3fn codes, one byte a column, ``W = fp8 * scale``, no
offsets (``NO_OFFSET``): FP8 block-scaled (``group`` the block width) or per-channel
weights, the quantized experts' FP8 layout. ``bits == Q6_K`` (6): GGUF Q6_K super-blocks as the file stores them,
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
FP8 = 0  # ``bits`` of float8_e4m3fn codes
Q6_K = 6  # ``bits`` of GGUF Q6_K super-blocks kept as stored
QK = 256  # columns per K-quant super-block
SUPER_BLOCK_BYTES = {Q6_K: 210}
SCALE_FORMATS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernel's sfmt
# what ``offsets`` holds (the kernel's fmt >> 4): offsets in the scales' dtype; uint8 zero
# points [n, groups]; 4-bit zero points two a byte, flat over [n, groups] (group i: byte
# i // 2, the low nibble when i is even); one uint8 zero point for every group; nothing
OFFSETS, ZEROS_U8, ZEROS_U4, ZERO_CONST, NO_OFFSET = range(5)
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
    zero_mode: int = OFFSETS

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    @property
    def row_bytes(self) -> int:
        k = self.in_features
        if self.bits in SUPER_BLOCK_BYTES:
            return k // QK * SUPER_BLOCK_BYTES[self.bits]
        return k if self.bits == FP8 else k * self.bits // 8

    def _offsets_shape(self, n: int, groups: int) -> tuple[int, ...]:
        return {OFFSETS: (n, groups), ZEROS_U8: (n, groups), ZEROS_U4: ((n * groups + 1) // 2,),
                ZERO_CONST: (1,), NO_OFFSET: (0,)}[self.zero_mode]

    def check(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group
        if self.bits in SUPER_BLOCK_BYTES:
            if g != QK or k % QK:
                raise ValueError(f"int matmul: Q6_K takes columns in super-blocks of {QK}, "
                                 f"got {k} columns in groups of {g}")
        elif self.bits not in (FP8, 4, 8) or k % SUB or g % SUB or k % g:
            raise ValueError(f"int matmul: {self.bits}-bit, {k} columns in groups of {g}: "
                             f"needs 4 or 8 bits (0: FP8) and columns and groups multiples "
                             f"of {SUB}")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (
                n, self.row_bytes) or not self.codes.is_contiguous():
            raise ValueError(f"codes must be contiguous uint8 [{n}, {self.row_bytes}]")
        if (self.bits == FP8) != (self.zero_mode == NO_OFFSET):
            raise ValueError("FP8 codes, and only they, come without offsets")
        groups = 0 if self.bits in SUPER_BLOCK_BYTES else k // g
        if self.scales.dtype not in SCALE_FORMATS or tuple(self.scales.shape) != (n, groups) \
                or not self.scales.is_contiguous():
            raise ValueError(f"scales must be contiguous [{n}, {groups}], float32, float16 or "
                             "bfloat16")
        t, shape = self.offsets, self._offsets_shape(n, groups)
        dtype = self.scales.dtype if self.zero_mode == OFFSETS else torch.uint8
        if self.zero_mode != NO_OFFSET and (t.dtype != dtype or tuple(t.shape) != shape
                                            or not t.is_contiguous()):
            raise ValueError(f"offsets must be contiguous {dtype} {list(shape)} (zero mode "
                             f"{self.zero_mode})")

    @property
    def scale_format(self) -> int:
        """The kernel's ``fmt``: the scales' type and what the offsets hold."""
        return SCALE_FORMATS[self.scales.dtype] | self.zero_mode << 4


def compact(w: IntPacked) -> IntPacked:
    """``w`` with its scales (and offsets) in float16 or bfloat16 where every one is exact
    there (the weights stay bit for bit the same), else as they are."""
    if w.scales.dtype != torch.float32 or not w.scales.numel():
        return w
    for dtype in (torch.float16, torch.bfloat16):
        scales = w.scales.to(dtype)
        offsets = w.offsets.to(dtype) if w.zero_mode == OFFSETS else w.offsets
        if torch.equal(scales.float(), w.scales) and (
                w.zero_mode != OFFSETS or torch.equal(offsets.float(), w.offsets)):
            return IntPacked(w.codes, scales, offsets, w.bits, w.group, w.in_features,
                             w.zero_mode)
    return w


def zero_points(zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, int] | None:
    """Integer zero points ``zeros [n, groups]`` (float) in their narrowest kept form
    (``offsets``, ``zero_mode``): one byte for all when they are all equal, 4 bits each when
    they fit, else a byte each; None when they are not integers in [0, 256)."""
    if not zeros.numel() or not bool((zeros == zeros.round()).all()) or \
            float(zeros.min()) < 0 or float(zeros.max()) > 255:
        return None
    z = zeros.to(torch.uint8)
    if bool((z == z.reshape(-1)[0]).all()):
        return z.reshape(-1)[:1].clone(), ZERO_CONST
    if bits == 4 and int(z.max()) < 16:
        flat = z.reshape(-1)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        pairs = flat.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous(), ZEROS_U4
    return z.contiguous(), ZEROS_U8


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

