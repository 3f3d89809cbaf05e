"""`make image-test`: build both images with podman on a locally made base, then run them.

Not part of `make test` (the file name is not test_*.py; minutes of building): run as
`python -m pytest tests/k8s/images_check.py`. Needs podman and buildah (tools/images/setup.sh
installs them), and root (debootstrap, rootful podman).

- The base: Debian bookworm made with debootstrap (python3 3.11, the tested CPU torch wheel's
  ABI), this machine's CA bundle copied in (pip in the builds goes through the same TLS proxy),
  imported as localhost/shoal-base:bookworm. Made once; podman's storage lives under
  $SHOAL_PODMAN_ROOT (default /tmp/shoal-podman), never in the work tree.
- The CPU runtime image serves the default model as uid 10001 on a read-only root filesystem
  with every capability dropped (/ready 200, one completion), on the host's loopback.
- The operator image starts as uid 10001, read-only, and reconciles against the emulator.
Sizes and timings are printed (pytest -s) and written to $SHOAL_PODMAN_ROOT/report.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
PODMAN_ROOT = Path(os.environ.get("SHOAL_PODMAN_ROOT", "/tmp/shoal-podman"))
BASE = "localhost/shoal-base:bookworm"
OPERATOR = "localhost/shoal-operator:test"
RUNTIME = "localhost/shoal-runtime:test-cpu"
DEBIAN_MIRROR = os.environ.get("SHOAL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# A folder holding the torch CPU wheel (pip's find-links here); without one, PyTorch's CPU index.
TORCH_WHEELS = os.environ.get("SHOAL_TORCH_WHEELS", os.environ.get("PIP_FIND_LINKS", ""))
REPORT: dict[str, Any] = {}

pytestmark = pytest.mark.timeout(3600)


def podman_env() -> dict[str, str]:
    PODMAN_ROOT.mkdir(parents=True, exist_ok=True)
    storage = PODMAN_ROOT / "storage.conf"
    storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{PODMAN_ROOT}/graph"\n'
                       f'runroot = "{PODMAN_ROOT}/run"\n')
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(storage),
            "CONTAINERS_CONF": str(ROOT / "tools" / "images" / "containers.conf")}


def podman(*args: str, check: bool = True, timeout: float = 1800,
           capture: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], env=podman_env(), text=True, timeout=timeout,
                            capture_output=capture, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}):\n"
                             f"{(result.stdout or '')[-4000:]}\n{(result.stderr or '')[-4000:]}")
    return result


def image_size_mb(image: str) -> float:
    return round(int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e6, 1)


def timed_build(name: str, *args: str) -> None:
    started = time.monotonic()
    log = PODMAN_ROOT / f"build-{name}.log"
    with log.open("w") as out:
        # host network: RUN steps reach PyPI as this machine does (no bridge/iptables needed)
        result = subprocess.run(["podman", "build", "--network", "host", *args, "."],
                                env=podman_env(), cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT, text=True, timeout=3000)
    assert result.returncode == 0, f"build of {name} failed; log: {log}\n" + \
        log.read_text()[-6000:]
    REPORT[f"{name}_build_seconds"] = round(time.monotonic() - started, 1)


@pytest.fixture(scope="module")
def base_image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed: run tools/images/setup.sh (apt-get)")
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return BASE
    started = time.monotonic()
    rootfs = PODMAN_ROOT / "rootfs"
    if rootfs.exists():
        shutil.rmtree(rootfs)
    subprocess.run(["debootstrap", "--variant=minbase",
                    "--include=ca-certificates,python3,python3-venv", "bookworm", str(rootfs),
                    DEBIAN_MIRROR], check=True, capture_output=True, timeout=1800)
    shutil.copy(CA_BUNDLE, rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "--change", f"ENV PIP_CERT={CA_BUNDLE}", "-", BASE],
                   stdin=tar.stdout, env=podman_env(), check=True, capture_output=True,
                   timeout=900)
    assert tar.wait() == 0
    shutil.rmtree(rootfs)
    REPORT["base_seconds"] = round(time.monotonic() - started, 1)
    return BASE


@pytest.fixture(scope="module")
def operator_image(base_image: str) -> str:
    timed_build("operator", "-f", "Dockerfile.operator", "--build-arg",
                f"BASE_IMAGE={base_image}", "-t", OPERATOR)
    REPORT["operator_image_mb"] = image_size_mb(OPERATOR)
    return OPERATOR


@pytest.fixture(scope="module")
def runtime_image(base_image: str) -> str:
    args = ["-f", "Dockerfile.runtime", "--build-arg", "VARIANT=cpu",
            "--build-arg", f"CPU_IMAGE={base_image}", "-t", RUNTIME]
    if TORCH_WHEELS and Path(TORCH_WHEELS).is_dir():
        # the local CPU wheel, and PyPI for torch's own dependencies
        args += ["-v", f"{TORCH_WHEELS}:/wheels:ro", "--build-arg", "TORCH_FIND_LINKS=/wheels",
                 "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    timed_build("runtime", *args)
    REPORT["runtime_image_mb"] = image_size_mb(RUNTIME)
    torch = podman("run", "--rm", "--network", "none", "--entrypoint", "python", RUNTIME, "-c",
                   "import torch; print(torch.__version__)").stdout.strip()
    REPORT["runtime_torch"] = torch
    assert torch.startswith("2.13.0") and "+cu" not in torch, torch
    return RUNTIME


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def container() -> Iterator[Any]:
    """`run(name, image, *args, volume=...)`: a detached container on the host's network,
    read-only, all capabilities dropped; removed (and its volume) afterwards."""
    started: list[tuple[str, str | None]] = []

    def run(name: str, image: str, *args: str, volume: str | None = None) -> str:
        podman("rm", "-f", name, check=False)
        mounts = ["-v", f"{volume}:/models"] if volume else []
        podman("run", "-d", "--name", name, "--network", "host", "--read-only",
               "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--tmpfs", "/tmp",
               *mounts, image, *args)
        started.append((name, volume))
        return name

    try:
        yield run
    finally:
        for name, volume in started:
            logs = podman("logs", "--tail", "40", name, check=False)
            REPORT.setdefault("logs", {})[name] = (logs.stdout + logs.stderr)[-3000:]
            podman("rm", "-f", "-t", "5", name, check=False)
            if volume:
                podman("volume", "rm", "-f", volume, check=False)


def whoami(name: str) -> tuple[str, str]:
    uid = podman("exec", name, "id", "-u").stdout.strip()
    write = podman("exec", name, "sh", "-c", "touch /probe-write 2>&1 || echo read-only",
                   check=False)
    return uid, write.stdout.strip()


def test_cpu_runtime_image_serves_as_non_root_on_a_read_only_root(runtime_image: str,
                                                                  container: Any) -> None:
    port = free_port()
    started = time.monotonic()
    name = container("shoal-image-test-runtime", runtime_image, "--host", "127.0.0.1",
                     "--port", str(port), "--device", "cpu", volume="shoal-image-test-models")
    deadline = time.monotonic() + 900
    ready = None
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < deadline:
            state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running", podman("logs", name, check=False).stderr[-3000:]
            try:
                ready = http.get(f"http://127.0.0.1:{port}/ready")
            except httpx.HTTPError:
                ready = None
            if ready is not None and ready.status_code == 200:
                break
            time.sleep(2)
        assert ready is not None and ready.status_code == 200, "no /ready 200 in 15 min"
        REPORT["runtime_ready_seconds"] = round(time.monotonic() - started, 1)
        models = http.get(f"http://127.0.0.1:{port}/v1/models").json()
        model = models["data"][0]["id"]
        completion = http.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": model, "prompt": "Hello", "max_tokens": 8})
        # structured output (xgrammar) works in the image too (its triton is not installed)
        structured = http.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                               json={"model": model, "max_tokens": 8,
                                     "messages": [{"role": "user", "content": "json please"}],
                                     "response_format": {"type": "json_object"}})
    assert completion.status_code == 200, completion.text
    body = completion.json()
    assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["text"]
    assert structured.status_code == 200, structured.text
    uid, write = whoami(name)
    assert uid == "10001" and "read-only" in write.lower(), (uid, write)


async def test_operator_image_reconciles_against_the_emulator(
        operator_image: str, apiserver: SimpleNamespace, container: Any) -> None:
    # (apiserver first: the container is stopped before the emulator, whose watches it holds)
    api = apiserver.api
    (await api.post("/apis/serving.shoal.dev/v1alpha1/namespaces/serving/inferenceservices",
                    json={"apiVersion": "serving.shoal.dev/v1alpha1",
                          "kind": "InferenceService",
                          "metadata": {"name": "img", "namespace": "serving"},
                          "spec": {"model": {"uri": "hf://org/m"}}})).raise_for_status()
    started = time.monotonic()
    name = container("shoal-image-test-operator", operator_image, "--server", apiserver.url,
                     "--namespace", "serving", "--interval", "1")
    status: dict[str, Any] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        engine = await api.get("/apis/apps/v1/namespaces/serving/deployments/img-engine")
        status = (await api.get("/apis/serving.shoal.dev/v1alpha1/namespaces/serving/"
                                "inferenceservices/img")).json().get("status") or {}
        if engine.status_code == 200 and status.get("phase") == "Pending":
            break
        await asyncio.sleep(0.5)
    assert status.get("phase") == "Pending", podman("logs", name, check=False).stderr[-3000:]
    REPORT["operator_reconciled_seconds"] = round(time.monotonic() - started, 1)
    uid, write = whoami(name)
    assert uid == "10001" and "read-only" in write.lower(), (uid, write)


def teardown_module() -> None:
    print("\nimage-test report:", json.dumps({k: v for k, v in REPORT.items() if k != "logs"},
                                             indent=1))
    (PODMAN_ROOT / "report.json").write_text(json.dumps(REPORT, indent=1))
