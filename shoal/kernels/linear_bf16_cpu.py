"""Linear layers over bfloat16 weights on CPU, for CPUs whose oneDNN cannot pack bfloat16
weights.

oneDNN's bfloat16 path needs bfloat16 instructions (AVX512-BF16, AMX or AVX-NE-CONVERT;
``torch.ops.mkldnn._is_mkldnn_bf16_supported()``). Without them (Zen 3, AVX2), torch's
bfloat16 ``F.linear`` ran 1.5-3x slower than float32 on the same machine. Here the weight
stays in bfloat16 (half the memory and half the bytes a decode step reads) and:

- one or two rows: torch's own bfloat16 ``F.linear`` (its GEMV was the fastest measured);
- more rows: float32 GEMM (torch's, MKL) on the weight widened a chunk of output features at
  a time (``CHUNK_BYTES`` of float32), so no full float32 copy is ever held; widening costs
  one pass over the weight, small next to a GEMM over many rows.

Measured here (Zen 3, one thread, load average 3, SmolLM2's 1536x576 gate_up / Qwen3-0.6B's
6144x1024 / SmolLM2's 49152x576 LM head): 1 row, torch bf16 0.195 / 1.52 / 6.35 ms against
widened GEMM 0.49 / 3.39 / 14.0 ms and a native C streaming kernel 0.83 / 5.26 / 31.2 ms;
16 rows, widened GEMM 0.82 / 8.3 / 25.1 ms against torch bf16 3.1 / 20.2 / 94.4 ms and the
streaming kernel 5.7 / 49.9 / 258 ms; float32 on oneDNN-packed weights 0.12 / 2.35 / 9.5 ms at
1 row, 0.78 / 6.9 / 29.1 ms at 16. The streaming kernel (its 16-lane widening lowered poorly on
AVX2) lost at every size and was removed (git history: ``linear_bf16_cpu.c``).

Both paths sum in float32 and round to bfloat16 once, as torch's bfloat16 matmul does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# rows up to which torch's bfloat16 GEMV beats widening + float32 GEMM (measured above)
TORCH_MAX_ROWS = 2
# float32 bytes of weight widened at a time on the GEMM path (stays in L2/L3 between uses)
CHUNK_BYTES = 4 << 20


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.bfloat16):
            raise ValueError(f"{name} must be a bfloat16 CPU tensor, got {t.dtype} on "
                             f"{t.device}")
    if weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [out, in] matrix, got "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight takes {weight.shape[1]}")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] vector, got "
                         f"{tuple(bias.shape)}")


def linear_bf16(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in bfloat16, summed in float32; ``x [..., in]``, ``weight
    [out, in]``."""
    _check(x, weight, bias)
    lead = x.shape[:-1]
    rows2d = x.reshape(-1, x.shape[-1])
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    n = weight.shape[0]
    if rows2d.shape[0] <= TORCH_MAX_ROWS:
        return F.linear(rows2d, weight, bias).reshape(*lead, n)
    return _widened_gemm(rows2d, weight, bias).reshape(*lead, n)


def _widened_gemm(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    x32 = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    step = max(16, CHUNK_BYTES // (4 * max(k, 1)))
    for start in range(0, n, step):
        end = min(n, start + step)
        w32 = weight[start:end].float()
        part = (torch.mm(x32, w32.t()) if bias is None
                else torch.addmm(bias[start:end].float(), x32, w32.t()))
        out[:, start:end] = part
    return out
