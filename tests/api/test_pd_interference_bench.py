"""bench/pd_interference.py runs end to end in --smoke mode (the tiny llama, a few seconds):
both modes serve every request, and in P/D every long prompt is pulled from the prefill
engine. It measures nothing here; the figures come from full runs (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..processes import kill_tree

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_both_modes_run_and_pd_pulls_every_long_prompt(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "pd_interference.py"), "--smoke", "--json",
         str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        stdout, _ = proc.communicate(timeout=400)
    finally:
        kill_tree(proc)  # its servers too, should it have hung
    assert proc.returncode == 0, stdout[-4000:]
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert results.keys() == {"unified", "pd"}
    for result in results.values():
        assert result["errors"] == 0 and result["short_requests"] > 0
        assert result["long_requests"] == 3  # 3 s, one every second from 0.5 s
        assert result["tokens_per_s"] > 0 and result["stream_itl_p99"] > 0
    pd = results["pd"]
    assert pd["transfers"] == 3 and pd["transfer_failures"] == 0
    assert 0 < pd["transfer_share"] < 1
    assert "round 1 pd: stream ITL p99 unified/P/D" in stdout
