"""The routed experts of one MoE block on CPU (``shoal/kernels/moe_grouped.py``), at the
shape of ``make_moe_model``'s Qwen3-MoE ``bench`` size: hidden 1024, 64 experts of 256, top-8.

For each token count (a decode batch up to a prefill chunk) it reports the median CPU time of
one ``grouped_experts`` call on one thread (CPU time, so other jobs on a shared machine
inflate it less than wall time; still noisy) and the max difference from a float64
reference. Routing is a softmax top-k over random logits, so the experts' loads are uneven.

Each line also gives the block's matmul rate (``6 * T * k * H * I`` flops) and, as the
machine's reachable peak, the rate of the same two GEMMs done dense (all ``T * k`` rows
through one expert's weights, ``torch.mm``) in the same dtype; and the bytes of the experts'
weights the block reads (the experts its tokens chose) as a rate, next to the rate at which
this thread reads all the experts' weights in a batched GEMV (``torch.bmm``, one row each).

``--against REF`` times REF's ``moe_grouped.py`` (``git show``) in the same process too,
calls alternating, and reports the ratio of the medians. The native kernel
(``moe_experts_cpu.py``, what the native cpu backend runs, float32 and bfloat16) is timed
too, alternating, with its speedup over the grouped path (``native x``), and so is the kernel
on weights prepacked once (``pack_experts``, what the loader keeps), with its speedup over
the kernel packing per step (``prepacked/native x``). ``--threads`` sets torch's pool (the
kernel's too); CPU time then counts every thread's.

``--quantized``: the same weights quantized (round to nearest) and kept packed, through the
native quantized-experts kernel (``moe_experts_cpu.experts_quantized``), alternating with
the others: int4 in groups of 128 (one 16-bit scale a group, one zero point for all: 4.125
bits a weight) and FP8 in 128-column blocks (a float32 scale per row and block); each with
its speedup over the native kernel on the float weights (``int4 x``, ``fp8 x``).

    .venv/bin/python bench/moe_experts.py [--dtype bfloat16] [--tokens 1 8 64 256]
        [--repeats 9] [--against REF] [--threads 1] [--quantized]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from shoal.kernels import moe_experts_cpu, moe_grouped
from shoal.kernels.native_cpu import unavailable_reason
from shoal.kernels.reference import moe_ref

EXPERTS, HIDDEN, SIZE, TOP_K = 64, 1024, 256, 8


def _module_at(ref: str):
    source = subprocess.run(["git", "show", f"{ref}:shoal/kernels/moe_grouped.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "moe_grouped_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("moe_grouped_ref", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dense(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = torch.mm(rows, w13.t()).chunk(2, dim=-1)
    return torch.mm(torch.nn.functional.silu(gate) * up, w2.t())


def _quantized(w: torch.Tensor, fmt: str):
    """``w [E, out, in]`` -> the experts kernel's packed ``IntPacked`` of ``[E * out, in]``."""
    from shoal.kernels.int_matmul_cpu import (
        FP8,
        NO_OFFSET,
        ZERO_CONST,
        IntPacked,
        compact,
        pack_int4,
    )

    rows = w.reshape(-1, w.shape[-1]).float()
    groups = rows.view(rows.shape[0], -1, 128)
    if fmt == "fp8":
        scales = groups.abs().amax(-1).clamp(min=1e-12) / 448.0
        codes = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
        return IntPacked(codes.reshape(rows.shape), scales.contiguous(),
                         torch.empty(0, dtype=torch.uint8), FP8, 128, rows.shape[1], NO_OFFSET)
    scales = (groups.abs().amax(-1).clamp(min=1e-12) / 7.0).to(torch.bfloat16).float()
    codes = (groups / scales.unsqueeze(-1)).round().clamp(-8, 7) + 8
    return compact(IntPacked(pack_int4(codes.reshape(rows.shape).to(torch.uint8)),
                             scales.contiguous(), torch.tensor([8], dtype=torch.uint8), 4, 128,
                             rows.shape[1], ZERO_CONST))


