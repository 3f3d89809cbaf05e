"""The real operator process against the emulator: InferencePool + HTTPRoute only once their
CRDs are served (a clear condition and Event before, no crash), and scale to and from zero end
to end (fake kubelet + EndpointSlices, real `shoal serve` engines, the real router process
run with the arguments the operator rendered for it)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.k8s.test_operator_integration import ISVC_PATH, NS, condition, get, wait_for
from tests.k8s.test_render_gateway import admitted, schema

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


def isvc(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"uri": "builtin://default", "servedName": "demo"},
                     "runtime": {"device": "cpu", "maxNumSeqs": 16},
                     "resources": {"gpus": 0}, "startup": {"timeoutSeconds": 120}, **spec}}


async def events(api: httpx.AsyncClient, reason: str) -> list[dict[str, Any]]:
    listing = (await api.get(f"/api/v1/namespaces/{NS}/events")).json()["items"]
    return [e for e in listing if e.get("reason") == reason]


async def test_inference_pool_waits_for_its_crds_then_is_rendered_valid(
        apiserver: SimpleNamespace, operator_process: Any) -> None:
    api = apiserver.api
    body = isvc("chat", replicas=1, routing={"gateway": {
        "inferencePool": True, "gatewayRef": {"name": "inference-gw", "namespace": "gateways"}}})
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()

    async def gateway_condition() -> dict[str, Any] | None:
        obj = await get(api, f"{ISVC_PATH}/chat")
        conditions = ((obj or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "GatewayReady"), None)

    missing = await wait_for(gateway_condition, "GatewayReady condition", timeout=60,
                             operator=operator_process)
    assert (missing["status"], missing["reason"]) == ("False", "GatewayAPINotInstalled")
    assert "inferencepools.inference.networking.k8s.io/v1" in missing["message"]
    assert "httproutes.gateway.networking.k8s.io/v1" in missing["message"]
    assert len(await events(api, "GatewayAPINotInstalled")) == 1
    assert await get(api, f"{DEPLOYMENTS}/chat-engine") is not None  # the rest converges
    assert operator_process.process.poll() is None  # no crash

    # The CRDs get installed: the next rounds render the pool, its picker and the route.
    install_gateway_crds(apiserver.emulator)
    pool = await wait_for(lambda: get(
        api, f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/chat"),
        "InferencePool", timeout=60, operator=operator_process)
    route = await wait_for(lambda: get(
        api, f"/apis/gateway.networking.k8s.io/v1/namespaces/{NS}/httproutes/chat"),
        "HTTPRoute", timeout=30, operator=operator_process)
    served = {k: v for k, v in pool.items() if k != "status"}  # as stored, minus server fields
    for field in ("uid", "generation", "resourceVersion", "creationTimestamp"):
        served["metadata"].pop(field, None)
    assert admitted(served, schema("inferencepool.v1.schema.yaml")) == []
    route_served = {**route, "metadata": {k: v for k, v in route["metadata"].items()
                                          if k not in ("uid", "generation", "resourceVersion",
                                                       "creationTimestamp")}}
    assert admitted(route_served, schema("httproute.v1.schema.yaml")) == []
    epp = await wait_for(lambda: get(api, f"{DEPLOYMENTS}/chat-epp"), "EPP Deployment",
                         operator=operator_process)
    assert "--epp" in epp["spec"]["template"]["spec"]["containers"][0]["args"]
    engine = await get(api, f"{DEPLOYMENTS}/chat-engine")
    assert engine is not None
    assert "--metrics-compat" in engine["spec"]["template"]["spec"]["containers"][0]["args"]

    async def pool_in_status() -> dict[str, Any] | None:
        obj = await get(api, f"{ISVC_PATH}/chat")
        status = (obj or {}).get("status") or {}
        return status if (status.get("gateway") or {}).get("inferencePool") else None

    status = await wait_for(pool_in_status, "status.gateway", operator=operator_process)
    assert status["gateway"] == {"inferencePool": "chat", "endpointPicker": "chat-epp",
                                 "httpRoute": "chat"}
    ok = condition(status, "GatewayReady")
    assert (ok["status"], ok["reason"]) == ("True", "InferencePoolRendered")


def install_gateway_crds(emulator: Any) -> None:
    import kmock

    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    emulator.resources["inference.networking.k8s.io/v1/inferencepools"] = \
        kmock.ResourceInfo(kind="InferencePool", namespaced=True, verbs=verbs)
    emulator.resources["gateway.networking.k8s.io/v1/httproutes"] = \
        kmock.ResourceInfo(kind="HTTPRoute", namespaced=True, verbs=verbs)


async def test_removing_the_gateway_block_prunes_pool_route_and_picker(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type) -> None:
    api = apiserver.api
    install_gateway_crds(apiserver.emulator)
    pools = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
    routes = f"/apis/gateway.networking.k8s.io/v1/namespaces/{NS}/httproutes"
    # an InferencePool someone else made, with our labels but no owner reference: not ours
    stranger = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": "hand-made", "namespace": NS, "labels": {
                    "serving.shoal.dev/inference-service": "gw",
                    "app.kubernetes.io/managed-by": "shoal-operator"}},
                "spec": {"selector": {"matchLabels": {"app": "x"}},
                         "targetPorts": [{"number": 8000}]}}
    (await api.post(pools, json=stranger)).raise_for_status()
    body = isvc("gw", replicas=1, routing={"gateway": {
        "inferencePool": True, "gatewayRef": {"name": "inference-gw"}}})
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="gw-engine",
                               start_engine=standin_engines)
    kubelet_task = asyncio.create_task(kubelet.run())
    try:
        async def ready() -> dict[str, Any] | None:
            status = ((await get(api, f"{ISVC_PATH}/gw")) or {}).get("status") or {}
            return status if status.get("phase") == "Ready" else None

        await wait_for(lambda: get(api, f"{routes}/gw"), "HTTPRoute", timeout=60,
                       operator=operator_process)
        assert await get(api, f"{pools}/gw") is not None
        assert await get(api, f"{DEPLOYMENTS}/gw-epp") is not None
        await wait_for(ready, "engine ready", timeout=60, operator=operator_process)

        (await api.patch(f"{ISVC_PATH}/gw", json={"spec": {"routing": {"gateway": None}}},
                         headers={"Content-Type": "application/merge-patch+json"})
         ).raise_for_status()

        async def pruned() -> bool:
            return all([await get(api, f"{pools}/gw") is None,
                        await get(api, f"{routes}/gw") is None,
                        await get(api, f"{DEPLOYMENTS}/gw-epp") is None])

        await wait_for(pruned, "pool, route and picker pruned", timeout=60,
                       operator=operator_process)
        assert await get(api, f"/api/v1/namespaces/{NS}/services/gw-epp") is None
        assert await get(api, f"/api/v1/namespaces/{NS}/serviceaccounts/gw-epp") is None
        assert await get(api, f"{pools}/hand-made") is not None  # never ours to delete
        assert await get(api, f"{DEPLOYMENTS}/gw-engine") is not None
        assert await get(api, f"{DEPLOYMENTS}/gw-router") is not None
        (event,) = await events(api, "Pruned")
        assert "InferencePool/gw" in event["message"] and "HTTPRoute/gw" in event["message"]
        status = await wait_for(ready, "engine still serving", timeout=60,
                                operator=operator_process)
        assert "gateway" not in status  # nor a stale GatewayReady condition
        assert [c for c in status["conditions"] if c["type"] == "GatewayReady"] == []
    finally:
        kubelet_task.cancel()
        await asyncio.gather(kubelet_task, return_exceptions=True)
        kubelet.stop_all()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_router(args: list[str], apiserver_url: str, engine_port: int, log: Path,
                 *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    """The router as the operator rendered it, on loopback, talking to the emulator."""
    port = _free_port()
    shoal = Path(sys.executable).with_name("shoal")
    process = subprocess.Popen(
        [str(shoal), *args, "--host", "127.0.0.1", "--port", str(port),
         "--kube-api", apiserver_url, "--engine-port", str(engine_port),
         "--health-interval", "0.2", *extra],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(15)


async def test_scale_to_zero_and_back_with_held_requests(
        apiserver: SimpleNamespace, operator_process: Any, real_engines: Any,
        fake_kubelet_cls: type, engine_port: int, tmp_path: Path) -> None:
    api = apiserver.api
    # the idle window starts when the engine is ready (the status turns Ready in the same
    # round): 10 s is what the test has to see phase Ready, polling every 0.25 s
    body = isvc("lazy", replicas=1, autoscaling={
        "minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 10,
        "holdTimeoutSeconds": 180})
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="lazy-engine",
                               start_engine=real_engines, termination_message=real_engines.log_tail,
                               endpoints_service="lazy-engine", endpoints_port=engine_port)
    kubelet_task = asyncio.create_task(kubelet.run(period=0.2))
    routers: list[subprocess.Popen[bytes]] = []
    try:
        async def status_of() -> dict[str, Any]:
            return ((await get(api, f"{ISVC_PATH}/lazy")) or {}).get("status") or {}

        async def phase(name: str) -> dict[str, Any] | None:
            if kubelet_task.done():  # the test's kubelet broke: say why, not "timed out"
                kubelet_task.result()
            status = await status_of()
            return status if status.get("phase") == name else None

        await wait_for(lambda: phase("Ready"), "one engine ready", timeout=120,
                       operator=operator_process)
        router_dep = await get(api, f"{DEPLOYMENTS}/lazy-router")
        assert router_dep is not None
        args = router_dep["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--capacity-request" in args and "--hold-timeout" in args
        router, router_url = start_router(args, apiserver.url, engine_port,
                                          tmp_path / "router.log")
        routers.append(router)

        # Idle: after scaleToZeroAfterSeconds without a request, 0 replicas, phase Idle.
        async def idle_at_zero() -> dict[str, Any] | None:
            status = await phase("Idle")  # the round that scales down still sees the pod: 1/0
            return status if status and status["ready"] == "0/0" else None

        idle = await wait_for(idle_at_zero, "scaled to zero", timeout=90,
                              operator=operator_process)
        assert idle["desiredReplicas"] == 0
        deployment = await get(api, f"{DEPLOYMENTS}/lazy-engine")
        assert deployment is not None and deployment["spec"]["replicas"] == 0
        await wait_for(lambda: asyncio.sleep(0, result=not kubelet.pods), "pods gone")
        assert (await get(api, f"{ISVC_PATH}/lazy"))["spec"]["replicas"] == 0
        assert [e for e in await events(api, "Scaled") if "-> 0" in e["message"]]

        # A router that holds only briefly (and asks nobody): 503 with Retry-After.
        plain = list(args)
        i = plain.index("--capacity-request")
        del plain[i:i + 2]
        short, short_url = start_router(plain, apiserver.url, engine_port,
                                        tmp_path / "short-router.log", "--hold-timeout", "1")
        routers.append(short)
        async with httpx.AsyncClient(timeout=30) as http:
            await wait_for(lambda: _up(http, short_url), "short router up")
            refused = await http.post(f"{short_url}/v1/completions",
                                      json={"model": "demo", "prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert (await get(api, f"{ISVC_PATH}/lazy"))["spec"]["replicas"] == 0  # nobody asked

        # A burst of 10 at zero: held, capacity asked for, all served once the engine is up.
        results: list[tuple[int, float]] = []
        first_sent: list[float] = []
        async with httpx.AsyncClient(timeout=240) as http:
            await wait_for(lambda: _up(http, router_url), "router up")

            async def one(i: int) -> None:
                request = {"model": "demo", "prompt": f"request {i} of the burst",
                           "max_tokens": 4, "stream": True, "ignore_eos": True}
                first_sent.append(time.monotonic())
                first_token = 0.0
                async with http.stream("POST", f"{router_url}/v1/completions",
                                       json=request) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {") and not first_token:
                            first_token = time.monotonic()
                    results.append((response.status_code, first_token))

            await asyncio.gather(*(one(i) for i in range(10)))
        assert [code for code, _ in results] == [200] * 10
        print(f"scale from zero: first held request -> first token "
              f"{min(t for _, t in results) - min(first_sent):.2f} s")
        status = await status_of()
        assert status["autoscaler"]["capacityRequestSeen"]
        assert [e for e in await events(api, "Scaled") if "0 -> 1" in e["message"]]
        # none lost, none duplicated: the engine finished exactly ten requests
        (pod,) = kubelet.pods.values()
        async with httpx.AsyncClient(timeout=5) as http:
            text = (await http.get(f"http://{pod.ip}:{engine_port}/metrics")).text
        from shoal.contract.metrics import parse_samples

        assert parse_samples(text)["shoal:request_success_total"] == 10
    finally:
        for process in routers:
            stop(process)
        kubelet_task.cancel()
        await asyncio.gather(kubelet_task, return_exceptions=True)
        kubelet.stop_all()


async def _up(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False
