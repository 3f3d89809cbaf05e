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
        assert args[args.index("--prefill-backend") + 1] == \
            f"http://pd-prefill.{NS}.svc.cluster.local:8000"
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
        assert "--prefill-backend" not in \
            router["spec"]["template"]["spec"]["containers"][0]["args"]
    finally:
        for task in tasks:
            task.cancel()
        for kubelet in kubelets:
            kubelet.stop_all()
