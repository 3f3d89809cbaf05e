"""The test plays the kubelet (and the Deployment controller) for one engine Deployment.

kmock runs no controllers, so this loop does their part against the emulator: it keeps one Pod
per desired replica of the engine Deployment (replacing pods of an older template), gives each
pod a loopback IP 127.0.0.N, starts an engine process listening there, and reports container
state (running, or terminated with an exit code and a restart count) in the pod status.
Loaded by conftest.py; not a test module.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

TEMPLATE_HASH = "serving.shoal.dev/template-hash"
EngineStarter = Callable[[str, str], subprocess.Popen[bytes]]  # (pod name, ip) -> process


def kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL an engine and every process it started (a container's whole cgroup)."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if process.poll() is None:
        process.kill()
    process.wait()
    psutil.wait_procs(children, timeout=10)


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class FakePod:
    name: str
    ip: str
    process: subprocess.Popen[bytes] | None
    restarts: int = 0
    last_exit: int | None = None
    message: str = ""
    reported_dead: bool = False


@dataclass
class FakeKubelet:
    api: httpx.AsyncClient  # base_url = the emulator
    namespace: str
    deployment: str
    start_engine: EngineStarter
    # pod name -> the engine's last log lines (FallbackToLogsOnError: the termination message)
    termination_message: Callable[[str], str] = lambda name: ""
    pods: dict[str, FakePod] = field(default_factory=dict)
    # Also play the EndpointSlice controller for this Service (None: not), on this port: a
    # pod's endpoint is ready when its Ready condition would be, i.e. its readiness gate
    # (serving.shoal.dev/engine-ready, set by the operator) is True.
    endpoints_service: str | None = None
    endpoints_port: int = 0
    _slice_body: list[dict[str, Any]] | None = None
    _free_ips: list[str] = field(default_factory=lambda: [f"127.0.0.{n}" for n in range(2, 40)])
    _serial: int = 0

    def _path(self, plural: str, name: str = "", group: str = "") -> str:
        root = f"/apis/{group}" if group else "/api/v1"
        return f"{root}/namespaces/{self.namespace}/{plural}" + (f"/{name}" if name else "")

    async def _deployment(self) -> dict[str, Any] | None:
        response = await self.api.get(self._path("deployments", self.deployment, "apps/v1"))
        return response.json() if response.status_code == 200 else None

    async def sync(self) -> None:
        dep = await self._deployment()
        if dep is None:
            return
        want = int(dep["spec"].get("replicas") or 0)
        template = dep["spec"]["template"]
        current_hash = template["metadata"]["annotations"][TEMPLATE_HASH]
        stored = {p["metadata"]["name"]: p for p in (await self.api.get(
            self._path("pods"), params={"labelSelector": ",".join(
                f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())}
        )).json()["items"]}
        for name in [n for n in self.pods if n not in stored]:  # deleted by someone (operator)
            self._stop(name)
        stale = [n for n, p in stored.items()
                 if p["metadata"].get("annotations", {}).get(TEMPLATE_HASH) != current_hash]
        fresh = [n for n in stored if n not in stale]
        for name in stale + fresh[want:]:
            await self.delete_pod(name)
        for _ in range(want - min(len(fresh), want)):
            await self._create_pod(template, current_hash)
        for pod in list(self.pods.values()):
            if pod.process is not None and pod.process.poll() is not None \
                    and not pod.reported_dead:
                await self._report_exit(pod)
        if self.endpoints_service:
            await self._publish_endpoints(dep["spec"]["selector"]["matchLabels"])

    async def _publish_endpoints(self, selector: dict[str, str]) -> None:
        pods = (await self.api.get(self._path("pods"), params={"labelSelector": ",".join(
            f"{k}={v}" for k, v in selector.items())})).json()["items"]
        endpoints = []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            fake = self.pods.get(pod["metadata"]["name"])
            gated = any(c.get("type") == "serving.shoal.dev/engine-ready"
                        and c.get("status") == "True"
                        for c in (pod.get("status") or {}).get("conditions") or [])
            alive = fake is not None and fake.process is not None and fake.process.poll() is None
            endpoints.append({"addresses": [pod["status"]["podIP"]],
                              "conditions": {"ready": gated and alive},
                              "targetRef": {"kind": "Pod", "name": pod["metadata"]["name"]}})
        if endpoints == self._slice_body:
            return
        name = f"{self.endpoints_service}-fake"
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": self.namespace,
                             "labels": {"kubernetes.io/service-name": self.endpoints_service}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": self.endpoints_port, "protocol": "TCP"}],
                "endpoints": endpoints}
        path = self._path("endpointslices", group="discovery.k8s.io/v1")
        if self._slice_body is None:
            (await self.api.post(path, json=body)).raise_for_status()
        else:
            (await self.api.patch(f"{path}/{name}", json={"endpoints": endpoints},
                                  headers={"Content-Type": "application/merge-patch+json"})
             ).raise_for_status()
        self._slice_body = endpoints

    async def _create_pod(self, template: dict[str, Any], template_hash: str) -> None:
        self._serial += 1
        name = f"{self.deployment}-{template_hash[:6]}-{self._serial}"
        ip = self._free_ips.pop(0)
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": dict(template["metadata"]["labels"]),
                         "annotations": dict(template["metadata"]["annotations"])},
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": ip, "startTime": _stamp(),
                       "conditions": [{"type": "PodScheduled", "status": "True"}],
                       "containerStatuses": [self._container(True, 0, None)]},
        }
        (await self.api.post(self._path("pods"), json=body)).raise_for_status()
        self.pods[name] = FakePod(name, ip, self.start_engine(name, ip))

    @staticmethod
    def _container(running: bool, restarts: int, last_exit: int | None,
                   message: str = "") -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": "engine", "ready": False, "restartCount": restarts,
            "state": {"running": {"startedAt": _stamp()}} if running else
            {"waiting": {"reason": "ContainerCreating"}},
        }
        if last_exit is not None:
            status["lastState"] = {"terminated": {"exitCode": last_exit, "reason": "Error",
                                                  "message": message, "finishedAt": _stamp()}}
        return status

    async def _report_exit(self, pod: FakePod) -> None:
        assert pod.process is not None
        code = pod.process.returncode
        pod.last_exit = 128 - code if code < 0 else code  # killed by signal N: 128+N
        pod.restarts += 1
        pod.reported_dead = True
        pod.message = self.termination_message(pod.name)
        await self.api.patch(self._path("pods", pod.name) + "/status", json={"status": {
            "containerStatuses": [self._container(False, pod.restarts, pod.last_exit,
                                                  pod.message)]}},
            headers={"Content-Type": "application/merge-patch+json"})

    def kill_engine(self, name: str) -> None:
        """The engine process dies."""
        process = self.pods[name].process
        assert process is not None
        process.kill()
        process.wait()

    def kill_rank(self, name: str, timeout: float = 30.0) -> int:
        """A rank dies: SIGKILL the engine's child processes (engine core / workers); the
        engine itself must notice and exit non-zero. Returns its exit code."""
        import psutil

        process = self.pods[name].process
        assert process is not None
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the engine has no child processes to kill"
        for child in children:
            child.kill()
        return process.wait(timeout=timeout)

    async def crash_loop(self, name: str, restarts: int = 5) -> None:
        """The engine keeps dying at start: the kubelet backs off (CrashLoopBackOff)."""
        pod = self.pods[name]
        if pod.process is not None:
            kill_tree(pod.process)
        pod.restarts, pod.last_exit, pod.reported_dead = restarts, 1, True
        container = self._container(False, restarts, 1, "engine exited during load")
        container["state"] = {"waiting": {"reason": "CrashLoopBackOff",
                                          "message": "back-off 5m0s restarting failed container"}}
        await self.api.patch(self._path("pods", name) + "/status", json={"status": {
            "containerStatuses": [container]}},
            headers={"Content-Type": "application/merge-patch+json"})

    async def restart_engine(self, name: str) -> None:
        """The kubelet restarts the container (same pod, same IP)."""
        pod = self.pods[name]
        pod.process = self.start_engine(name, pod.ip)
        pod.reported_dead = False
        await self.api.patch(self._path("pods", name) + "/status", json={"status": {
            "containerStatuses": [self._container(True, pod.restarts, pod.last_exit,
                                                  pod.message)]}},
            headers={"Content-Type": "application/merge-patch+json"})

    async def delete_pod(self, name: str) -> None:
        self._stop(name)
        await self.api.delete(self._path("pods", name))

    def _stop(self, name: str) -> None:
        pod = self.pods.pop(name, None)
        if pod is None:
            return
        if pod.process is not None:
            kill_tree(pod.process)
        self._free_ips.append(pod.ip)

    async def run(self, period: float = 0.3) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(period)

    def stop_all(self) -> None:
        for name in list(self.pods):
            self._stop(name)
