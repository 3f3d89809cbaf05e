"""The real `shoal operator` process logging in as a real cluster's users do, against the
emulator over TLS with authentication: every request's credentials are checked server side.

- an exec credential plugin (EKS/GKE/AKS/OIDC style), from a KUBECONFIG of two merged files;
- in-cluster service-account credentials whose token file is replaced mid-run;
- a client certificate, with a kubeconfig that names no CA.

In each, both of the operator's clients (kopf's watches and the operator's own API calls)
must reconcile, and after the credential changes (revoked token, rotated file) every request
that gets through carries the new one.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NS = "serving"
ISVC_PATH = f"/apis/serving.shoal.dev/v1alpha1/namespaces/{NS}/inferenceservices"
ENGINE_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/demo-engine"
TEST_CLIENT = "python-httpx"  # the test's own requests (as kubelet and user)


def service() -> dict[str, Any]:
    return {"apiVersion": "serving.shoal.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "demo", "namespace": NS},
            "spec": {"model": {"uri": "builtin://default"}, "runtime": {"device": "cpu", "maxNumSeqs": 16},
                     "resources": {"gpus": 0}, "replicas": 1}}


async def wait_for(check: Any, what: str, operator: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{operator.log_tail()}")


async def reconciled(server: SimpleNamespace, operator: Any, max_num_seqs: int) -> None:
    """kopf saw the object and the operator's client wrote the children and the status."""
    async def done() -> bool:
        engine = await server.api.get(ENGINE_PATH)
        isvc = (await server.api.get(f"{ISVC_PATH}/demo")).json()
        if engine.status_code != 200:
            return False
        args = engine.json()["spec"]["template"]["spec"]["containers"][0]["args"]
        status = isvc.get("status") or {}
        return args[args.index("--max-num-seqs") + 1] == str(max_num_seqs) and \
            status.get("observedGeneration") == isvc["metadata"]["generation"]
    await wait_for(done, f"a round with max-num-seqs {max_num_seqs}", operator)


async def change_spec(server: SimpleNamespace) -> None:
    (await server.api.patch(f"{ISVC_PATH}/demo", json={"spec": {"runtime": {"maxNumSeqs": 7}}},
                            headers={"Content-Type": "application/merge-patch+json"})
     ).raise_for_status()


def operator_requests(server: SimpleNamespace, since: float = 0.0) -> list[Any]:
    return [s for s in server.emulator.seen
            if s.at >= since and not s.user_agent.startswith(TEST_CLIENT)]


def clients(seen: list[Any]) -> set[str]:
    """Which of the operator's two HTTP clients made these requests."""
    return {"kopf" if s.user_agent.startswith("kopf") else "client" for s in seen}


async def test_exec_plugin_from_two_merged_kubeconfig_files(
        secure_apiserver: SimpleNamespace, start_operator: Any, exec_plugin: SimpleNamespace,
        tmp_path: Path) -> None:
    server = secure_apiserver
    revoked: set[str] = set()
    server.state.tokens = lambda token: token in exec_plugin.issued() and token not in revoked
    (tmp_path / "kube").mkdir()  # the cluster (its CA a path relative to the file), a context
    (tmp_path / "kube" / "ca.pem").write_bytes(server.ca_pem.read_bytes())
    clusters = tmp_path / "kube" / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "managed",
        "clusters": [{"name": "emulator", "cluster": {"server": server.url,
                                                      "certificate-authority": "ca.pem"}}],
        "contexts": [{"name": "managed", "context": {"cluster": "emulator",
                                                     "user": "plugin-user"}}]}))
    users = tmp_path / "users.yaml"  # the user: only an exec plugin
    users.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Config",
                                     "users": [{"name": "plugin-user", "user": exec_plugin.user}]}))
    (await server.api.post(ISVC_PATH, json=service())).raise_for_status()
    operator = start_operator([], {"KUBECONFIG": f"{clusters}{os.pathsep}{users}"})
    await reconciled(server, operator, 16)
    assert clients(operator_requests(server)) == {"kopf", "client"}

    # The token is revoked (expired, rotated by the identity provider) and the API server
    # restarts (watches end): both clients get a 401 at most once, then use a new token.
    revoked.update(exec_plugin.issued())
    revoked_at = time.monotonic()
    server.emulator.drop_watches()
    await change_spec(server)
    await reconciled(server, operator, 7)
    await wait_for(lambda: _async(clients([s for s in operator_requests(server, revoked_at)
                                           if s.status == 0]) == {"kopf", "client"}),
                   "both clients back with a new token", operator)

    seen = operator_requests(server)
    issued = exec_plugin.issued()
    assert all(s.token in issued for s in seen), "a request without the plugin's token"
    after = [s for s in operator_requests(server, revoked_at) if s.status == 0]
    assert after and not {s.token for s in after} & revoked
    assert len(issued) >= 2


