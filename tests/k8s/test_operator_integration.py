"""The real operator process against kmock's API-server emulator, with the test as the kubelet.

The operator probes real HTTP /ready and scrapes real /metrics of one engine process per pod
(127.0.0.N). The lifecycle test runs a real `shoal serve --host 127.0.0.N` (tiny Qwen3, CPU)
per pod. The restart test uses the stand-in engine (standin_engine.py, same HTTP contract)
because it checks aggregates of exact KV usage / queue depth / hit counts per replica, which a
real engine cannot be made to report on demand.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NS = "serving"
GATE = "serving.shoal.dev/engine-ready"
ISVC_PATH = f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/inferenceservices"


def service_body(name: str, replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"uri": "builtin://default", "servedName": "demo"},
            "runtime": {"device": "cpu", "maxNumSeqs": 16},
            "resources": {"gpus": 0},
            "replicas": replicas,
            "startup": {"timeoutSeconds": 120},
        },
    }


async def wait_for(check: Callable[[], Awaitable[Any]], what: str, timeout: float = 30.0,
                   operator: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.25)
    tail = operator.log_tail() if operator is not None else ""
    raise AssertionError(f"timed out waiting for {what}\n--- operator log ---\n{tail}")


async def get(api: httpx.AsyncClient, path: str) -> dict[str, Any] | None:
    response = await api.get(path)
    return response.json() if response.status_code == 200 else None


async def items(api: httpx.AsyncClient, path: str) -> list[dict[str, Any]]:
    return (await api.get(path)).json()["items"]


def gate(pod: dict[str, Any]) -> str | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond["type"] == GATE:
            return cond["status"]
    return None


def json_path(obj: dict[str, Any], path: str) -> Any:
    """The simple `.a.b.c` JSONPaths printer columns use."""
    value: Any = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions") or [] if c["type"] == kind)


async def engine_totals(pod_ips: list[str], port: int) -> tuple[float, float, float]:
    """(mean KV usage, prefix hit tokens, prefix query tokens) as the engines report them."""
    from shoal.contract.metrics import parse_engine_metrics

    async with httpx.AsyncClient(timeout=5) as http:
        scraped = [parse_engine_metrics((await http.get(f"http://{ip}:{port}/metrics")).text)
                   for ip in pod_ips]
    return (sum(m.kv_cache_usage for m in scraped) / len(scraped),
            sum(m.prefix_cache_hits for m in scraped),
            sum(m.prefix_cache_queries for m in scraped))


async def test_lifecycle_gate_status_failure_recovery_and_spec_change(
        apiserver: SimpleNamespace, operator_process: Any, real_engines: Any,
        fake_kubelet_cls: type, engine_port: int, crd: dict[str, Any]) -> None:
    api = apiserver.api
    (await api.post(ISVC_PATH, json=service_body("demo"))).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="demo-engine",
                               start_engine=real_engines,
                               termination_message=real_engines.log_tail)
    kubelet_task = asyncio.create_task(kubelet.run())
    try:
        isvc = await get(api, f"{ISVC_PATH}/demo")
        assert isvc is not None
        uid = isvc["metadata"]["uid"]

        # Children appear, each owned by the InferenceService (controller reference).
        dep_path = f"/apis/apps/v1/namespaces/{NS}/deployments"
        engine = await wait_for(lambda: get(api, f"{dep_path}/demo-engine"),
                                "engine Deployment", operator=operator_process)
        assert engine["spec"]["replicas"] == 2
        assert engine["spec"]["template"]["spec"]["readinessGates"] == [{"conditionType": GATE}]
        for path in (f"{dep_path}/demo-router", f"/api/v1/namespaces/{NS}/services/demo",
                     f"/api/v1/namespaces/{NS}/services/demo-engine",
                     f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/demo-engine"):
            child = await wait_for(lambda p=path: get(api, p), path, operator=operator_process)
            owner = child["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["uid"], owner["controller"]) == (
                "InferenceService", uid, True)

        # The gate is never True while the engine's own /ready says 503; it flips after.
        pods_path = f"/api/v1/namespaces/{NS}/pods"
        seen_gated = False
        probe = httpx.AsyncClient(timeout=1)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            pods = await items(api, pods_path)
            if len(pods) == 2 and all(gate(p) == "True" for p in pods):
                break
            for pod in pods:
                try:
                    ready = (await probe.get(
                        f"http://{pod['status']['podIP']}:{engine_port}/ready")).status_code
                except httpx.HTTPError:
                    continue
                if ready == 503:
                    fresh = await get(api, f"{pods_path}/{pod['metadata']['name']}")
                    assert fresh is not None and gate(fresh) != "True", \
                        "readiness gate True while /ready answers 503"
                    seen_gated = True
            await asyncio.sleep(0.2)
        await probe.aclose()
        assert seen_gated, "never observed an engine still loading"
        pods = await items(api, pods_path)
        assert len(pods) == 2 and all(gate(p) == "True" for p in pods)

        # A long generation on one engine fills its KV cache: the status shows it while it runs.
        pod_ips = sorted(p["status"]["podIP"] for p in pods)
        busy_pod = next(p["metadata"]["name"] for p in pods
                        if p["status"]["podIP"] == pod_ips[0])

        async def generate_long() -> None:
            async with httpx.AsyncClient(timeout=120) as http, http.stream(
                    "POST", f"http://{pod_ips[0]}:{engine_port}/v1/completions", json={
                        "model": "demo", "prompt": "hello " * 100, "max_tokens": 3000,
                        "ignore_eos": True, "stream": True}) as response:
                async for _ in response.aiter_lines():
                    pass
        generation = asyncio.create_task(generate_long())

        async def kv_in_status() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/demo")
            st = (obj or {}).get("status") or {}
            entry = next((r for r in st.get("replicaStatus") or [] if r["name"] == busy_pod), {})
            return st if (st.get("kvCacheUsage") or 0) > 0 and entry.get("running") == 1 \
                and (entry.get("kvCacheUsage") or 0) > 0 else None
        try:
            status = await wait_for(kv_in_status, "KV usage of a running request in status",
                                    timeout=40, operator=operator_process)
        finally:
            generation.cancel()  # the client goes away: the engine aborts and frees the blocks
        assert status["runningRequests"] == 1 and status["kvCacheUsagePercent"] >= 1
        assert not generation.done() or generation.cancelled()

        async def engines_idle() -> bool:
            async with httpx.AsyncClient(timeout=5) as http:
                text = (await http.get(f"http://{pod_ips[0]}:{engine_port}/metrics")).text
            return 'shoal:num_requests_running{model_name="demo"} 0.0' in text
        await wait_for(engines_idle, "the aborted request to leave the engine")

        # Traffic on one engine: the same long prompt twice, so its prefix cache has hits.
        prompt = " ".join(f"word{i}" for i in range(120))
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(2):
                (await http.post(f"http://{pod_ips[0]}:{engine_port}/v1/completions", json={
                    "model": "demo", "prompt": prompt, "max_tokens": 2})).raise_for_status()
        kv, hits, queries = await engine_totals(pod_ips, engine_port)
        assert hits > 0 and queries > hits

        # Status from real /ready and /metrics; every printer column resolves on it.
        async def ready_status() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/demo")
            st = (obj or {}).get("status") or {}
            # (a scrape taken while the second request was in flight has its hits but also
            # its blocks: wait for one taken after, which matches the engines' idle figures)
            return obj if st.get("phase") == "Ready" and \
                st.get("prefixCacheHitRate") == round(hits / queries, 4) and \
                st.get("kvCacheUsage") == round(kv, 4) else None
        isvc = await wait_for(ready_status, "phase Ready with the engines' KV and hit rate",
                              operator=operator_process)
        status = isvc["status"]
        assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
        assert status["kvCacheUsage"] == round(kv, 4)
        assert status["observedGeneration"] == isvc["metadata"]["generation"]
        assert {r["phase"] for r in status["replicaStatus"]} == {"ready"}
        columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
        shown = {c["name"]: json_path(isvc, c["jsonPath"]) for c in columns}
        # Prefill (-o wide) is empty without spec.prefill: kubectl prints <none>
        assert shown == {"Ready": "2/2", "Prefill": None, "KV%": round(kv * 100),
                         "Hit%": round(hits / queries * 100), "Queue": 0, "Model": "demo",
                         "Phase": "Ready", "Age": isvc["metadata"]["creationTimestamp"]}
        assert condition(status, "Ready")["status"] == "True"

        # A rank dies (its engine-core process is killed): the engine exits non-zero by itself,
        # and the service turns Degraded with the reason; the pod's gate goes False.
        victim = sorted(kubelet.pods)[0]
        exit_code = await asyncio.to_thread(kubelet.kill_rank, victim)
        assert exit_code != 0

        async def degraded() -> dict[str, Any] | None:
            # (The engine first reports phase "dead" on /ready, then exits; wait for the exit.)
            obj = await get(api, f"{ISVC_PATH}/demo")
            st = (obj or {}).get("status") or {}
            entry = next((r for r in st.get("replicaStatus") or [] if r["name"] == victim), {})
            return st if st.get("phase") == "Degraded" and entry.get("restarts") == 1 and \
                condition(st, "Degraded")["reason"] == "RankFailure" else None
        status = await wait_for(degraded, "Degraded/RankFailure", operator=operator_process)
        assert status["readyReplicas"] == 1 and status["ready"] == "1/2"
        assert victim in condition(status, "Degraded")["message"]
        entry = next(r for r in status["replicaStatus"] if r["name"] == victim)
        assert entry["restarts"] == 1 and entry["lastFailure"]["reason"] == "RankFailure"
        assert f"code {exit_code}" in entry["lastFailure"]["message"]
        assert gate(await get(api, f"{pods_path}/{victim}") or {}) == "False"
        events = await items(api, f"/api/v1/namespaces/{NS}/events")
        assert any(e["reason"] == "RankFailure" and victim in e["message"] for e in events)

        # The container restarts: back to Ready, gate True again.
        await kubelet.restart_engine(victim)

        async def ready_again() -> bool:
            obj = await get(api, f"{ISVC_PATH}/demo")
            return ((obj or {}).get("status") or {}).get("phase") == "Ready"
        await wait_for(ready_again, "Ready after restart", timeout=60, operator=operator_process)
        assert gate(await get(api, f"{pods_path}/{victim}") or {}) == "True"

        # A spec change reaches the children; pods of the new template become the updated ones.
        old_hash = engine["spec"]["template"]["metadata"]["annotations"][
            "serving.shoal.dev/template-hash"]
        patch = {"spec": {"runtime": {"maxNumSeqs": 8}, "routing": {"policy": "least-load"}}}
        (await api.patch(f"{ISVC_PATH}/demo", json=patch,
                         headers={"Content-Type": "application/merge-patch+json"})
         ).raise_for_status()

        async def engine_updated() -> dict[str, Any] | None:
            dep = await get(api, f"{dep_path}/demo-engine")
            args = dep["spec"]["template"]["spec"]["containers"][0]["args"] if dep else []
            return dep if "--max-num-seqs" in args and \
                args[args.index("--max-num-seqs") + 1] == "8" else None
        engine = await wait_for(engine_updated, "engine args updated", operator=operator_process)
        assert engine["spec"]["template"]["metadata"]["annotations"][
            "serving.shoal.dev/template-hash"] != old_hash

        async def router_updated() -> bool:
            router = await get(api, f"{dep_path}/demo-router")
            return router is not None and \
                "least-load" in router["spec"]["template"]["spec"]["containers"][0]["args"]
        await wait_for(router_updated, "router policy updated", operator=operator_process)

        # (The new engines' own startup was covered above; here only the rollout is checked.)
        async def rolled_out() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/demo")
            st = (obj or {}).get("status") or {}
            done = st.get("updatedReplicas") == 2 and st.get("replicas") == 2 and \
                st.get("observedGeneration") == obj["metadata"]["generation"]
            return obj if done else None
        isvc = await wait_for(rolled_out, "rollout to the new spec", timeout=60,
                              operator=operator_process)
        assert isvc["metadata"]["generation"] == 2
        pods = await items(api, pods_path)
        assert {p["metadata"]["annotations"]["serving.shoal.dev/template-hash"] for p in pods} \
            == {engine["spec"]["template"]["metadata"]["annotations"][
                "serving.shoal.dev/template-hash"]}
    finally:
        kubelet_task.cancel()
        kubelet.stop_all()


async def test_operator_restart_mid_rollout_converges_without_duplicates(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type) -> None:
    api = apiserver.api
    standin_engines.settings["*"] = ["--load-seconds", "2", "--kv", "0.5",
                                     "--prefix-queries", "200", "--prefix-hits", "50",
                                     "--waiting", "3"]
    (await api.post(ISVC_PATH, json=service_body("svc", replicas=3))).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="svc-engine",
                               start_engine=standin_engines)
    kubelet_task = asyncio.create_task(kubelet.run())
    pods_path = f"/api/v1/namespaces/{NS}/pods"
    try:
        # Kill the operator once pods exist but before any is ready.
        await wait_for(lambda: get(api, f"/apis/apps/v1/namespaces/{NS}/deployments/svc-engine"),
                       "engine Deployment", operator=operator_process)

        async def three_pods() -> bool:
            return len(await items(api, pods_path)) == 3
        await wait_for(three_pods, "3 pods")
        operator_process.kill()
        assert not any(gate(p) == "True" for p in await items(api, pods_path))
        await asyncio.sleep(2.5)  # engines finish loading while no operator runs
        operator_process.start()

        async def ready() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/svc")
            st = (obj or {}).get("status") or {}
            return st if st.get("phase") == "Ready" and st.get("readyReplicas") == 3 else None
        status = await wait_for(ready, "Ready after operator restart", operator=operator_process)
        assert status["kvCacheUsage"] == 0.5 and status["kvCacheUsagePercent"] == 50
        assert status["prefixCacheHitRate"] == 0.25 and status["prefixCacheHitPercent"] == 25
        assert status["waitingRequests"] == 9
        assert all(gate(p) == "True" for p in await items(api, pods_path))
    finally:
        kubelet_task.cancel()
        kubelet.stop_all()

    # Exactly one of each child, all owned by this service.
    def names(plural_path: str) -> Any:
        return items(api, plural_path)
    expected = {
        f"/apis/apps/v1/namespaces/{NS}/deployments": ["svc-engine", "svc-router"],
        f"/api/v1/namespaces/{NS}/services": ["svc", "svc-engine"],
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets": ["svc-engine"],
        f"/api/v1/namespaces/{NS}/serviceaccounts": ["svc-router"],
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles": ["svc-router"],
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings": ["svc-router"],
    }
    for path, wanted in expected.items():
        found = sorted(o["metadata"]["name"] for o in await names(path))
        assert found == wanted, path


async def test_builtin_autoscaler_scales_up_at_once_and_down_after_the_window(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type, tmp_path: Any) -> None:
    api = apiserver.api
    load = tmp_path / "load.json"
    load.write_text('{"kv": 0.9}')  # every replica 90% full vs a 50% target
    standin_engines.settings["*"] = ["--metrics-file", str(load)]
    body = service_body("auto")
    del body["spec"]["replicas"]
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3,
                                   "targetKVCacheUsage": 0.5, "scaleDownDelaySeconds": 8}
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="auto-engine",
                               start_engine=standin_engines)
    kubelet_task = asyncio.create_task(kubelet.run())
    try:
        async def live() -> bool:
            try:
                async with httpx.AsyncClient(timeout=1) as http:
                    return (await http.get(operator_process.liveness_url)).status_code == 200
            except httpx.HTTPError:
                return False
        await wait_for(live, "operator liveness endpoint", operator=operator_process)

        async def at_max() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/auto")
            st = (obj or {}).get("status") or {}
            return obj if obj and obj["spec"].get("replicas") == 3 and \
                st.get("readyReplicas") == 3 and st.get("phase") == "Ready" else None
        isvc = await wait_for(at_max, "scale-up to maxReplicas", timeout=60,
                              operator=operator_process)
        assert isvc["status"]["ready"] == "3/3"
        assert isvc["status"]["autoscaler"]["recommendation"] == 3
        engine = await get(api, f"/apis/apps/v1/namespaces/{NS}/deployments/auto-engine")
        assert engine is not None and engine["spec"]["replicas"] == 3
        scaled = [e["message"] for e in await items(api, f"/api/v1/namespaces/{NS}/events")
                  if e["reason"] == "Scaled"]
        assert scaled[0].startswith("replicas 1 -> 2: KV cache 90%")
        assert scaled[-1].startswith("replicas 2 -> 3")

        # The operator's own metrics say the same.
        async with httpx.AsyncClient(timeout=2) as http:
            text = (await http.get(operator_process.metrics_url)).text
        from prometheus_client.parser import text_string_to_metric_families

        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        service = (("name", "auto"), ("namespace", NS))
        assert samples[("shoal_operator_ready_replicas", service)] == 3
        assert samples[("shoal_operator_desired_replicas", service)] == 3
        assert samples[("shoal_operator_kv_cache_usage", service)] == 0.9
        assert samples[("shoal_operator_reconcile_rounds_total", (("result", "ok"),))] > 0

        # Load drops: the recommendation falls at once, replicas only after the 8 s window
        # (counted from the last high recommendation, at most a round or two before the drop).
        load.write_text('{"kv": 0.05}')
        dropped_at = time.monotonic()

        async def scaled_down() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/auto")
            return obj if obj and obj["spec"].get("replicas") == 1 else None
        await wait_for(scaled_down, "scale-down to minReplicas", timeout=40,
                       operator=operator_process)
        assert time.monotonic() - dropped_at >= 4
        events = await items(api, f"/api/v1/namespaces/{NS}/events")
        assert any(e["reason"] == "Scaled" and e["message"].startswith("replicas 3 -> 1")
                   for e in events)
    finally:
        kubelet_task.cancel()
        kubelet.stop_all()


async def test_crash_looping_replica_is_recycled_with_backoff(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type) -> None:
    api = apiserver.api
    (await api.post(ISVC_PATH, json=service_body("loop", replicas=2))).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="loop-engine",
                               start_engine=standin_engines)
    kubelet_task = asyncio.create_task(kubelet.run())
    pods_path = f"/api/v1/namespaces/{NS}/pods"

    async def phase_ready() -> dict[str, Any] | None:
        obj = await get(api, f"{ISVC_PATH}/loop")
        st = (obj or {}).get("status") or {}
        return st if st.get("phase") == "Ready" and st.get("readyReplicas") == 2 else None
    try:
        await wait_for(phase_ready, "Ready", operator=operator_process)
        victim = sorted(kubelet.pods)[0]
        await kubelet.crash_loop(victim)

        async def recycled() -> list[dict[str, Any]]:
            events = await items(api, f"/api/v1/namespaces/{NS}/events")
            return [e for e in events if e["reason"] == "Recycled" and victim in e["message"]]
        (event,) = await wait_for(recycled, "the crash-looping pod recycled",
                                  operator=operator_process)
        assert "CrashLoop" in event["message"] and event["type"] == "Warning"
        assert victim not in {p["metadata"]["name"] for p in await items(api, pods_path)}
        assert any(e["reason"] == "CrashLoop" for e in
                   await items(api, f"/api/v1/namespaces/{NS}/events"))

        # A fresh pod replaces it; once all are ready the recycle count is forgotten.
        status = await wait_for(phase_ready, "Ready with a fresh pod", operator=operator_process)
        assert victim not in {r["name"] for r in status["replicaStatus"]}
        assert status["recycle"]["count"] == 0
    finally:
        kubelet_task.cancel()
        kubelet.stop_all()
