"""The chart's optional parts: values schema, Grafana dashboard, NetworkPolicy.

Rendered with the real helm binary, validated against the Kubernetes schemas, and checked
against what the operator renders and the metrics the engines export.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from shoal.operator.names import ENGINE_PORT, Owner
from shoal.operator.render.engine import render_engine_deployment
from shoal.operator.render.pd import ROLE_PREFILL
from shoal.operator.render.router import render_router_deployment
from shoal.operator.spec.service import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shoal"
DASHBOARD = CHART / "dashboards" / "shoal-engines.json"
K8S_VERSION = "1.30.0"

EVERYTHING_ON = {"dashboard.enabled": "true", "networkPolicy.enabled": "true",
                 "watchNamespaces": "{serving,team-b}"}


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- lint, schema, Kubernetes validation ----------------------------------------------------


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["defaults", "everything-on"])
def test_chart_lints_strict_and_renders_valid_kubernetes_objects(helm, render_chart,
                                                                  values) -> None:
    set_args = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    lint = helm("lint", str(CHART), "--strict", *set_args)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    for obj in render_chart(values):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_values_yaml_satisfies_its_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


@pytest.mark.parametrize("bad, complaint", [
    ({"reconcileInterval": "0"}, "reconcileInterval"),
    ({"image.pullPolicy": "Sometimes"}, "pullPolicy"),
    ({"networkPolicy.enabeld": "true"}, "enabeld"),  # a typo is an error, not a silent no-op
    ({"networkPolicy.enginePorts": "{70000}"}, "enginePorts"),
    ({"watchNamespaces": "{Not_A_Namespace}"}, "watchNamespaces"),
])
def test_schema_rejects_bad_values(helm, bad: dict[str, str], complaint: str) -> None:
    set_args = [a for k, v in bad.items() for a in ("--set", f"{k}={v}")]
    result = helm("template", "shoal", str(CHART), *set_args)
    assert result.returncode != 0
    assert complaint in result.stderr


def test_optional_parts_are_off_by_default(render_chart) -> None:
    kinds = {o["kind"] for o in render_chart()}
    assert "NetworkPolicy" not in kinds and "ConfigMap" not in kinds


# --- NetworkPolicy --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def operator_rendered_pods() -> dict[str, dict[str, Any]]:
    """Pod templates of an engine and a router exactly as the operator renders them."""
    owner = Owner(name="demo", namespace="serving", uid="u-1")
    spec = parse_spec(yaml.safe_load((ROOT / "examples" / "cpu-demo.yaml").read_text())["spec"])
    pd = parse_spec(yaml.safe_load((ROOT / "examples" / "pd-disaggregation.yaml").read_text())[
        "spec"])
    return {
        "engine": render_engine_deployment(owner, spec, 2)["spec"]["template"],
        "router": render_router_deployment(owner, spec)["spec"]["template"],
        "prefill": render_engine_deployment(owner, pd, 1, ROLE_PREFILL)["spec"]["template"],
        "decode": render_engine_deployment(owner, pd, 2)["spec"]["template"],
    }


def engine_policies(objects: list[dict[str, Any]], suffix: str = "-engines"
                    ) -> list[dict[str, Any]]:
    """The chart's NetworkPolicies named ...-engines (decode) or ...-prefill-engines."""
    other = "-prefill-engines" if suffix == "-engines" else None
    return [p for p in of_kind(objects, "NetworkPolicy") if p["metadata"]["name"].endswith(suffix)
            and not (other and p["metadata"]["name"].endswith(other))]


def test_network_policy_one_per_engine_namespace(render_chart) -> None:
    for suffix in ("-engines", "-prefill-engines"):
        watched = engine_policies(render_chart(EVERYTHING_ON), suffix)
        assert sorted(p["metadata"]["namespace"] for p in watched) == ["serving", "team-b"]
        cluster_wide = engine_policies(render_chart({"networkPolicy.enabled": "true"}), suffix)
        assert [p["metadata"]["namespace"] for p in cluster_wide] == ["shoal-system"]
        explicit = engine_policies(
            render_chart({**EVERYTHING_ON, "networkPolicy.namespaces": "{ml}"}), suffix)
        assert [p["metadata"]["namespace"] for p in explicit] == ["ml"]


