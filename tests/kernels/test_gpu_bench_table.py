"""The GPU benchmark's verdicts on the issue's three targets, from synthetic results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TABLE = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "table.py"


def _table_module():
    spec = importlib.util.spec_from_file_location("gpu_bench_table", TABLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(b64_graphs=2.0, b1_eager=3.0, b1_graphs=1.0, triton_us=140.0, flashinfer_us=100.0):
    return {
        "decode": {"device": "cuda", "rows": [
            {"batch": 1, "eager_ms": b1_eager, "graphs_ms": b1_graphs, "floor_ms": 0.3},
            {"batch": 64, "eager_ms": 4.0, "graphs_ms": b64_graphs, "floor_ms": 1.15},
        ]},
        "attention": {"rows": {
            "qwen3-decode/triton": {"max_abs_error": 0.01, "us_per_layer": triton_us},
            "qwen3-decode/flashinfer": {"max_abs_error": 0.01, "us_per_layer": flashinfer_us},
        }},
    }


def test_targets_pass_when_the_numbers_meet_them():
    lines = _table_module().targets(_results())
    assert "PASS (1.74x)" in lines[1]  # 2.0 / 1.15
    assert "PASS (3.00x)" in lines[2]
    assert "PASS (qwen3-decode 1.40x)" in lines[3]


def test_targets_fail_when_they_do_not():
    lines = _table_module().targets(_results(b64_graphs=2.5, b1_graphs=2.5, triton_us=160.0))
    assert [line.split(": ")[1].split()[0] for line in lines[1:4]] == ["FAIL", "FAIL", "FAIL"]


def test_missing_measurements_are_said_so_not_passed():
    lines = _table_module().targets({"decode": {"error": "boom"}, "attention": None})
    assert "not measured" in lines[1] and "not measured" in lines[2] and "n/a" in lines[3]


def test_a_failed_section_shows_its_error_and_the_rest_still_renders():
    text = _table_module().render_table({"env": {"error": "RuntimeError: no GPU"}, **_results()})
    assert "env: ERROR RuntimeError: no GPU" in text
    assert "qwen3-decode/triton" in text


def test_attention_disagreeing_with_the_reference_fails_the_correctness_line():
    results = _results()
    results["attention"]["rows"]["qwen3-decode/triton"]["max_abs_error"] = 0.4
    line = _table_module().targets(results)[-1]
    assert line.startswith("attention matches the reference") and "FAIL" in line
    assert "qwen3-decode/triton" in line


def test_cpu_decode_numbers_never_count_as_graph_results():
    results = _results()
    results["decode"]["device"] = "cpu"
    lines = _table_module().targets(results)
    assert "not measured" in lines[1] and "not measured" in lines[2]
