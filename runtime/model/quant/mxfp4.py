"""MXFP4 expert weights (published gpt-oss checkpoints), dequantized at load.

The OCP microscaling format as gpt-oss stores it: a weight ``W [E, out, in]`` is split along
``in`` into groups of 32; each group keeps 32 FP4 (E2M1) codes, two per byte (element ``2j``
in the low nibble, ``2j + 1`` in the high one), in ``<name>_blocks [E, out, in / 32, 16]``
uint8, and one shared power-of-two scale, an E8M0 exponent biased by 127, in
``<name>_scales [E, out, in / 32]`` uint8. The value is ``E2M1[code] * 2 ** (scale - 127)``,
exact in float32 and bfloat16, so dequantizing loses nothing. The result is returned in the
unquantized checkpoint's layout, ``[E, in, out]`` (transformers' ``GptOssExperts``), so the
experts' ordinary loaders (and their tensor-parallel slicing) take it as they would a
full-precision tensor. Only the expert tensors are quantized; everything else in the
checkpoint is full precision.

Serving keeps the dequantized experts in the model dtype (4x the MXFP4 bytes in bfloat16):
shoal has no MXFP4 expert kernel.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

# the 16 E2M1 values by code: sign bit 3, then exponent (2 bits) and mantissa (1 bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per shared scale
EXPONENT_BIAS = 127
_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks [E, out, G, 16]`` uint8 and ``scales [E, out, G]`` uint8 -> ``[E, G * 32,
    out]`` in ``dtype``. One expert at a time: the code indices of a whole layer would take
    16 bytes per weight."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not match [E, out, G, 16] and [E, out, G]")
    experts, rows, groups, _ = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    out = torch.empty(experts, groups * GROUP, rows, dtype=dtype)
    for e in range(experts):
        codes = torch.stack((blocks[e] & 0x0F, blocks[e] >> 4), dim=-1).int()  # [out, G, 16, 2]
        values = table[codes].reshape(rows, groups, GROUP)
        exponents = scales[e].int().sub_(EXPONENT_BIAS).unsqueeze(-1)  # [out, G, 1]
        out[e] = torch.ldexp(values, exponents).reshape(rows, groups * GROUP).t().to(dtype)
    return out


def dequantized_tensors(tensors: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A checkpoint's (name, tensor) stream with each ``X_blocks`` / ``X_scales`` pair
    replaced by ``X`` dequantized to float32 (the loaders cast to the parameter dtype). The
    two halves of a pair may sit in different shard files, so each half is read when met and
    held until its partner arrives; a half left without its partner is an error naming it."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            yield name, tensor
            continue
        base = name[:-len(suffix)]
        halves = pending.setdefault(base, {})
        halves[suffix] = tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        if len(halves) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(halves["_blocks"], halves["_scales"])
    if pending:
        lonely = sorted(f"{base}{next(iter(halves))}" for base, halves in pending.items())
        raise ValueError(f"MXFP4 checkpoint: {', '.join(lonely[:4])} without its "
                         f"{'scales' if lonely[0].endswith('_blocks') else 'blocks'}")