def _cpu_ms(fn, *args) -> float:
    start = time.process_time()
    fn(*args)
    return (time.process_time() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--against", metavar="REF")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantized", action="store_true",
                        help="also int4 and FP8 experts kept packed (native kernel)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    w13 = (torch.randn(EXPERTS, 2 * SIZE, HIDDEN) * 0.03).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, SIZE) * 0.03).to(dtype)
    versions = {"this": moe_grouped.grouped_experts}
    if args.against:
        versions[args.against] = _module_at(args.against).grouped_experts
    if unavailable_reason() is None:
        versions["native"] = moe_experts_cpu.experts
        packed = moe_experts_cpu.pack_experts(w13, w2)  # once, as the loader does
        versions["prepacked"] = lambda x, _w13, _w2, weights, ids: \
            moe_experts_cpu.experts_packed(x, *packed, weights, ids)
        if args.quantized:
            for fmt in ("int4", "fp8"):
                q13, q2 = _quantized(w13, fmt), _quantized(w2, fmt)
                versions[fmt] = (lambda x, _a, _b, wt, i, q13=q13, q2=q2:
                                 moe_experts_cpu.experts_quantized(x, q13, q2, wt, i, EXPERTS))
                print(f"{fmt}: {(q13.codes.nbytes + q13.scales.nbytes + q2.codes.nbytes + q2.scales.nbytes) / (w13.nbytes + w2.nbytes):.3f}x the {args.dtype} experts' bytes")
    weight_bytes = (w13.nbytes + w2.nbytes) // EXPERTS  # one expert's
    v13, v2 = torch.ones(EXPERTS, HIDDEN, 1, dtype=dtype), torch.ones(EXPERTS, SIZE, 1,
                                                                       dtype=dtype)
    read_ms = statistics.median(_cpu_ms(lambda: (torch.bmm(w13, v13), torch.bmm(w2, v2)))
                                for _ in range(args.repeats))
    print(f"{args.dtype}, E={EXPERTS} H={HIDDEN} I={SIZE} top-{TOP_K}, {args.threads} "
          f"thread(s), "
          f"median CPU ms of {args.repeats}; every expert's weights read by a batched GEMV "
          f"at {weight_bytes * EXPERTS / read_ms / 1e6:.1f} GB/s")
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN).to(dtype)
        weights, ids = torch.softmax(torch.randn(tokens, EXPERTS), -1).topk(TOP_K, -1)
        exact = moe_ref(x.double(), w13.double(), w2.double(), weights, ids)
        times: dict[str, list[float]] = {name: [] for name in versions}
        for fn in versions.values():
            fn(x, w13, w2, weights, ids)  # warm up
        for _ in range(args.repeats):
            for name, fn in versions.items():
                times[name].append(_cpu_ms(fn, x, w13, w2, weights, ids))
        rows = x.repeat_interleave(TOP_K, 0)
        dense_ms = statistics.median(_cpu_ms(_dense, rows, w13[0], w2[0])
                                     for _ in range(args.repeats))
        gflop = 6 * tokens * TOP_K * HIDDEN * SIZE / 1e9
        read_mb = len(ids.unique()) * weight_bytes / 1e6
        cells = [f"dense {gflop / dense_ms * 1e3:6.1f} GFLOP/s", f"weights {read_mb:5.1f} MB"]
        for name, fn in versions.items():
            error = (fn(x, w13, w2, weights, ids).double() - exact).abs().max().item()
            ms = statistics.median(times[name])
            cells.append(f"{name} {ms:8.2f} ms {gflop / ms * 1e3:6.1f} GFLOP/s "
                         f"{read_mb / ms:4.1f} GB/s (max err {error:.2g})")
        if args.against:
            ratio = statistics.median(times[args.against]) / statistics.median(times["this"])
            cells.append(f"{ratio:.2f}x")
        if "native" in versions:
            ratio = statistics.median(times["this"]) / statistics.median(times["native"])
            cells.append(f"native {ratio:.2f}x")
            ratio = statistics.median(times["native"]) / statistics.median(times["prepacked"])
            cells.append(f"prepacked/native {ratio:.2f}x")
        for fmt in ("int4", "fp8"):
            if fmt in versions:
                ratio = statistics.median(times["native"]) / statistics.median(times[fmt])
                cells.append(f"{fmt} {ratio:.2f}x")
        print(f"T={tokens:5d}  " + "  ".join(cells))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
