"""The dependency rules of docs/architecture.md and the developers' guide, checked on the
import statements of the product code (including imports inside functions)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"shoal.runtime": ROOT / "runtime", "shoal.operator": ROOT / "operator",
            "shoal": ROOT / "shoal"}


def imports_of(folder: Path) -> dict[str, set[str]]:
    """file (relative to the repo) -> absolute module names it imports."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        package = _module_name(path).rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this file's package
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    names.add(f"{base}.{node.module}" if node.module else base)
                elif node.module:
                    names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def _module_name(path: Path) -> str:
    for prefix, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            parts = path.relative_to(folder).with_suffix("").parts
            return ".".join((prefix, *parts))
    raise ValueError(path)


def violations(folder: Path, forbidden: str, allowed: str = r"$^") -> list[str]:
    return [f"{file}: {name}" for file, names in imports_of(folder).items()
            for name in sorted(names)
            if re.match(forbidden, name) and not re.match(allowed, name)]


@pytest.mark.parametrize("folder", ["runtime", "operator", "shoal/kernels"])
def test_nothing_outside_the_api_layer_imports_it(folder: str) -> None:
    found = violations(ROOT / folder, r"shoal\.runtime\.api\b")
    assert [v for v in found if not v.startswith("runtime/api/")] == []


def test_kernels_import_nothing_of_the_runtime_or_operator() -> None:
    assert violations(ROOT / "shoal" / "kernels", r"shoal\.(runtime|operator)\b") == []


def test_operator_knows_the_runtime_only_through_flags_and_http() -> None:
    # of shoal, only the contract (no torch either: the operator image does not have it)
    assert violations(ROOT / "operator", r"(shoal\.|torch|triton)",
                      allowed=r"shoal\.(contract|operator)\b") == []


def test_router_shares_only_the_block_hash_and_tokenization_with_the_engine() -> None:
    """The router is its own deployable: never the engine, worker, model or scheduler."""
    found = violations(ROOT / "runtime" / "router", r"shoal\.",
                       allowed=r"shoal\.contract\b|"
                               r"shoal\.runtime\.(router\b|kv\.block_hash$|http_listener$|heap$|"
                               r"log_limits$|frontend\.(tokenizer|chat_template|prompts)$|"
                               r"distributed\.lifeline$)")
    assert found == []
    # the one exception beyond the tokenizer: `shoal fleet` gives its children the same
    # parent-death guard as every other spawner
    lifeline = violations(ROOT / "runtime" / "router", r"shoal\.runtime\.distributed\b")
    assert lifeline and all(v.startswith("runtime/router/local/") for v in lifeline)


# I/O a pure subpackage never does: network, processes, Kubernetes, metrics servers
IO = r"(asyncio|aiohttp|httpx|zmq|grpc|socket|subprocess|uvicorn|starlette|kopf|" \
     r"kubernetes_asyncio|prometheus_client)\b"

# subpackage -> the parts of its own deployable it may import (itself always)
ROUTER_LAYERS = {
    "policies": r"$^",  # pure decisions over snapshots
    "replicas": r"policies\b",  # the fleet as the router sees it: discovery, health, load
    # the HTTP face, and the gateway's Endpoint Picker: never each other
    "proxy": r"(policies|replicas|config|edge_auth|fleet_view|pd_metrics)\b",
    "epp": r"(policies|replicas|config|edge_auth|fleet_view|pd_metrics)\b",
    "local": r"cli$",  # `shoal fleet`: launches `shoal route`, knows only its flags
}
OPERATOR_LAYERS = {
    "spec": r"names$",  # what the user asked, parsed (pure)
    "render": r"(names|spec)\b",  # the children's manifests (pure)
    "decide": r"(names|spec)\b",  # replica state, status, autoscaling, backoff (pure)
    "kube": r"names$",  # the API server: credentials and calls
}


