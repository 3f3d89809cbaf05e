"""P/D's prefill pods found through the prefill Service's EndpointSlices (``--prefill-service``),
with real router processes against a stand-in API server (``fake_kube_api.py``: list + watch,
ready endpoints only) and stand-in engines that answer a prefill leg with
``kv_transfer_params`` (``fake_engine.py``).

* The decode side's sidecar honours ``x-prefiller-host-port`` for a ready prefill pod by its
  own IP (what llm-d's picker names), follows pods joining and leaving, and refuses any other
  address (the decode engine then computes the prompt).
* The router with a prefill Service scaled to zero sends the prompt to the decode engine as it
  came, counts ``failed``/``no_prefill_replica`` and asks the operator for a prefill replica
  (the prefill capacity annotation); once a prefill pod is ready, long prompts go through it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from tests.router.conftest import http_ok
from tests.router.test_discovery import endpoint_slice

HERE = Path(__file__).parent
NS = "ml"
PREFILL_SERVICE = "m-prefill"
PREFILLER = "x-prefiller-host-port"
ANNOTATION = "serving.shoal.dev/prefill-capacity-requested-at"


def start_engines(spawn, free_port, hosts: list[str]) -> list[str]:
    urls = []
    for host in hosts:
        port = free_port(host)
        spawn([sys.executable, str(HERE / "fake_engine.py"), "--host", host, "--port", str(port)])
        urls.append(f"http://{host}:{port}")
    return urls


def start_api(spawn, free_port, wait_for, slices: list[dict]) -> str:
    port = free_port("127.0.0.1")
    api = f"http://127.0.0.1:{port}"
    spawn([sys.executable, str(HERE / "fake_kube_api.py"), "--host", "127.0.0.1",
           "--port", str(port), "--initial", json.dumps(slices)])
    wait_for(lambda: http_ok(f"{api}/admin/patches"), what="fake api")
    return api


def pod_slice(name: str, urls: list[str], service: str = PREFILL_SERVICE) -> dict:
    """One EndpointSlice of ``service`` with these engines as its ready pods (one port)."""
    hosts = [u.removeprefix("http://").split(":")[0] for u in urls]
    port = int(urls[0].rsplit(":", 1)[1]) if urls else 8000
    return endpoint_slice(name, [(h, True) for h in hosts], service=service, port=port)


def event(api: str, kind: str, obj: dict) -> None:
    httpx.post(f"{api}/admin/event", json={"type": kind, "object": obj},
               timeout=5).raise_for_status()


def state(engine: str) -> dict:
    return httpx.get(f"{engine}/admin", timeout=5).json()


def pd_decisions(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {(s.labels["decision"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "shoal:router_pd_decisions_total"}


def test_the_sidecar_allows_the_prefill_services_ready_pods_by_ip(spawn, free_port, wait_for):
    decode, pod_a, pod_b = start_engines(spawn, free_port,
                                         ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    # two slices, as the EndpointSlice controller may split a Service: one per pod here
    api = start_api(spawn, free_port, wait_for, [pod_slice("pf-a", [pod_a])])
    port = free_port("127.0.0.1")
    sidecar = f"http://127.0.0.1:{port}"
    spawn([sys.executable, "-m", "shoal.runtime.router.cli", "--host", "127.0.0.1",
           "--port", str(port), "--pd-sidecar", "--backend", decode,
           "--prefill-service", PREFILL_SERVICE, "--namespace", NS, "--kube-api", api,
           "--health-interval", "0.2"])
    for url in (decode, pod_a, pod_b, sidecar):
        wait_for(lambda u=url: http_ok(f"{u}/ready"), what=url)

    def send(named: str) -> dict | None:
        """The picker names ``named``; what the decode engine was handed."""
        answer = httpx.post(f"{sidecar}/v1/completions", timeout=10,
                            headers={PREFILLER: named.removeprefix("http://")},
                            json={"model": "m", "prompt": "a long prompt", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        return state(decode)["kv_params"][-1]

    def remote(params: dict | None, pod: str) -> bool:
        return bool(params) and params["remote_engine_id"] == pod.removeprefix("http://")

    wait_for(lambda: remote(send(pod_a), pod_a), timeout=10, what="pod A allowed")
    assert state(pod_a)["prefilled"] >= 1
    assert send(pod_b) is None  # not a ready prefill pod: the decode engine computes it
    assert state(pod_b).get("prefilled", 0) == 0
    assert send("169.254.169.254:80") is None

    event(api, "ADDED", pod_slice("pf-b", [pod_b]))  # a second prefill pod becomes ready
    wait_for(lambda: remote(send(pod_b), pod_b), timeout=10, what="pod B allowed once ready")
    event(api, "DELETED", pod_slice("pf-a", [pod_a]))  # pod A goes away
    wait_for(lambda: send(pod_a) is None, timeout=10, what="pod A refused once gone")
    decisions = pd_decisions(sidecar)
    assert decisions[("remote", "picker_named")] >= 2
    assert decisions[("refused", "not_allowed")] >= 3


def test_a_router_over_a_prefill_service_at_zero_decodes_and_asks_for_a_prefill_pod(
        spawn, free_port, wait_for):
    decode, pod_a = start_engines(spawn, free_port, ["127.0.0.2", "127.0.0.3"])
    # the decode Service has its pod; the prefill Service has none (scaled to zero)
    api = start_api(spawn, free_port, wait_for, [pod_slice("m-engine-a", [decode], "m-engine")])
    port = free_port("127.0.0.1")
    router = f"http://127.0.0.1:{port}"
    spawn([sys.executable, "-m", "shoal.runtime.router.cli", "--host", "127.0.0.1",
           "--port", str(port), "--discovery", "kubernetes", "--service", "m-engine",
           "--prefill-service", PREFILL_SERVICE, "--pd-threshold", "4",
           "--capacity-request", "m", "--namespace", NS, "--kube-api", api,
           "--health-interval", "0.2"])
    for url in (decode, pod_a, router):
        wait_for(lambda u=url: http_ok(f"{u}/ready"), what=url)
    long_prompt = {"model": "m", "prompt": "word " * 200, "max_tokens": 2}

    for _ in range(3):  # every prompt answered by the decode engine, none held
        answer = httpx.post(f"{router}/v1/completions", json=long_prompt, timeout=10)
        assert answer.status_code == 200 and answer.json()["replica"] == \
            decode.removeprefix("http://")
    assert state(decode)["kv_params"] == [None] * 3
    assert pd_decisions(router)[("failed", "no_prefill_replica")] == 3
    # one ask for the three prompts (at most one per 10 s), on the prefill annotation
    asks = wait_for(lambda: httpx.get(f"{api}/admin/patches", timeout=5).json(),
                    timeout=10, what="the prefill capacity request")
    assert len(asks) == 1 and asks[0]["name"] == "m"
    assert asks[0]["content_type"] == "application/merge-patch+json"
    assert list(asks[0]["body"]["metadata"]["annotations"]) == [ANNOTATION]

    event(api, "ADDED", pod_slice("pf-a", [pod_a]))  # the operator scaled the pool to 1

    def through_prefill() -> bool:
        httpx.post(f"{router}/v1/completions", json=long_prompt, timeout=10).raise_for_status()
        params = state(decode)["kv_params"][-1]
        return bool(params) and params["remote_host"] == "127.0.0.3"
    wait_for(through_prefill, timeout=10, what="long prompts through the new prefill pod")
    short = httpx.post(f"{router}/v1/completions", timeout=10,
                       json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert short.status_code == 200 and state(decode)["kv_params"][-1] is None
