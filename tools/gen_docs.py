"""Generate the reference docs from their sources of truth.

- docs/reference/inferenceservice.md from the CRD's openAPIV3Schema (crds/)
- docs/reference/cli.md from the `shoal` argument parsers
- docs/reference/chart-values.md from charts/shoal/values.schema.json and values.yaml

`python tools/gen_docs.py` rewrites them; `--check` exits 1 when they drifted (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = ROOT / "crds" / "serving.shoal.dev_inferenceservices.yaml"
CHART_DIR = ROOT / "charts" / "shoal"
OUT_DIR = ROOT / "docs" / "reference"


def crd_reference(crd: dict) -> str:
    version = next(v for v in crd["spec"]["versions"] if v.get("storage", True))
    schema = version["schema"]["openAPIV3Schema"]
    kind = crd["spec"]["names"]["kind"]
    lines = [
        f"# {kind} reference ({crd['spec']['group']}/{version['name']})",
        "",
        "Generated from the CRD schema by `tools/gen_docs.py`; do not edit by hand.",
        "",
        f"Short names: {', '.join(crd['spec']['names'].get('shortNames', [])) or 'none'}.",
        "",
    ]
    columns = version.get("additionalPrinterColumns", [])
    if columns:
        lines += ["## `kubectl get` columns", "", "| column | type | from | meaning |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {c['name']} | {c['type']} | `{c['jsonPath']}` | {c.get('description', '')} |"
                  for c in columns]
        lines.append("")
    for section in ("spec", "status"):
        node = schema.get("properties", {}).get(section)
        if node:
            lines += [f"## {section}", "", "| field | type | default | description |",
                      "| --- | --- | --- | --- |"]
            lines += list(_field_rows(node, section))
            lines.append("")
            rules = list(_cel_rules(node, section))
            if rules:
                lines += [f"### {section} validation rules", ""]
                lines += [f"- `{path}`: {message}" for path, message in rules]
                lines.append("")
    return "\n".join(lines)


def _type_of(node: dict) -> str:
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = node.get("type", "object" if "properties" in node else "any")
    if kind == "array":
        return f"[]{_type_of(node.get('items', {}))}"
    if "enum" in node:
        return f"{kind} (one of: {', '.join(str(v) for v in node['enum'])})"
    bounds = []
    if "minimum" in node:
        # OpenAPI v3.0: exclusiveMinimum/exclusiveMaximum are booleans qualifying the bound
        bounds.append(f"{'>' if node.get('exclusiveMinimum') else '>='} {node['minimum']}")
    if "maximum" in node:
        bounds.append(f"{'<' if node.get('exclusiveMaximum') else '<='} {node['maximum']}")
    if "pattern" in node:
        bounds.append(f"pattern `{node['pattern']}`")
    return f"{kind}{' (' + ', '.join(bounds) + ')' if bounds else ''}"


def _field_rows(node: dict, path: str):
    required = set(node.get("required", []))
    for name, child in node.get("properties", {}).items():
        child_path = f"{path}.{name}"
        default = child.get("default")
        desc = " ".join(child.get("description", "").split()).replace("|", "\\|")
        req = " **required**" if name in required else ""
        shown_default = "" if default is None else f"`{json.dumps(default)}`"
        kind = _type_of(child).replace("|", "\\|")  # a `|` in a pattern would split the cell
        yield f"| `{child_path}`{req} | {kind} | {shown_default} | {desc} |"
        target = child.get("items", child) if child.get("type") == "array" else child
        if "properties" in target:
            yield from _field_rows(target, child_path + ("[]" if target is not child else ""))


def _cel_rules(node: dict, path: str):
    for rule in node.get("x-kubernetes-validations", []):
        yield path, rule.get("message", rule["rule"])
    for name, child in node.get("properties", {}).items():
        target = child.get("items", child) if child.get("type") == "array" else child
        yield from _cel_rules(target, f"{path}.{name}")


def cli_reference() -> str:
    from shoal.cli import build_parser

    parser = build_parser()
    lines = ["# `shoal` command-line reference", "",
             "Generated from the argument parsers by `tools/gen_docs.py`; do not edit by hand.", ""]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    summaries = {a.dest: a.help or "" for a in subparsers._choices_actions}
    for name, sub in subparsers.choices.items():
        summary = (sub.description or summaries.get(name) or "").strip()
        lines += [f"## `shoal {name}`", "", summary, "",
                  "| flag | default | help |", "| --- | --- | --- |"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
            default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
            help_text = (action.help or "").replace("|", "\\|").replace("%%", "%")
            if action.choices:
                help_text += f" (choices: {', '.join(str(c) for c in action.choices)})"
            help_text = help_text.strip()
            lines.append(f"| {flags} | {default} | {help_text} |")
        lines.append("")
    return "\n".join(lines)


def chart_values_reference(schema: dict, values: dict) -> str:
    lines = ["# Helm chart values (charts/shoal)", "",
             "Generated from `values.schema.json` (which `helm` enforces: unknown keys are "
             "errors) and the defaults in `values.yaml` by `tools/gen_docs.py`; do not edit "
             "by hand.", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
    lines += list(_value_rows(schema, schema, values, ""))
    lines.append("")
    return "\n".join(lines)


def _schema_type(root: dict, node: dict) -> str:
    if "$ref" in node:
        node = root["definitions"][node["$ref"].rsplit("/", 1)[1]]
    if "enum" in node:
        return " \\| ".join(json.dumps(v) for v in node["enum"])
    if "anyOf" in node:
        return " or ".join(_schema_type(root, option) for option in node["anyOf"])
    if "const" in node:
        return json.dumps(node["const"])
    kind = node.get("type", "any")
    if kind == "array":
        return f"[]{_schema_type(root, node.get('items', {}))}"
    return " or ".join(kind) if isinstance(kind, list) else kind


def _value_rows(root: dict, node: dict, values: dict | None, path: str):
    for name, child in node.get("properties", {}).items():
        key = f"{path}{name}"
        default = (values or {}).get(name)
        if child.get("type") == "object" and "properties" in child:
            yield from _value_rows(root, child, default if isinstance(default, dict) else {},
                                   key + ".")
            continue
        shown = "" if default is None else f"`{json.dumps(default)}`"
        desc = " ".join(child.get("description", "").split()).replace("|", "\\|")
        yield f"| `{key}` | {_schema_type(root, child)} | {shown} | {desc} |"


def generated() -> dict[Path, str]:
    docs = {OUT_DIR / "cli.md": cli_reference()}
    schema_path, values_path = CHART_DIR / "values.schema.json", CHART_DIR / "values.yaml"
    if schema_path.exists():
        docs[OUT_DIR / "chart-values.md"] = chart_values_reference(
            json.loads(schema_path.read_text()), yaml.safe_load(values_path.read_text()))
    if CRD_PATH.exists():
        docs[OUT_DIR / "inferenceservice.md"] = crd_reference(yaml.safe_load(CRD_PATH.read_text()))
    return docs


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__).parse_known_args(argv)[1]
    check = "--check" in args
    drifted = []
    for path, text in generated().items():
        if check:
            if not path.exists() or path.read_text() != text:
                drifted.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for path in drifted:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{shown} is out of date: run python tools/gen_docs.py", file=sys.stderr)
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
