"""bench/decode_attention.py runs end to end on a tiny shape and reports what it measured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shoal.kernels import native_cpu

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "decode_attention.py"


@pytest.mark.skipif(native_cpu.unavailable_reason() is not None,
                    reason="no C compiler here: the native CPU kernels are unavailable")
def test_the_kernel_and_the_streaming_read_are_reported_side_by_side():
    command = [sys.executable, str(SCRIPT), "--threads", "1", "--layers", "2", "--shapes", "3x40"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("torch threads 1; streaming read ")
    row = next(line for line in lines if line.startswith("3x40"))
    mb, ms, gbs, share, cached = row.split()[1:]
    assert float(mb) == pytest.approx(2 * 3 * 40 * 4 * 64 * 4 / 1e6, abs=0.05)
    assert float(ms) > 0 and float(gbs) > 0 and float(cached) > 0 and share.endswith("%")
    assert lines[-1].startswith("streaming read after: ")
