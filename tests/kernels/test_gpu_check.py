"""make gpu-check: the variant list follows the launchers, every Triton kernel module is
registered, ptxas's report and Hopper's limits are read right, and one variant compiles for
sm_90a end to end with the installed triton (no GPU: triton's wheel carries ptxas)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.kernels.gpu_check.compile import CompileResult, limit_errors, parse_ptxas_log
from shoal.kernels.gpu_check.variants import SHARED_MEMORY_LIMIT

REPO = Path(__file__).resolve().parents[2]


def _triton_kernels_in_the_package() -> set[tuple[str, str]]:
    """(module, function) of every ``@triton.jit`` function under shoal/kernels/."""
    found = set()
    for path in (REPO / "shoal" / "kernels").rglob("*.py"):
        relative = path.relative_to(REPO / "shoal" / "kernels").with_suffix("")
        module = "shoal.kernels." + ".".join(relative.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                found.add((module, node.name))
    return found


def test_every_triton_kernel_in_the_package_has_variants_in_the_check():
    from shoal.kernels.gpu_check.__main__ import collect

    checked = {(v.kernel.fn.__module__, v.kernel.fn.__name__) for _, _, v in collect()}
    assert _triton_kernels_in_the_package() <= checked, (
        "add the kernel's module to REGISTERED in shoal/kernels/gpu_check/variants.py and give it "
        "gpu_variants()")
    assert len(checked) >= 6


def test_fused_moe_variants_are_read_from_its_launcher():
    from shoal.kernels.gpu_check.fused_moe_variants import launcher_constexprs

    down = launcher_constexprs(n_out=4096, k=7168, weighted=True, dtype=torch.bfloat16)
    assert down == dict(ROW_DIV=1, MUL_WEIGHT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    small = launcher_constexprs(n_out=8, k=8, weighted=False, dtype=torch.bfloat16)
    assert (small["BLOCK_N"], small["BLOCK_K"], small["MUL_WEIGHT"]) == (16, 16, False)


def test_attention_variants_are_the_launchers_choices_over_every_group_and_dtype():
    from shoal.kernels.paged_attention import choose_splits, choose_tile, gpu_variants

    variants = gpu_variants()
    compiled = {tuple(sorted(v.constexprs.items())) + (v.num_warps,) for v in variants}
    for head_dim in (64, 96, 128, 256):
        for group in range(1, 17):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                for query_len in (1, 8, 2048):
                    for batch in (1, 64):
                        tile = choose_tile(query_len, group, head_dim, dtype, "cuda")
                        split = choose_splits(query_len, batch, 8, 132) > 1
                        key = tuple(sorted(dict(tile.constexprs(head_dim, 16, dtype, "cuda"),
                                                SPLIT=split).items()))
                        assert key + (tile.num_warps,) in compiled, (head_dim, group, dtype,
                                                                     query_len, batch)
    attention = [v for v in variants if "combine" not in v.label]
    assert {v.constexprs["ROWS"] for v in attention} == {16, 64}
    assert all(v.signature["q_ptr"] == "*" + v.label.split()[-3] for v in attention)
    assert sum("combine_splits" in v.label for v in variants) == 4 * 3


def test_ptxas_report_gives_registers_and_spill_bytes():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "    472 bytes stack frame, 496 bytes spill stores, 488 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 472 bytes cumulative stack size\n")
    assert parse_ptxas_log(log) == (255, 984)
    assert parse_ptxas_log("ptxas info    : Used 40 registers\n") == (40, 0)


def test_hopper_limits_fail_a_variant():
    fits = CompileResult("k", shared_bytes=SHARED_MEMORY_LIMIT, registers=255)
    assert limit_errors(fits, num_warps=8) == []
    too_much = CompileResult("k", shared_bytes=SHARED_MEMORY_LIMIT + 1, registers=255)
    assert "shared memory" in limit_errors(too_much, num_warps=4)[0]
    assert "registers" in limit_errors(CompileResult("k", registers=255), num_warps=16)[0]


@pytest.mark.slow
def test_a_variant_compiles_for_sm90a_and_the_summary_is_the_last_line(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0", XDG_CACHE_HOME=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-P", "-m", "shoal.kernels.gpu_check", "--jobs", "1", "--only",
         "rms_norm bf16 n1024", "--cache-dir", str(tmp_path / "cache")],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert "rms_norm bf16 n1024" in done.stdout and " ok" in done.stdout
    assert lines[-1].startswith("gpu-check: 1 kernel variants compiled for sm_90a (triton ")
    assert lines[-1].endswith(", 0 failed, max shared memory 0.0 KiB, 0 spills") or \
        "0 failed" in lines[-1]
    # a second run reads the cache instead of compiling
    again = subprocess.run(done.args, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "cached" in again.stdout
