"""oneDNN linear on packed weights: row counts rounded to few sizes, so the primitives oneDNN
builds and caches per input shape stay few and the engine's heap stays flat (issue 36: every
new row count a step had kept ~0.4 MiB, the engine core grew 62.8% past warm-up)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch
import torch.nn.functional as F
from shoal.runtime.model.linear import (
    BUCKET_BITS,
    EXACT_ROWS,
    onednn_linear,
    onednn_pack,
    padded_rows,
)

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch has no oneDNN")


def test_padded_rows_exact_for_decode_then_few_sizes_within_an_eighth():
    sizes = {padded_rows(rows) for rows in range(1, 8193)}
    for rows in range(1, 8193):
        padded = padded_rows(rows)
        assert padded == rows if rows <= EXACT_ROWS else rows <= padded <= rows * 1.125
        assert padded_rows(padded) == padded  # a padded size is its own bucket
    doublings = (8192 // EXACT_ROWS).bit_length() - 1  # 16 -> 8192: 9 doublings
    assert len(sizes) <= EXACT_ROWS + doublings * 2**BUCKET_BITS + 1


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 100, 257, 1000])
def test_padded_onednn_linear_equals_dense(rows):
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    out = onednn_linear(x, onednn_pack(weight), bias)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out (all arenas); oneDNN's cached primitives live
    there. Skips where the C library is not glibc."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc's mallinfo2")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            .split())]

    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


@needs_onednn
def test_every_row_count_reuses_the_primitives_of_its_bucket():
    """Counted in bytes, not time: once each bucket size has run, 280 other row counts add
    no primitive. Without the rounding each new count kept ~0.3-0.5 MiB (137 MiB here)."""
    torch.manual_seed(0)
    packed = onednn_pack(torch.randn(1536, 256))  # at 768 outputs oneDNN kept nothing
    counts = range(EXACT_ROWS + 1, 300)
    with torch.inference_mode():
        for rows in sorted({padded_rows(r) for r in counts}):
            onednn_linear(torch.randn(rows, 256), packed)
        before = _malloc_in_use()
        for rows in counts:
            onednn_linear(torch.randn(rows, 256), packed)
        grown = _malloc_in_use() - before
    assert grown < 16 * 2**20, f"malloc in use grew {grown / 2**20:.1f} MiB"
