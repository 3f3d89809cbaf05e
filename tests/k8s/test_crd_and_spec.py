"""The CRD is the contract users write against: schema, CEL rules, defaults, subresources,
printer columns; the operator's own parser agrees with it field by field."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from shoal.operator.spec.model_uri import URI_PATTERN, parse_model_uri
from shoal.operator.spec.service import SpecError, parse_spec

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

GOOD = {
    "apiVersion": "serving.shoal.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "m"},
    "spec": {"model": {"uri": "hf://Qwen/Qwen3-0.6B@main"}},
}


def with_spec(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GOOD)
    obj["spec"].update(changes)
    return obj


def test_chart_ships_the_same_crd_file() -> None:
    ours = (ROOT / "crds" / "serving.shoal.dev_inferenceservices.yaml").read_bytes()
    chart = (ROOT / "charts" / "shoal" / "crds" / "serving.shoal.dev_inferenceservices.yaml")
    assert chart.read_bytes() == ours


def test_crd_is_a_valid_apiextensions_object(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, "1.30.0", strict=True)


def test_names_subresources_and_short_name(crd: dict[str, Any]) -> None:
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"]) == ("InferenceService", "inferenceservices")
    assert names["shortNames"] == ["infsvc"]  # not KServe's isvc
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}


def test_printer_columns(crd: dict[str, Any]) -> None:
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["Ready", "Prefill", "KV%", "Hit%", "Queue", "Model",
                                           "Phase",
                                           "Age"]
    status_props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "status"]["properties"]
    for column in columns[:-1]:
        field, *inner = column["jsonPath"].removeprefix(".status.").split(".")
        assert field in status_props and all(
            key in status_props[field]["properties"] for key in inner), \
            f"{column['name']} reads an undeclared status field"


def _structural_problems(schema: dict[str, Any], path: str) -> list[str]:
    problems = []
    if "type" not in schema and not schema.get("x-kubernetes-int-or-string") and \
            not schema.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(path)
    for key, sub in (schema.get("properties") or {}).items():
        problems += _structural_problems(sub, f"{path}.{key}")
    if "items" in schema:
        problems += _structural_problems(schema["items"], f"{path}[]")
    return problems


def test_schema_is_structural(crd_schema: dict[str, Any]) -> None:
    assert _structural_problems(crd_schema, "") == []


def test_uri_pattern_in_crd_is_the_parsers(crd_schema: dict[str, Any]) -> None:
    uri = crd_schema["properties"]["spec"]["properties"]["model"]["properties"]["uri"]
    assert uri["pattern"] == URI_PATTERN


@pytest.mark.parametrize("uri, scheme, detail", [
    ("hf://Qwen/Qwen3-8B", "hf", ("Qwen/Qwen3-8B", "")),
    ("hf://meta-llama/Llama-3.1-8B@v1.0", "hf", ("meta-llama/Llama-3.1-8B", "v1.0")),
    ("pvc://weights/llama/8b", "pvc", ("weights", "llama/8b")),
    ("builtin://default", "builtin", ("", "")),
    ("/models/qwen", "path", ("", "/models/qwen")),
])
def test_model_uri_forms(uri: str, scheme: str, detail: tuple[str, str]) -> None:
    source = parse_model_uri(uri)
    assert source.scheme == scheme
    if scheme == "hf":
        assert (source.repo, source.revision) == detail
    elif scheme == "pvc":
        assert (source.claim, source.path) == detail
    elif scheme == "path":
        assert source.path == detail[1]


def test_defaults_are_the_same_in_crd_and_parser(admit: Any, crd_schema: dict[str, Any]) -> None:
    assert admit(GOOD) == []
    spec = parse_spec(GOOD["spec"])
    props = crd_schema["properties"]["spec"]["properties"]
    assert spec.runtime.block_size == props["runtime"]["properties"]["blockSize"]["default"]
    assert spec.runtime.prefix_caching is props["runtime"]["properties"]["prefixCaching"]["default"]
    assert spec.resources.gpus == props["resources"]["properties"]["gpus"]["default"]
    assert spec.routing.policy == props["routing"]["properties"]["policy"]["default"]
    assert spec.startup_timeout_seconds == \
        props["startup"]["properties"]["timeoutSeconds"]["default"]
    assert spec.runtime.image == props["runtime"]["properties"]["image"]["default"]
    assert spec.replicas == 1 and spec.autoscaling is None
    assert spec.model.served_name == "Qwen/Qwen3-0.6B"


def test_autoscaled_services_start_at_min_replicas() -> None:
    spec = parse_spec({"model": {"uri": "builtin://default"},
                       "autoscaling": {"minReplicas": 2, "maxReplicas": 5}})
    assert spec.replicas == 2
    assert parse_spec({"model": {"uri": "builtin://default"}, "replicas": 4,
                       "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}).replicas == 4


def test_an_autoscaled_prefill_pool_starts_at_its_minimum_and_may_reach_zero() -> None:
    base = {"model": {"uri": "builtin://default"}, "resources": {"gpus": 0}}
    spec = parse_spec({**base, "prefill": {"autoscaling": {"minReplicas": 0, "maxReplicas": 3,
                                                           "targetWaitingRequests": 2}}})
    assert spec.prefill is not None and spec.prefill.replicas == 0
    policy = spec.prefill.autoscaling
    assert policy is not None and policy.scales_to_zero and policy.max_replicas == 3
    assert policy.target_waiting_requests == 2 and spec.autoscaling is None
    fixed = parse_spec({**base, "prefill": {}}).prefill
    assert fixed is not None and (fixed.replicas, fixed.autoscaling) == (1, None)
    # an external picker (llm-d's) would never ask for a prefill replica: refused
    external = {"inferencePool": True, "endpointPicker": "external",
                "endpointPickerRef": {"name": "llm-d-epp"}}
    with pytest.raises(SpecError, match="spec.prefill.autoscaling.minReplicas"):
        parse_spec({**base, "routing": {"gateway": external},
                    "prefill": {"autoscaling": {"minReplicas": 0, "maxReplicas": 1}}})


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_admitted_and_parse(path: Path, admit: Any) -> None:
    services = [d for d in yaml.safe_load_all(path.read_text())
                if d and d["kind"] == "InferenceService"]
    assert services
    for obj in services:
        assert admit(obj) == []
        parse_spec(obj["spec"])


def test_cpu_demo_needs_no_gpu() -> None:
    obj = yaml.safe_load((ROOT / "examples" / "cpu-demo.yaml").read_text())
    spec = parse_spec(obj["spec"])
    assert spec.resources.gpus == 0 and spec.model.source.scheme == "builtin"


# (spec change, field the rejection must name) — rejected by the CRD (schema or CEL) and by the
# operator's parser alike.
BAD_SPECS = [
    ("negative replicas", {"replicas": -1}, "spec.replicas"),
    ("min > max", {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas"),
    ("unknown routing policy", {"routing": {"policy": "random"}}, "spec.routing.policy"),
    ("missing model uri", {"model": {"servedName": "x"}}, "spec.model"),
    ("malformed hf uri", {"model": {"uri": "hf://just-a-name"}}, "spec.model.uri"),
    ("unknown uri scheme", {"model": {"uri": "s3://bucket/model"}}, "spec.model.uri"),
    ("replicas outside autoscaling range",
     {"replicas": 9, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}, "spec.replicas"),
    ("cuda without gpus", {"resources": {"gpus": 0}, "runtime": {"device": "cuda"}},
     "spec.resources.gpus"),
    ("storage with claim and size", {"storage": {"claimName": "c", "size": "10Gi"}},
     "spec.storage"),
    ("gpu memory utilization 0", {"runtime": {"gpuMemoryUtilization": 0}},
     "spec.runtime.gpuMemoryUtilization"),
    ("startup budget too small", {"startup": {"timeoutSeconds": 5}},
     "spec.startup.timeoutSeconds"),
    ("unknown dtype", {"runtime": {"dtype": "int3"}}, "spec.runtime.dtype"),
    ("external picker without a ref",
     {"routing": {"gateway": {"inferencePool": True, "endpointPicker": "external"}}},
     "spec.routing.gateway.endpointPickerRef"),
    ("scale to zero without the router",
     {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}, "routing": {"enabled": False}},
     "spec.autoscaling.minReplicas"),
    ("prefill pool without the router",
     {"prefill": {"replicas": 1}, "routing": {"enabled": False}}, "spec.prefill"),
    ("prefill pool with a policy that ignores caches",
     {"prefill": {}, "routing": {"policy": "least-load"}}, "spec.prefill"),
    ("prefill pool of tensor-parallel engines", {"prefill": {"resources": {"gpus": 2}}},
     "spec.prefill"),
    ("prefill autoscaling min > max",
     {"prefill": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}},
     "spec.prefill.autoscaling.minReplicas"),
    ("prefill replicas outside its autoscaling range",
     {"prefill": {"replicas": 5, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}},
     "spec.prefill.replicas"),
    ("unknown endpoint picker", {"routing": {"gateway": {"endpointPicker": "envoy"}}},
     "spec.routing.gateway.endpointPicker"),
    ("auth without the clients' keys", {"auth": {"cacheSharing": "global"}}, "spec.auth"),
    ("unknown cache sharing",
     {"auth": {"apiKeySecretRef": {"name": "k"}, "cacheSharing": "none"}},
     "spec.auth.cacheSharing"),
    ("router key is a client key",
     {"auth": {"apiKeySecretRef": {"name": "k"},
               "upstreamKeySecretRef": {"name": "k", "key": "api-key"}}},
     "spec.auth.upstreamKeySecretRef"),
]


@pytest.mark.parametrize("change, field", [(c, f) for _, c, f in BAD_SPECS],
                         ids=[name for name, _, _ in BAD_SPECS])
def test_bad_specs_are_rejected_naming_the_field(change: dict[str, Any], field: str,
                                                 admit: Any) -> None:
    obj = with_spec(**change)
    errors = admit(obj)
    assert errors, "the CRD admitted a bad spec"
    assert any(e.startswith(field) for e in errors), errors
    with pytest.raises(SpecError) as raised:
        parse_spec(obj["spec"])
    assert raised.value.field.startswith(field), str(raised.value)
    assert field in str(raised.value)


def test_every_cel_rule_is_exercised_by_a_bad_spec(cel_rule_messages: set[str],
                                                   admit: Any) -> None:
    produced = {e.split(": ", 1)[1] for _, change, _ in BAD_SPECS
                for e in admit(with_spec(**change))}
    assert len(cel_rule_messages) == 10
    assert cel_rule_messages <= produced, cel_rule_messages - produced
