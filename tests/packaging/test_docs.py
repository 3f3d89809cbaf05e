"""The reference docs are generated from the CRD and the CLI parsers, and never drift from them."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


@pytest.fixture(scope="module")
def gen_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shoal_tools_gen_docs",
                                                  ROOT / "tools" / "gen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_reference_docs_match_their_sources() -> None:
    result = subprocess.run([sys.executable, "tools/gen_docs.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (
        "docs/reference drifted from the CRD or the CLI; run `python tools/gen_docs.py` and "
        "commit the result\n" + result.stderr)


def test_check_mode_fails_on_a_stale_or_missing_file(gen_docs: ModuleType, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gen_docs, "OUT_DIR", tmp_path)
    assert gen_docs.main(["--check"]) == 1  # missing
    assert gen_docs.main([]) == 0
    assert gen_docs.main(["--check"]) == 0
    stale = tmp_path / "inferenceservice.md"
    stale.write_text(stale.read_text().replace("spec.replicas", "spec.replicaCount"))
    assert gen_docs.main(["--check"]) == 1


def _schema_paths(node: dict, path: str):
    for name, child in (node.get("properties") or {}).items():
        child_path = f"{path}.{name}"
        yield child_path
        target = child.get("items", child) if child.get("type") == "array" else child
        suffix = "[]" if target is not child else ""
        yield from _schema_paths(target, child_path + suffix)


def test_crd_reference_lists_every_field_and_column() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "serving.shoal.dev_inferenceservices.yaml").read_text())
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]["properties"]
    text = (REFERENCE / "inferenceservice.md").read_text()
    for section in ("spec", "status"):
        for path in _schema_paths(schema[section], section):
            assert f"| `{path}`" in text, path
    for column in version["additionalPrinterColumns"]:
        assert f"| {column['name']} |" in text
    for line in text.splitlines():
        if line.startswith("| `spec.") or line.startswith("| `status."):
            # an unescaped | (e.g. in a pattern) would add cells and break the table
            assert line.replace("\\|", "").count("|") == 5, line


def test_cli_reference_lists_every_subcommand_and_flag() -> None:
    import argparse

    from shoal.cli import build_parser

    text = (REFERENCE / "cli.md").read_text()
    subparsers = next(a for a in build_parser()._actions
                      if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        section = text.split(f"## `shoal {name}`", 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in section, f"shoal {name} {flag}"


def test_tests_cited_by_the_docs_exist() -> None:
    cited = set()
    for doc in (ROOT / "docs").rglob("*.md"):
        cited |= {(doc.name, path, name) for path, name in
                  re.findall(r"(tests/[\w/]+\.py)::(\w+)", doc.read_text())}
    assert len(cited) >= 10
    for doc, path, name in sorted(cited):
        source = ROOT / path
        assert source.is_file(), f"{doc} cites {path}, which does not exist"
        assert re.search(rf"^(async )?def {name}\(", source.read_text(), re.M), (
            f"{doc} cites {path}::{name}, which does not exist")


# --- the hand-written docs name only things that exist --------------------------------------

HAND_WRITTEN = ["README.md", "docs/quickstart.md", "docs/operations.md",
                "docs/troubleshooting.md"]


def _text(relative: str) -> str:
    return (ROOT / relative).read_text()


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("relative", HAND_WRITTEN + ["docs/architecture.md"])
def test_relative_links_resolve(relative: str) -> None:
    source = ROOT / relative
    for target in re.findall(r"\]\(([^)\s]+)\)", source.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (source.parent / path).resolve() if path else source
        assert linked.exists(), f"{relative}: broken link {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{relative}: no anchor {target}"


def _crd_paths() -> set[str]:
    crd = yaml.safe_load((ROOT / "crds" / "serving.shoal.dev_inferenceservices.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    return {p.replace("[]", "") for section in ("spec", "status")
            for p in _schema_paths(schema[section], section)}


@pytest.mark.parametrize("relative", HAND_WRITTEN)
def test_spec_fields_named_in_the_docs_exist_in_the_crd(relative: str) -> None:
    paths = _crd_paths()
    spec_sections = {p.split(".")[1] for p in paths if p.startswith("spec.")}
    for code in re.findall(r"`([^`\s]+)`", _text(relative)):
        for field in code.replace("[]", "").split(".."):  # `a.minReplicas..maxReplicas`
            parts = field.split(".")
            if parts[0] in ("spec", "status") and len(parts) > 1 and field.isascii() \
                    and not field.endswith(".py"):
                assert field in paths, f"{relative}: `{code}` is not a CRD field"
            elif parts[0] in spec_sections and len(parts) > 1 and \
                    re.fullmatch(r"[A-Za-z.]+", field):
                assert f"spec.{field}" in paths, f"{relative}: `{code}` is not a spec field"


@pytest.mark.parametrize("relative", HAND_WRITTEN)
def test_flags_named_in_the_docs_exist(relative: str) -> None:
    import argparse

    from shoal.cli import build_parser

    subparsers = next(a for a in build_parser()._actions
                      if isinstance(a, argparse._SubParsersAction))
    flags = {flag for sub in subparsers.choices.values() for action in sub._actions
             for flag in action.option_strings}
    helm_flags = {"--set", "--namespace", "--create-namespace", "--dry-run"}
    for code in re.findall(r"`(--[a-z][\w-]*)", _text(relative)):
        assert code in flags | helm_flags, f"{relative}: `{code}` is no `shoal` flag"


def _exported_metric_types() -> dict[str, str]:
    from shoal.runtime.api.metrics import ServerMetrics
    from shoal.runtime.router.proxy.metrics import RouterMetrics
    from shoal.runtime.router.replicas.pool import ReplicaPool

    text = ServerMetrics("m").render().decode() + \
        RouterMetrics(ReplicaPool()).render().decode()
    return dict(re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M))


@pytest.mark.parametrize("relative", HAND_WRITTEN)
def test_metrics_named_in_the_docs_are_exported(relative: str) -> None:
    types = _exported_metric_types()
    for name in re.findall(r"shoal:[a-z0-9_]+", _text(relative)):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in types or types.get(base) == "histogram", (
            f"{relative}: {name} is exported by neither the engine nor the router")


def _leaf_keys(values: dict, path: str = ""):
    for key, value in values.items():
        if isinstance(value, dict) and value and key != "resources" and key != "labels":
            yield from _leaf_keys(value, f"{path}{key}.")
        else:
            yield f"{path}{key}"


def test_chart_values_reference_lists_every_value_with_its_default() -> None:
    import json

    values = yaml.safe_load((ROOT / "charts" / "shoal" / "values.yaml").read_text())
    text = (REFERENCE / "chart-values.md").read_text()
    for key in _leaf_keys(values):
        node = values
        for part in key.split("."):
            node = node[part]
        if isinstance(node, dict):  # shown as sub-keys (resources.requests, ...) or whole
            assert f"| `{key}" in text, key
            continue
        assert f"| `{key}` |" in text and f"`{json.dumps(node)}`" in text, key


def test_the_where_table_names_files_that_exist() -> None:
    text = _text("docs/architecture.md")
    section = text.split("## Where does X live", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]+ \| `([^`]+)` \|$", section, re.M)
    assert len(rows) >= 30, "the table lost its rows"
    missing = [path for path in rows if not (ROOT / path).is_file()]
    assert missing == [], f"docs/architecture.md's where-table names missing files: {missing}"
