"""Kubernetes discovery: the engine Service's ready endpoints, followed through a watch."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
from shoal.runtime.router.replicas.discovery import KubernetesDiscovery, slice_urls

SERVICE = "chat-engine"


def endpoint_slice(name: str, endpoints: list[tuple[str, bool]], service: str = SERVICE,
                   port: int = 8000) -> dict:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": port}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}}
                      for ip, ready in endpoints],
    }


def test_slice_urls_keep_ready_endpoints_of_the_right_service():
    s = endpoint_slice("a", [("10.0.0.1", True), ("10.0.0.2", False)])
    assert slice_urls(s, SERVICE, None) == {"http://10.0.0.1:8000"}
    assert slice_urls(s, SERVICE, 9000) == {"http://10.0.0.1:9000"}
    assert slice_urls(s, "other-service", None) == set()
    v6 = endpoint_slice("b", [("fd00::1", True)])
    assert slice_urls(v6, SERVICE, None) == {"http://[fd00::1]:8000"}


async def test_list_then_watch_follows_pods(wait_for):
    listing = {"metadata": {"resourceVersion": "7"}, "items": [
        endpoint_slice("s1", [("10.0.0.1", True), ("10.0.0.2", False)]),
        endpoint_slice("s2", [("10.0.1.1", True)]),
        endpoint_slice("x", [("10.9.9.9", True)], service="unrelated"),  # selector ignored
    ]}
    events = [
        {"type": "MODIFIED", "object": endpoint_slice("s1", [("10.0.0.1", True),
                                                             ("10.0.0.2", True)])},
        {"type": "DELETED", "object": endpoint_slice("s2", [])},
    ]
    seen_params: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen_params.append(dict(request.url.params))
        assert request.headers["authorization"] == "Bearer t0ken"
        if request.url.params.get("watch") == "true":
            async def stream():
                for event in events:
                    await asyncio.sleep(0.01)
                    yield (json.dumps(event) + "\n").encode()
                await asyncio.sleep(3600)  # a watch stays open
            return httpx.Response(200, content=stream())
        return httpx.Response(200, json=listing)

    discovery = KubernetesDiscovery("prod", SERVICE, None, api_url="http://api", token="t0ken",
                                    transport=httpx.MockTransport(handler))
    published: list[set[str]] = []
    task = asyncio.create_task(discovery.run(published.append))
    try:
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(published) >= 3:
                break
    finally:
        task.cancel()
    assert published[0] == {"http://10.0.0.1:8000", "http://10.0.1.1:8000"}
    assert published[1] == {"http://10.0.0.1:8000", "http://10.0.0.2:8000",
                            "http://10.0.1.1:8000"}
    assert published[2] == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    assert seen_params[0]["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"
    assert seen_params[1]["resourceVersion"] == "7"


def _slice_for(url: str, name: str) -> dict:
    host, port = url.removeprefix("http://").split(":")
    return endpoint_slice(name, [(host, True)], port=int(port))


def test_shoal_route_follows_the_engine_service_endpoints(spawn, free_port, wait_for):
    """A real router process with --discovery kubernetes against a fake API server: pods
    that join get traffic, a slice that goes away stops getting it."""
    here = Path(__file__).parent
    engines = []
    for i in (2, 3):
        host = f"127.0.0.{i}"
        port = free_port(host)
        spawn([sys.executable, str(here / "fake_engine.py"), "--host", host, "--port", str(port)])
        engines.append(f"http://{host}:{port}")
    api_port = free_port("127.0.0.1")
    api = f"http://127.0.0.1:{api_port}"
    spawn([sys.executable, str(here / "fake_kube_api.py"), "--host", "127.0.0.1",
           "--port", str(api_port), "--initial", json.dumps([_slice_for(engines[0], "s-a")])])
    router_port = free_port("127.0.0.1")
    router = f"http://127.0.0.1:{router_port}"
    for url in engines:
        wait_for(lambda u=url: _ok(f"{u}/ready"), what=url)
    wait_for(lambda: _ok(f"{api}/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"),
             what="fake api")
    spawn([sys.executable, "-m", "shoal.runtime.router.cli", "--host", "127.0.0.1",
           "--port", str(router_port), "--discovery", "kubernetes", "--kube-api", api,
           "--namespace", "ml", "--service", SERVICE, "--policy", "round-robin",
           "--health-interval", "0.2"])
    wait_for(lambda: _ok(f"{router}/ready"), what="router ready")

    def served_by() -> set[str]:
        replicas = set()
        for k in range(4):
            r = httpx.post(f"{router}/v1/completions", json={"prompt": f"p{k}"}, timeout=10)
            replicas.add(r.json()["replica"])
        return replicas

    name = [e.removeprefix("http://") for e in engines]
    assert served_by() == {name[0]}
    httpx.post(f"{api}/admin/event", timeout=5,
               json={"type": "ADDED", "object": _slice_for(engines[1], "s-b")})
    wait_for(lambda: served_by() == {name[0], name[1]}, timeout=10, what="new pod in rotation")
    httpx.post(f"{api}/admin/event", timeout=5,
               json={"type": "DELETED", "object": _slice_for(engines[0], "s-a")})
    wait_for(lambda: served_by() == {name[1]}, timeout=10, what="removed pod out of rotation")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
