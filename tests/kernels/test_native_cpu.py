"""The native CPU library (``shoal.kernels.native_cpu``): built once per machine, cached,
and where it cannot be built, a clear reason instead of a crash. Then its position-wise ops
(``cpu_ops``) against torch: bit-equal where the arithmetic is the same (rotary), within
float32 rounding where a sum's order or an exp's last bit differs, on the shapes and strided
views the model passes them."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from shoal.runtime.model.layers import RotaryEmbedding

from shoal.kernels import cpu_ops, native_cpu


@pytest.fixture(autouse=True)
def no_image_prebuilt_dir(tmp_path, monkeypatch):
    """A machine's real prebuilt directory (an image's /opt/shoal/kernels) stays out of these
    tests unless a test puts one in place."""
    monkeypatch.setenv("SHOAL_PREBUILT_KERNELS", str(tmp_path / "no-prebuilt-dir"))


def test_a_missing_compiler_is_reported_not_crashed(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(native_cpu.KernelUnavailable, match="no C compiler"):
        native_cpu.build()
    assert not list(tmp_path.rglob("*.so"))


def test_an_unwritable_cache_is_reported_not_crashed(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(blocker))  # kernels/ cannot be made under a file
    native_cpu.load.cache_clear()
    try:
        with pytest.raises(native_cpu.KernelUnavailable, match="cannot build or load"):
            native_cpu.load()
    finally:
        native_cpu.load.cache_clear()


def test_a_build_is_cached_and_reused(tiny_sources, monkeypatch):
    """The caching logic on a one-function source (the real sources' compile, ~100 s on a
    loaded machine, is what `make setup` does and every kernel test then loads)."""
    compiles = compiles_during(monkeypatch)
    first = native_cpu.build()
    stamp = first.stat().st_mtime_ns
    assert native_cpu.build() == first and first.stat().st_mtime_ns == stamp
    assert len(compiles) == 1  # the second build() compiled nothing
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no partial files left


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    """A one-function C source in place of the real ones: the prebuild logic, not a 100 s
    compile of the real kernels, is what these tests exercise."""
    source = tmp_path / "tiny.c"
    source.write_text("int shoal_tiny(void) { return 7; }\n")
    monkeypatch.setattr(native_cpu, "SOURCES", (source,))
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    return source


def compiles_during(monkeypatch) -> list[list[str]]:
    """Records every compiler invocation that is not a ``--version`` query."""
    calls: list[list[str]] = []
    real_run = subprocess.run

    def recording_run(cmd, *args, **kwargs):
        if "--version" not in cmd:
            calls.append(list(cmd))
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(native_cpu.subprocess, "run", recording_run)
    return calls


def test_the_prebuilt_library_is_used_without_compiling_again(tiny_sources, monkeypatch,
                                                              capsys):
    assert native_cpu.prebuild() == 0
    prebuilt = native_cpu.library_path()
    assert prebuilt.exists() and str(prebuilt) in capsys.readouterr().out
    compiles = compiles_during(monkeypatch)
    assert native_cpu.build() == prebuilt
    assert compiles == []


def test_another_cpu_does_not_load_the_prebuilt_library(tiny_sources, monkeypatch):
    native_cpu.prebuild()
    prebuilt = native_cpu.library_path()
    monkeypatch.setattr(native_cpu, "_cpu_signature", lambda: "model name: another CPU")
    compiles = compiles_during(monkeypatch)
    rebuilt = native_cpu.build()  # a compiler is here: rebuilt for this CPU, under its own key
    assert rebuilt != prebuilt and rebuilt.exists() and prebuilt.exists()
    assert len(compiles) == 1

    monkeypatch.setattr(native_cpu, "_cpu_signature", lambda: "model name: a third CPU")
    monkeypatch.setenv("CC", "no-such-compiler-here")  # no compiler: skipped, never the wrong one
    with pytest.raises(native_cpu.KernelUnavailable, match="no C compiler"):
        native_cpu.build()


def prebuilt_into(directory, monkeypatch):
    """Prebuilds like the image build (``--build --into DIR``) and points the runtime at it."""
    assert native_cpu.main(["--build", "--into", str(directory)]) == 0
    monkeypatch.setenv("SHOAL_PREBUILT_KERNELS", str(directory))
    [library] = directory.iterdir()
    return library


def test_a_library_in_the_prebuilt_dir_is_loaded_without_compiling_or_writing(
        tiny_sources, tmp_path, monkeypatch):
    library = prebuilt_into(tmp_path / "image-kernels", monkeypatch)
    library.chmod(0o555)
    library.parent.chmod(0o555)  # read-only, as in an image
    compiles = compiles_during(monkeypatch)
    try:
        assert native_cpu.build() == library
        assert ctypes.CDLL(str(native_cpu.build())).shoal_tiny() == 7
    finally:
        library.parent.chmod(0o755)
    assert compiles == []
    assert not (tmp_path / "cache").exists()  # nothing written to the cache


def test_a_prebuilt_library_with_another_key_falls_through_to_the_cache(tiny_sources, tmp_path,
                                                                         monkeypatch):
    library = prebuilt_into(tmp_path / "image-kernels", monkeypatch)
    monkeypatch.setattr(native_cpu, "_cpu_signature", lambda: "model name: another CPU")
    compiles = compiles_during(monkeypatch)
    built = native_cpu.build()
    assert built.parent == tmp_path / "cache" / "kernels" and built.name != library.name
    assert len(compiles) == 1
    assert native_cpu.build() == built and len(compiles) == 1  # then cached as usual
    assert [p.name for p in library.parent.iterdir()] == [library.name]  # prebuilt untouched


@pytest.mark.parametrize("state", ["missing", "a file", "unsearchable"])
def test_a_missing_or_unreadable_prebuilt_dir_is_ignored(tiny_sources, tmp_path, monkeypatch,
                                                         state):
    prebuilt = tmp_path / "image-kernels"
    if state == "a file":
        prebuilt.write_text("")
    elif state == "unsearchable":
        prebuilt_into(prebuilt, monkeypatch)
        prebuilt.chmod(0)
        if os.access(prebuilt, os.X_OK):  # root searches it anyway: give it what others get
            real_is_file = Path.is_file

            def refused(path, *args, **kwargs):
                if prebuilt in path.parents:
                    raise PermissionError(13, "Permission denied", str(path))
                return real_is_file(path, *args, **kwargs)

            monkeypatch.setattr(Path, "is_file", refused)
    monkeypatch.setenv("SHOAL_PREBUILT_KERNELS", str(prebuilt))
    try:
        built = native_cpu.build()
    finally:
        if prebuilt.is_dir():
            prebuilt.chmod(0o755)
    assert built.parent == tmp_path / "cache" / "kernels" and built.exists()


def test_the_prebuild_entry_point_without_a_compiler_exits_cleanly(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SHOAL_CACHE_DIR": str(tmp_path), "CC": "no-such-cc"}
    done = subprocess.run([sys.executable, "-m", "shoal.kernels.native_cpu", "--build"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "not prebuilt" in done.stdout and "no C compiler" in done.stdout
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("rows", [0, 1, 3, 130])
def test_rms_norm_matches_torch_with_and_without_the_residual(rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen)
    weight = torch.randn(96, generator=gen)

    alone = cpu_ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(alone, F.rms_norm(x, (96,), weight, 1e-6), rtol=1e-6, atol=1e-6)

    stream = residual.clone()
    fused = cpu_ops.rms_norm(x, weight, 1e-6, stream)
    assert torch.equal(stream, x + residual)  # updated in place, the same single add
    torch.testing.assert_close(fused, F.rms_norm(x + residual, (96,), weight, 1e-6),
                               rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows():
    wide = torch.randn(5, 200)
    x, weight = wide[:, 8:72], torch.randn(64)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5),
                               F.rms_norm(x.contiguous(), (64,), weight, 1e-5))


@pytest.mark.parametrize("rows", [0, 2, 64])
@pytest.mark.parametrize("size", [7, 1536])  # a tail shorter than a vector, several column chunks
def test_silu_and_mul_matches_torch(rows, size):
    gate_up = torch.randn(rows, 2 * size) * 6  # saturating tails of the sigmoid too
    expected = F.silu(gate_up[:, :size]) * gate_up[:, size:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), expected, rtol=1e-6, atol=1e-6)


def test_rotary_in_place_equals_the_torch_rotation():
    tokens, q_heads, kv_heads, head_dim = 9, 4, 2, 32
    rotary = RotaryEmbedding.default(head_dim, 64, 10000.0, torch.float32, "cpu")
    cos, sin = rotary.cos_sin(torch.randint(0, 64, (tokens,)))
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q = qkv[:, :q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim:(q_heads + kv_heads) * head_dim].view(tokens, kv_heads,
                                                                         head_dim)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim:].clone()
    expected_q, expected_k = rotary.rotate((cos, sin), q, k)

    both = qkv[:, :(q_heads + kv_heads) * head_dim].view(tokens, q_heads + kv_heads, head_dim)
    cpu_ops.rotary_neox_(both, cos[:, 0], sin[:, 0])

    # a compiler may contract x*cos - y*sin into an FMA on one CPU and not another
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, expected_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_ops_refuse_what_they_cannot_read():
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_ops.silu_and_mul(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="residual"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, torch.randn(3, 8))
    with pytest.raises(ValueError, match="cos must be"):
        cpu_ops.rotary_neox_(torch.randn(3, 2, 8), torch.randn(3, 8), torch.randn(3, 4))
