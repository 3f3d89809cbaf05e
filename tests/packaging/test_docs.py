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
