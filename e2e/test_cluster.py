"""On a real cluster: helm install, the CPU demo to Ready, one chat through the router Service,
and `kubectl get inferenceservices` showing replicas and KV-cache columns."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(2400)]

ROOT = Path(__file__).parents[1]
OPERATOR_NS = "shoal-system"
NS = "shoal-e2e"
READY_TIMEOUT = float(os.environ.get("SHOAL_E2E_TIMEOUT", "1200"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _demo(runtime_image: str) -> str:
    docs = list(yaml.safe_load_all((ROOT / "examples" / "cpu-demo.yaml").read_text()))
    for doc in docs:
        doc["spec"]["runtime"]["image"] = runtime_image
        doc["spec"]["runtime"]["imagePullPolicy"] = "IfNotPresent"
    return yaml.safe_dump_all(docs)


def _wait_ready(cluster: Any) -> dict[str, Any]:
    deadline = time.monotonic() + READY_TIMEOUT
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        out = cluster.run("kubectl", "get", "inferenceservice", "demo", "-n", NS, "-o", "json",
                          check=False)
        if out.returncode == 0:
            last = json.loads(out.stdout)
            status = last.get("status") or {}
            if status.get("phase") == "Ready" and status.get("readyReplicas") == 2:
                return last
        time.sleep(5)
    raise AssertionError(f"demo not Ready after {READY_TIMEOUT}s: "
                         f"{json.dumps(last.get('status'), indent=1)}")


def test_cpu_demo_end_to_end(cluster: Any) -> None:
    image, _, tag = cluster.operator_image.rpartition(":")
    try:
        cluster.run("helm", "upgrade", "--install", "shoal", str(ROOT / "charts" / "shoal"),
                    "--namespace", OPERATOR_NS, "--create-namespace",
                    "--set", f"image.repository={image}", "--set", f"image.tag={tag}",
                    "--set", "image.pullPolicy=IfNotPresent", "--wait", "--timeout", "5m")
        cluster.run("kubectl", "create", "namespace", NS, check=False)
        cluster.run("kubectl", "apply", "-n", NS, "-f", "-",
                    input_text=_demo(cluster.runtime_image))
        isvc = _wait_ready(cluster)
        assert isvc["status"]["ready"] == "2/2"

        # Every engine pod passed its readiness gate (set by the operator from /ready).
        pods = json.loads(cluster.run(
            "kubectl", "get", "pods", "-n", NS, "-l",
            "serving.shoal.dev/inference-service=demo,serving.shoal.dev/component=engine",
            "-o", "json").stdout)["items"]
        assert len(pods) == 2
        for pod in pods:
            gate = next(c for c in pod["status"]["conditions"]
                        if c["type"] == "serving.shoal.dev/engine-ready")
            assert gate["status"] == "True"

        # One chat request through the router Service.
        port = _free_port()
        forward = subprocess.Popen([cluster.kubectl, "port-forward", "-n", NS, "svc/demo",
                                    f"{port}:80"], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
                        "model": "shoal-demo", "max_tokens": 8,
                        "messages": [{"role": "user", "content": "Say hello."}]}, timeout=60)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["role"] == "assistant"
        finally:
            forward.terminate()
            forward.wait(timeout=10)

        # kubectl shows ready/desired, KV%, HIT%, QUEUE, MODEL, PHASE.
        table = cluster.run("kubectl", "get", "inferenceservices", "-n", NS).stdout.splitlines()
        assert table[0].split() == ["NAME", "READY", "KV%", "HIT%", "QUEUE", "MODEL", "PHASE",
                                    "AGE"]
        row = table[1].split()
        assert row[0] == "demo" and row[1] == "2/2" and row[5] == "shoal-demo" \
            and row[6] == "Ready"
        short = cluster.run("kubectl", "get", "infsvc", "-n", NS, "-o", "name").stdout
        assert "demo" in short
    finally:
        if not os.environ.get("SHOAL_E2E_KEEP"):
            cluster.run("kubectl", "delete", "namespace", NS, "--wait=false", check=False)
            cluster.run("helm", "uninstall", "shoal", "--namespace", OPERATOR_NS, check=False)