def test_network_policy_selects_engines_and_admits_routers_and_operator(
        render_chart, operator_rendered_pods) -> None:
    objects = render_chart(EVERYTHING_ON)
    policy = engine_policies(objects)[0]["spec"]
    engine_labels = operator_rendered_pods["engine"]["metadata"]["labels"]
    router_labels = operator_rendered_pods["router"]["metadata"]["labels"]
    assert matches(policy["podSelector"]["matchLabels"], engine_labels)
    assert not matches(policy["podSelector"]["matchLabels"], router_labels)
    assert policy["policyTypes"] == ["Ingress"]  # egress open: weights download from the hub

    (rule,) = policy["ingress"]
    peers = rule["from"]
    same_namespace = [p for p in peers if "namespaceSelector" not in p]
    assert any(matches(p["podSelector"]["matchLabels"], router_labels) for p in same_namespace)
    assert not any(matches(p["podSelector"]["matchLabels"], engine_labels)
                   for p in same_namespace)

    (operator_deployment,) = of_kind(objects, "Deployment")
    operator_labels = operator_deployment["spec"]["template"]["metadata"]["labels"]
    (operator_peer,) = [p for p in peers if "namespaceSelector" in p]
    assert operator_peer["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "shoal-system"}
    assert matches(operator_peer["podSelector"]["matchLabels"], operator_labels)

    ports = {p["port"] for p in rule["ports"]}
    engine_container = operator_rendered_pods["engine"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in engine_container["ports"]} <= ports
    assert ENGINE_PORT in ports


def test_network_policy_extra_sources_are_appended(render_chart) -> None:
    values = {**EVERYTHING_ON,
              "networkPolicy.extraIngressFrom[0].namespaceSelector.matchLabels.team": "obs"}
    for suffix in ("-engines", "-prefill-engines"):
        policy = engine_policies(render_chart(values), suffix)[0]["spec"]
        peers = policy["ingress"][0]["from"]
        assert peers[-1] == {"namespaceSelector": {"matchLabels": {"team": "obs"}}}
        assert len(peers) == 3


def test_prefill_pods_admit_routers_and_operator_and_decode_engines_on_kv_transfer(
        render_chart, operator_rendered_pods) -> None:
    objects = render_chart(EVERYTHING_ON)
    (engine_policy,) = [p for p in engine_policies(objects)
                        if p["metadata"]["namespace"] == "serving"]
    (policy,) = [p["spec"] for p in engine_policies(objects, "-prefill-engines")
                 if p["metadata"]["namespace"] == "serving"]
    prefill, decode = operator_rendered_pods["prefill"], operator_rendered_pods["decode"]
    assert matches(policy["podSelector"]["matchLabels"], prefill["metadata"]["labels"])
    assert not matches(policy["podSelector"]["matchLabels"], decode["metadata"]["labels"])
    # the decode pool stays under the engines' policy
    assert matches(engine_policy["spec"]["podSelector"]["matchLabels"],
                   decode["metadata"]["labels"])
    serving, pulls = policy["ingress"]
    assert serving == engine_policy["spec"]["ingress"][0]  # routers, operator, extras
    (kv_port,) = [p["containerPort"] for p in prefill["spec"]["containers"][0]["ports"]
                  if p["name"] == "kv-transfer"]
    assert pulls["ports"] == [{"protocol": "TCP", "port": kv_port}]
    (peer,) = pulls["from"]
    assert matches(peer["podSelector"]["matchLabels"], decode["metadata"]["labels"])
    assert not matches(peer["podSelector"]["matchLabels"],
                       operator_rendered_pods["router"]["metadata"]["labels"])


# --- Grafana dashboard ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported_metrics() -> dict[str, set[str]]:
    """Sample name -> label names, from the serving engineer's real metrics registry."""
    from shoal.runtime.api.metrics import ServerMetrics

    metrics = ServerMetrics("demo")
    metrics.set_phase_durations({"loading": 1.0})
    metrics.observe_first_token(0.1)
    metrics.observe_inter_token(0.01)
    metrics.observe_finished("stop", 1.0)
    metrics.observe_rejected(429)
    exported: dict[str, set[str]] = {}
    for line in metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = set(re.findall(r'(\w+)="', rest.split("}")[0])) if rest else set()
            exported.setdefault(name.split()[0], set()).update(labels)
    return exported


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_configmap_carries_the_json_file(render_chart, dashboard) -> None:
    (config_map,) = of_kind(render_chart({"dashboard.enabled": "true"}), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["shoal-engines.json"]) == dashboard


def test_dashboard_queries_only_metrics_the_engine_exports(dashboard, exported_metrics) -> None:
    # Prometheus adds these to every scraped sample (ServiceMonitor targets); `le` is a bucket.
    scrape_labels = {"namespace", "pod", "service", "endpoint", "instance", "job", "container"}
    variables = [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    for expr in _exprs(dashboard) + variables:
        names = re.findall(r"shoal:[a-z0-9_]+", expr)
        assert names, expr
        for name in names:
            assert name in exported_metrics, f"{name} is not exported (in: {expr})"
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in scrape_labels or any(
                    label in exported_metrics[n] for n in names), f"{label} in {expr}"


@pytest.mark.parametrize("metric, needs", [
    ("shoal:kv_cache_usage_perc", ["{{pod}}"]),
    ("shoal:prefix_cache_hits_total", ["by (pod)"]),
    ("shoal:num_requests_waiting", ["{{pod}}"]),
    ("shoal:num_requests_running", ["{{pod}}"]),
    ("shoal:time_to_first_token_seconds_bucket", ["histogram_quantile(0.5", "histogram_quantile(0.99"]),
    ("shoal:inter_token_latency_seconds_bucket", ["histogram_quantile(0.5", "histogram_quantile(0.99"]),
    ("shoal:generation_tokens_total", ["rate("]),
    ("shoal:num_preemptions_total", ["by (pod)"]),
    ("shoal:startup_phase_duration_seconds", ["{{phase}}"]),
])
def test_dashboard_shows_what_the_issue_asks_for(dashboard, metric: str, needs: list[str]) -> None:
    panel_texts = [json.dumps(p) for p in dashboard["panels"] if p["type"] != "row"]
    using = [text for text in panel_texts if metric in text]
    assert using, f"no panel shows {metric}"
    for needed in needs:
        assert any(needed in text for text in using), f"{metric}: no panel with {needed}"


def test_dashboard_panels_have_unique_ids_and_fit_the_grid(dashboard) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