@pytest.mark.parametrize("sub", sorted(ROUTER_LAYERS))
def test_router_subpackages_import_only_the_layers_below(sub: str) -> None:
    allowed = rf"shoal\.runtime\.router\.({sub}\b|{ROUTER_LAYERS[sub]})"
    assert violations(ROOT / "runtime" / "router" / sub, r"shoal\.runtime\.router\b",
                      allowed) == []


@pytest.mark.parametrize("sub", sorted(OPERATOR_LAYERS))
def test_operator_subpackages_import_only_the_layers_below(sub: str) -> None:
    allowed = rf"shoal\.operator\.({sub}\b|{OPERATOR_LAYERS[sub]})"
    assert violations(ROOT / "operator" / sub, r"shoal\.operator\b", allowed) == []


@pytest.mark.parametrize("folder", ["runtime/router/policies", "operator/spec",
                                    "operator/render", "operator/decide"])
def test_pure_subpackages_do_no_io(folder: str) -> None:
    assert violations(ROOT / folder, IO) == []
    assert list((ROOT / folder).glob("*.py")), folder  # the folder is there to be checked


def test_operator_names_import_nothing_of_the_operator() -> None:
    assert imports_of(ROOT / "operator")["operator/names.py"] <= {"__future__", "dataclasses",
                                                                  "typing"}


def test_the_contract_imports_nothing_of_shoal_and_only_what_the_operator_image_has() -> None:
    """shoal.contract is what the API, the router and the operator agree on: the standard
    library and prometheus_client only, so all three (the operator without torch) import it."""
    import sys

    found = imports_of(ROOT / "shoal" / "contract")
    assert found
    outside = [f"{file}: {name}" for file, names in found.items() for name in sorted(names)
               if not name.startswith("shoal.contract")
               and name.split(".")[0] not in sys.stdlib_module_names | {"prometheus_client"}]
    assert outside == []


@pytest.mark.parametrize("folder", ["runtime/api", "runtime/router", "operator"])
def test_the_api_router_and_operator_read_the_wire_contract_from_one_place(folder: str) -> None:
    assert violations(ROOT / folder, r"shoal\.contract\b"), f"{folder} does not use it"


@pytest.mark.parametrize("folder", ["engine", "scheduler", "kv", "executor"])
def test_engine_side_never_tokenizes_or_serves_http(folder: str) -> None:
    forbidden = r"(shoal\.runtime\.(frontend|api)|tokenizers|fastapi|uvicorn|starlette|httpx)\b"
    assert violations(ROOT / "runtime" / folder, forbidden) == []


def test_the_wire_types_import_nothing_of_the_processes_they_connect() -> None:
    """runtime/wire holds what crosses a process boundary: plain data and codecs, importable
    from either side (API, engine core, workers) without pulling in the other."""
    allowed = r"shoal\.runtime\.(wire\b.*|sampling_params|kv_transfer\.params)$"
    assert violations(ROOT / "runtime" / "wire", r"shoal\.", allowed) == []


def test_the_checker_sees_function_level_and_relative_imports() -> None:
    found = imports_of(ROOT / "runtime" / "api")
    assert "shoal.runtime.api.errors" in found["runtime/api/state.py"]  # `from .errors import`
    # imported inside the handler only (the CLI stays cheap)
    assert "shoal.runtime.model_source" in found["runtime/api/cli.py"]
    assert violations(ROOT / "runtime" / "api", r"shoal\.runtime\.wire\b")


def test_no_top_level_folder_shadows_an_installed_package() -> None:
    """`python -m` run from the repository root puts the root first on sys.path, so a top-level
    package folder named like a dependency's import name replaces that dependency (a `kernels/`
    folder broke transformers 5.25, which imports the `kernels` distribution). `operator/` is
    the one stdlib name: the interpreter has imported the stdlib module before sys.path[0]."""
    import importlib.metadata
    import sys

    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    installed = importlib.metadata.packages_distributions()
    assert {n: installed[n] for n in folders if set(installed.get(n, ["shoal"])) != {"shoal"}} == {}
    assert folders & set(sys.stdlib_module_names) <= {"operator"}
