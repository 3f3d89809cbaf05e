"""The real operator process against the API-server emulator with a prefill pool (spec.prefill):
both engine Deployments made and their pods gated, the router in P/D mode, status for both
pools, and the pool pruned when spec.prefill goes. Stand-in engines answer /ready and
/metrics per pod (standin_engine.py), one fake kubelet per Deployment."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(180)  # 7 s here: in make test-fast too

NS = "serving"
ISVC_PATH = f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/inferenceservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"


async def wait_for(check: Any, what: str, operator: Any, timeout: float = 60.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n--- operator log ---\n"
                         f"{operator.log_tail()}")


async def get(api: httpx.AsyncClient, path: str) -> dict[str, Any] | None:
    response = await api.get(path)
    return response.json() if response.status_code == 200 else None


async def test_both_pools_reconciled_and_the_prefill_pool_pruned_when_removed(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type) -> None:
    api = apiserver.api
    body = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "pd", "namespace": NS},
            "spec": {"model": {"uri": "builtin://default", "servedName": "demo"},
                     "runtime": {"device": "cpu"}, "resources": {"gpus": 0},
                     "replicas": 2, "startup": {"timeoutSeconds": 120},
                     "prefill": {"replicas": 1, "threshold": 300}}}
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()
    kubelets = [
        fake_kubelet_cls(api=api, namespace=NS, deployment="pd-engine",
                         start_engine=standin_engines),
        # its own addresses: the two kubelets must not hand out the same pod IP
        fake_kubelet_cls(api=api, namespace=NS, deployment="pd-prefill",
                         start_engine=standin_engines,
                         _free_ips=[f"127.0.0.{n}" for n in range(30, 40)]),
    ]
    tasks = [asyncio.create_task(k.run()) for k in kubelets]
    try:
        async def both_ready() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/pd")
            st = (obj or {}).get("status") or {}
            return st if st.get("ready") == "2/2" and \
                (st.get("prefill") or {}).get("ready") == "1/1" else None
        status = await wait_for(both_ready, "both pools ready", operator_process)
        assert status["phase"] == "Ready" and status["prefill"]["phase"] == "Ready"
        assert [r["name"].startswith("pd-engine-") for r in status["replicaStatus"]] == [True] * 2
        (prefill_replica,) = status["prefill"]["replicaStatus"]
        assert prefill_replica["name"].startswith("pd-prefill-") and prefill_replica["ready"]

        engine = await get(api, f"{DEPLOYMENTS}/pd-engine")
        prefill = await get(api, f"{DEPLOYMENTS}/pd-prefill")
        router = await get(api, f"{DEPLOYMENTS}/pd-router")
        assert engine and prefill and router
        roles = [json.loads(d["spec"]["template"]["spec"]["containers"][0]["args"][
            d["spec"]["template"]["spec"]["containers"][0]["args"].index(
                "--kv-transfer-config") + 1])["kv_role"] for d in (engine, prefill)]
        assert roles == ["kv_consumer", "kv_producer"]
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--prefill-service") + 1] == "pd-prefill"
        assert args[args.index("--pd-threshold") + 1] == "300"
        assert await get(api, f"/api/v1/namespaces/{NS}/services/pd-prefill")

        # spec.prefill removed: the next round deletes the pool and clears its status
        (await api.patch(f"{ISVC_PATH}/pd", json={"spec": {"prefill": None}},
                         headers={"Content-Type": "application/merge-patch+json"})
         ).raise_for_status()

        async def pruned() -> bool:
            obj = await get(api, f"{ISVC_PATH}/pd") or {}
            return (await get(api, f"{DEPLOYMENTS}/pd-prefill") is None
                    and await get(api, f"/api/v1/namespaces/{NS}/services/pd-prefill") is None
                    and "prefill" not in (obj.get("status") or {}))
        await wait_for(pruned, "the prefill pool pruned", operator_process)
        engine = await get(api, f"{DEPLOYMENTS}/pd-engine")
        router = await get(api, f"{DEPLOYMENTS}/pd-router")
        assert engine and router
        assert "--kv-transfer-config" not in \
            engine["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--prefill-service" not in \
            router["spec"]["template"]["spec"]["containers"][0]["args"]
    finally:
        for task in tasks:
            task.cancel()
        for kubelet in kubelets:
            kubelet.stop_all()


async def test_the_prefill_pool_autoscales_on_its_own_load_to_zero_and_back(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type, tmp_path: Any) -> None:
    """spec.prefill.autoscaling: the prefill pool starts at minReplicas 0 (Idle), comes up on
    the router's prefill capacity request, scales on its own engines' queue (the decode pool,
    fixed at 1, untouched), back down after scaleDownDelaySeconds and to 0 after
    scaleToZeroAfterSeconds without a prefill."""
    api = apiserver.api
    load = tmp_path / "load.json"
    load.write_text('{"waiting": 0}')
    standin_engines.settings["*"] = ["--metrics-file", str(load)]
    body = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "pd", "namespace": NS},
            "spec": {"model": {"uri": "builtin://default", "servedName": "demo"},
                     "runtime": {"device": "cpu"}, "resources": {"gpus": 0},
                     "replicas": 1, "startup": {"timeoutSeconds": 120},
                     "prefill": {"autoscaling": {
                         "minReplicas": 0, "maxReplicas": 2, "targetWaitingRequests": 2,
                         "scaleDownDelaySeconds": 1, "scaleToZeroAfterSeconds": 6}}}}
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()
    kubelets = [
        fake_kubelet_cls(api=api, namespace=NS, deployment="pd-engine",
                         start_engine=standin_engines),
        fake_kubelet_cls(api=api, namespace=NS, deployment="pd-prefill",
                         start_engine=standin_engines,
                         _free_ips=[f"127.0.0.{n}" for n in range(30, 40)]),
    ]
    tasks = [asyncio.create_task(k.run()) for k in kubelets]

    async def prefill_status(ready: str) -> Any:
        async def check() -> dict[str, Any] | None:
            obj = await get(api, f"{ISVC_PATH}/pd")
            st = ((obj or {}).get("status") or {}).get("prefill") or {}
            return obj if st.get("ready") == ready and \
                obj["status"].get("ready") == "1/1" else None
        return await wait_for(check, f"prefill pool {ready}", operator_process)

    try:
        idle = await prefill_status("0/0")
        assert idle["status"]["prefill"]["phase"] == "Idle"
        router = await get(api, f"{DEPLOYMENTS}/pd-router")
        assert router is not None
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--capacity-request") + 1] == "pd"
        assert "--hold-timeout" not in args  # decode computes prompts meanwhile

        # the router's ask (what PrefillStage sends when no prefill replica is ready)
        stamp = "2026-12-07T04:00:00.000000Z"
        (await api.patch(f"{ISVC_PATH}/pd", json={"metadata": {"annotations": {
            "serving.shoal.dev/prefill-capacity-requested-at": stamp}}},
            headers={"Content-Type": "application/merge-patch+json"})).raise_for_status()
        one = await prefill_status("1/1")
        assert one["spec"]["prefill"]["replicas"] == 1
        assert one["status"]["prefill"]["autoscaler"]["capacityRequestSeen"] == stamp

        load.write_text('{"waiting": 5}')  # 5 waiting on 1 replica against a target of 2
        two = await prefill_status("2/2")
        assert two["spec"]["replicas"] == 1 and two["status"]["prefill"]["waitingRequests"] > 0
        assert (await get(api, f"{DEPLOYMENTS}/pd-prefill") or {})["spec"]["replicas"] == 2

        # idle: 2 -> 1 after the 1 s window (the load-based autoscaler stops at 1), then 1 -> 0
        # 6 s after the last prefill (the pool's own idle window)
        load.write_text('{"waiting": 0}')
        await prefill_status("0/0")
        events = await get(api, f"/api/v1/namespaces/{NS}/events") or {}
        scaled = [e["message"].split(":")[0] for e in events.get("items") or []
                  if e["reason"] == "Scaled"]
        assert scaled == ["prefill replicas 0 -> 1", "prefill replicas 1 -> 2",
                          "prefill replicas 2 -> 1", "prefill replicas 1 -> 0"]
    finally:
        for task in tasks:
            task.cancel()
        for kubelet in kubelets:
            kubelet.stop_all()
