"""spec.adapters: parsed and rendered (pure), then the real operator against the emulator
keeping stand-in engines' adapters in sync with the spec, with no pod restarted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from shoal.operator.loop.engine_calls import plan_sync
from shoal.operator.render.engine import engine_args, render_engine_deployment
from shoal.operator.spec.adapters import ADAPTER_MOUNT, adapters_in_args
from shoal.operator.spec.reader import SpecError
from shoal.operator.spec.service import parse_spec


def spec_with(adapters: Any = None, lora: Any = None, **extra: Any):
    body: dict[str, Any] = {"model": {"uri": "/opt/model", "servedName": "base"}, **extra}
    if adapters is not None:
        body["adapters"] = adapters
    if lora is not None:
        body["lora"] = lora
    return parse_spec(body)


def test_adapters_render_lora_flags_and_claim_mounts_but_never_the_list():
    from shoal.operator.names import Owner

    one = spec_with([{"name": "a", "source": "pvc://adapters/a"}])
    two = spec_with([{"name": "a", "source": "pvc://adapters/a"},
                     {"name": "b", "source": "/opt/adapters/b"}])
    args = engine_args(one)
    assert args[args.index("--enable-lora"):][:5] == ["--enable-lora", "--max-loras", "4",
                                                     "--max-lora-rank", "16"]
    assert engine_args(one) == engine_args(two)  # adding b does not touch the pod template
    owner = Owner("svc", "ns", "uid")
    pod = render_engine_deployment(owner, two, 1)["spec"]["template"]
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "adapters-0", "mountPath": f"{ADAPTER_MOUNT}/adapters",
            "readOnly": True} in mounts
    assert render_engine_deployment(owner, one, 1)["spec"]["template"] == pod
    assert two.lora is not None and [a.engine_path for a in two.lora.adapters] == [
        f"{ADAPTER_MOUNT}/adapters/a", "/opt/adapters/b"]
    assert "--enable-lora" not in engine_args(spec_with())
    limits = spec_with([], {"maxLoras": 2, "maxLoraRank": 64})
    assert engine_args(limits)[-4:] == ["--max-loras", "2", "--max-lora-rank", "64"]
    env = pod["spec"]["containers"][0]["env"]
    assert {"name": "SHOAL_ALLOW_RUNTIME_LORA_UPDATING", "value": "1"} in env


def test_with_auth_adapters_are_startup_flags_and_runtime_loading_stays_off():
    """The engines then need a key the operator does not hold (it reads no Secrets), so it
    cannot load at run time: the adapters are --lora-modules and the engine is not allowed
    to load or unload (no SHOAL_ALLOW_RUNTIME_LORA_UPDATING)."""
    from shoal.operator.names import Owner

    auth = {"apiKeySecretRef": {"name": "keys"}}
    two = spec_with([{"name": "a", "source": "pvc://adapters/a"},
                     {"name": "b", "source": "/opt/adapters/b"}], auth=auth)
    args = engine_args(two)
    assert "--api-key-file" in args
    at = args.index("--lora-modules")
    assert args[at:at + 3] == ["--lora-modules", f"a={ADAPTER_MOUNT}/adapters/a",
                               "b=/opt/adapters/b"]
    assert adapters_in_args(args) == ("a", "b")
    assert adapters_in_args([*args, "--enforce-eager"]) == ("a", "b")
    assert adapters_in_args(engine_args(spec_with([], auth=auth))) == ()
    pod = render_engine_deployment(Owner("svc", "ns", "uid"), two, 1)["spec"]["template"]
    env_names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert not {"SHOAL_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"} \
        & env_names
    assert "--lora-modules" not in engine_args(spec_with([{"name": "a", "source": "/x"}]))


@pytest.mark.parametrize(("adapters", "field"), [
    ([{"name": "base", "source": "/x"}], "spec.adapters[0].name"),
    ([{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}], "spec.adapters[1].name"),
    ([{"name": "a", "source": "hf://org/adapter"}], "spec.adapters[0].source"),
    ([{"name": "a", "source": "relative/path"}], "spec.adapters[0].source"),
    ([{"name": "bad name", "source": "/x"}], "spec.adapters[0].name"),
    ({"name": "a"}, "spec.adapters"),
])
def test_bad_adapter_specs_name_the_field(adapters: Any, field: str):
    with pytest.raises(SpecError) as raised:
        spec_with(adapters)
    assert raised.value.field == field


def test_sync_plan_loads_the_missing_and_unloads_the_undeclared():
    plan = plan_sync({"a": "/a", "b": "/b2"}, {"b": "/b", "c": "/c"})
    assert plan.load == [("a", "/a"), ("b", "/b2")] and plan.unload == ["b", "c"]
    assert plan_sync({"a": "/a"}, {"a": "/a"}).load == []


NS = "serving"
ISVC_PATH = f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/inferenceservices"


async def _served(api: httpx.AsyncClient) -> list[list[str]] | None:
    response = await api.get(f"{ISVC_PATH}/svc")
    status = (response.json() if response.status_code == 200 else {}).get("status") or {}
    if status.get("readyReplicas") != 2:
        return None
    return [r.get("adapters") for r in status.get("replicaStatus") or []]


async def _wait(check, what: str, operator: Any, timeout: float = 60.0) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{operator.log_tail()}")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_operator_loads_and_unloads_adapters_on_running_engines_without_restarts(
        apiserver: SimpleNamespace, operator_process: Any, standin_engines: Any,
        fake_kubelet_cls: type, engine_port: int) -> None:
    api = apiserver.api
    body = {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": NS},
            "spec": {"model": {"uri": "builtin://default", "servedName": "demo"},
                     "runtime": {"device": "cpu"}, "resources": {"gpus": 0}, "replicas": 2,
                     "adapters": [{"name": "a", "source": "/opt/adapters/a"}]}}
    (await api.post(ISVC_PATH, json=body)).raise_for_status()
    operator_process.start()
    kubelet = fake_kubelet_cls(api=api, namespace=NS, deployment="svc-engine",
                               start_engine=standin_engines)
    kubelet_task = asyncio.create_task(kubelet.run())
    pods_path = f"/api/v1/namespaces/{NS}/pods"
    deployment_path = f"/apis/apps/v1/namespaces/{NS}/deployments/svc-engine"
    try:
        async def served_as(wanted: list[str]):
            async def check():
                served = await _served(api)
                return served if served == [wanted, wanted] else None
            return await _wait(check, f"both replicas serving {wanted}", operator_process)

        await served_as(["a"])
        pods = (await api.get(pods_path)).json()["items"]
        names = sorted(p["metadata"]["name"] for p in pods)
        template = (await api.get(deployment_path)).json()["spec"]["template"]

        async def patch(adapters: list[dict[str, str]]) -> None:
            response = await api.patch(f"{ISVC_PATH}/svc", json={"spec": {"adapters": adapters}},
                                       headers={"Content-Type": "application/merge-patch+json"})
            response.raise_for_status()

        await patch([{"name": "a", "source": "/opt/adapters/a"},
                     {"name": "b", "source": "/opt/adapters/b"}])
        await served_as(["a", "b"])
        await patch([{"name": "b", "source": "/opt/adapters/b"}])
        await served_as(["b"])
        await patch([{"name": "b", "source": "/opt/adapters/b"},
                     {"name": "c", "source": "/opt/adapters/bad"}])

        async def reported():
            status = ((await api.get(f"{ISVC_PATH}/svc")).json().get("status") or {})
            errors = status.get("adapterErrors") or []
            return errors if len(errors) == 2 else None
        errors = await _wait(reported, "the bad adapter reported", operator_process)
        assert all("c: 400 cannot load c from /opt/adapters/bad" in e for e in errors)

        # the engines saw every change through their endpoints, and none restarted
        pods = (await api.get(pods_path)).json()["items"]
        assert sorted(p["metadata"]["name"] for p in pods) == names
        assert (await api.get(deployment_path)).json()["spec"]["template"] == template
        async with httpx.AsyncClient(timeout=5) as http:
            for pod in pods:
                models = (await http.get(f"http://{pod['status']['podIP']}:{engine_port}"
                                         "/v1/models")).json()
                assert [c["id"] for c in models["data"] if c.get("parent")] == ["b"]
                assert models["loads"] == ["a", "b"]  # one process: loaded once each
    finally:
        kubelet_task.cancel()
        kubelet.stop_all()