async def test_in_cluster_token_file_replaced_mid_run(
        secure_apiserver: SimpleNamespace, start_operator: Any, tmp_path: Path) -> None:
    server = secure_apiserver
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(server.ca_pem.read_bytes())
    (account / "namespace").write_text(NS)
    (account / "token").write_text("sa-token-1")
    server.state.tokens = {"sa-token-1"}
    (await server.api.post(ISVC_PATH, json=service())).raise_for_status()
    host, port = server.url.removeprefix("https://").rsplit(":", 1)
    operator = start_operator([], {"KUBERNETES_SERVICE_HOST": host,
                                   "KUBERNETES_SERVICE_PORT": port,
                                   "SHOAL_SERVICE_ACCOUNT_DIR": str(account)})
    await reconciled(server, operator, 16)
    assert {s.token for s in operator_requests(server)} == {"sa-token-1"}

    # The kubelet rotates the projected token: a new file swapped in, the old token still
    # valid. The operator's own client switches at once, with no failed request.
    (account / "token.tmp").write_text("sa-token-2")
    os.replace(account / "token.tmp", account / "token")
    server.state.tokens = {"sa-token-1", "sa-token-2"}
    rotated_at = time.monotonic()

    async def client_switched() -> bool:
        return any(s.token == "sa-token-2" for s in operator_requests(server, rotated_at))
    await wait_for(client_switched, "the operator's client to use the new token", operator)

    # Later the old token expires and the API server restarts: kopf re-reads it too.
    server.state.tokens = {"sa-token-2"}
    expired_at = time.monotonic()
    server.emulator.drop_watches()
    await change_spec(server)
    await reconciled(server, operator, 7)
    await wait_for(lambda: _async(clients([s for s in operator_requests(server, expired_at)
                                           if s.status == 0]) == {"kopf", "client"}),
                   "both clients with the new token", operator)
    after = operator_requests(server, expired_at)
    assert {s.token for s in after if s.status == 0} == {"sa-token-2"}
    assert not [s for s in operator_requests(server) if s.status == 401
                and not s.user_agent.startswith("kopf")], "the client used an expired token"


async def test_client_certificate_without_a_ca_in_the_kubeconfig(
        secure_apiserver: SimpleNamespace, start_operator: Any, tmp_path: Path) -> None:
    server = secure_apiserver
    cert, key = server.client_cert("shoal-operator")
    server.state.users.add("shoal-operator")
    config = tmp_path / "config"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server.url,
                                               "insecure-skip-tls-verify": True}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u",
                                               "namespace": NS}}],
        "users": [{"name": "u", "user": {
            "client-certificate-data": base64.b64encode(Path(cert).read_bytes()).decode(),
            "client-key-data": base64.b64encode(Path(key).read_bytes()).decode()}}]}))
    (await server.api.post(ISVC_PATH, json=service())).raise_for_status()
    operator = start_operator(["--kubeconfig", str(config)], {})
    await reconciled(server, operator, 16)
    seen = operator_requests(server)
    assert clients(seen) == {"kopf", "client"}
    assert {(s.client_cert, s.token) for s in seen} == {("shoal-operator", None)}


async def _async(value: Any) -> Any:
    return value
