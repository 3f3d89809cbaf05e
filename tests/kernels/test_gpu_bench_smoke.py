"""The prepared GPU benchmark runs end to end on CPU in --smoke mode (tiny shapes).

It cannot be measured here, but every section must at least run without error, so the
one GPU session that runs it does not lose its minutes to a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_section_runs_and_the_table_comes_last(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), SHOAL_BENCH_MODEL_DIR=str(tmp_path / "model"),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "bench.py"), "--smoke"],
                          env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    for section in ("env", "attention", "decode", "throughput"):
        assert results[section] and "error" not in results[section], (section, results[section])
    assert all("error" not in row for row in results["attention"]["rows"].values())
    assert all(row["eager_ms"] and row["graphs_ms"] for row in results["decode"]["rows"])
    assert all("error" not in row for row in results["throughput"]["rows"].values())
    assert done.stdout.rstrip().splitlines()[-1].startswith("attention matches the reference")
    assert "PASS" in done.stdout.rstrip().splitlines()[-1]
    assert (tmp_path / "out" / "table.txt").read_text().strip() in done.stdout


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
    embed = worker.runner.model.model.embed_tokens.weight
    torch.testing.assert_close(embed, hf.model.embed_tokens.weight)
