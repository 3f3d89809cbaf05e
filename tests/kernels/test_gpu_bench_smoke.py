"""The prepared GPU benchmark runs end to end on CPU in --smoke mode (tiny shapes).

It cannot be measured here, but every section must at least run without error, so the
one GPU session that runs it does not lose its minutes to a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_section_runs_and_the_table_comes_last(tmp_path):
    """bench/gpu/run.sh --dry-run: the device script itself, on CPU with tiny shapes."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), SHOAL_BENCH_MODEL_DIR=str(tmp_path / "model"),
               OMP_NUM_THREADS="1", PYTHON=sys.executable)
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "run.sh"), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=180)

    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    for section in ("env", "kernels", "attention", "decode", "decode8b", "serving", "throughput"):
        assert results[section] and "error" not in results[section], (section, results[section])
    assert all("error" not in row for row in results["attention"]["rows"].values())
    for decode in ("decode", "decode8b"):
        assert all(row["eager_ms"] and row["graphs_ms"] for row in results[decode]["rows"])
    assert "dummy" in results["decode8b"]["model"]
    serving = results["serving"]
    assert [r["concurrency"] for r in serving["rows"]] == [1, 4]
    assert all(r["output_tokens"] == 4 * r["requests"] and r["ttft_p50_ms"] for r in serving["rows"])
    assert "error" not in serving["transformers"], serving["transformers"]
    assert serving["transformers"]["output_tokens"] == 4 * 4
    assert all("error" not in row for row in results["throughput"]["rows"].values())
    kernels = results["kernels"]
    assert [(r["batch"], r["context"]) for r in kernels["rows"]] == [(1, 32), (1, 64), (2, 32), (2, 64)]
    assert all(r["max_abs_err"] < 1e-3 for r in kernels["rows"])
    assert kernels["gemm_tflops"] > 0 and kernels["prefill"]["ms"] > 0
    assert done.stdout.rstrip().splitlines()[-1].startswith("attention matches the reference")
    assert "PASS" in done.stdout.rstrip().splitlines()[-1]
    assert (out / "table.txt").read_text().strip() in done.stdout
    # the device tool brings back at most 8 files: an archive of the sections' files
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "bench.tar.gz" in files, files
    with tarfile.open(out / "bench.tar.gz") as archive:
        names = set(archive.getnames())
    assert {f"bench/{s}.{ext}" for s in results for ext in ("json", "log")} <= names


def test_a_section_that_times_out_keeps_its_rows(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench" / "gpu"))
    for name in ("table", "common"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    table = pytest.importorskip("table")
    monkeypatch.setitem(sys.modules, "table", table)
    rendered = table.render_table({"kernels": {
        "error": "timed out after 60 s (rows so far kept)", "copy_bandwidth_gbps": 4000.0,
        "gemm_tflops": 700.0, "rows": [{"batch": 1, "context": 512, "splits": 16, "us": 9.0,
                                        "floor_us": 2.0, "x_floor": 4.5}]}})
    assert "kernels: ERROR timed out" in rendered and "4.50" in rendered


def test_direct_checkpoint_writer_matches_hf_qwen3_names_and_loads(tmp_path, monkeypatch):
    """The fallback for a GPU machine whose transformers cannot build the model."""
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(REPO / "bench" / "gpu"))
    for name in ("checkpoint", "common"):  # bench modules: keep them out of later imports
        monkeypatch.delitem(sys.modules, name, raising=False)
    checkpoint = pytest.importorskip("checkpoint")
    monkeypatch.setitem(sys.modules, "checkpoint", checkpoint)  # removed again at teardown
    monkeypatch.setitem(sys.modules, "common", sys.modules["common"])
    monkeypatch.setenv("SHOAL_BENCH_CHECKPOINT", "direct")
    monkeypatch.setenv("SHOAL_BENCH_MODEL_DIR", str(tmp_path / "direct"))
    model_dir = checkpoint.ensure_checkpoint(smoke=True)

    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.worker.worker import Worker

    worker = Worker(EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=8))
    worker.load_model()
    # the table through its lookup: on an AVX2 CPU a tied table lives in the LM head's panels
    # (its weight a meta tensor)
    table = hf.model.embed_tokens.weight
    ids = torch.arange(table.shape[0])
    torch.testing.assert_close(worker.runner.model.model.embed_tokens(ids), table)
