"""Scale to and from zero, the pure decisions: activity, the idle window, the router's request."""

from __future__ import annotations

from shoal.operator.decide.autoscale import (
    Activity,
    decide_replicas,
    decide_zero,
    observe_activity,
    parse_stamp,
)
from shoal.operator.names import Owner
from shoal.operator.render.router import render_router_rbac, router_args
from shoal.operator.spec.service import AutoscalingSpec, parse_spec

ZERO = AutoscalingSpec(min_replicas=0, max_replicas=3, scale_to_zero_after_seconds=60)


def test_activity_moves_with_running_waiting_or_finished_requests() -> None:
    start = observe_activity(None, 0, 0, 5.0, now=100.0)
    assert start == Activity(100.0, 5.0)
    assert observe_activity(start, 0, 0, 5.0, now=130.0) == start  # nothing happened
    assert observe_activity(start, 1, 0, 5.0, now=130.0).last_active_at == 130.0
    assert observe_activity(start, 0, 2, 5.0, now=130.0).last_active_at == 130.0
    moved = observe_activity(start, 0, 0, 7.0, now=130.0)  # came and went between rounds
    assert moved == Activity(130.0, 7.0)
    assert observe_activity(start, 0, 0, None, now=130.0) == start  # no engine scraped


def test_idle_window_scales_to_zero_and_a_capacity_request_back_to_one() -> None:
    active = Activity(1000.0, 3.0)
    assert decide_zero(ZERO, 1, active, False, now=1059.0) is None  # not idle long enough
    down = decide_zero(ZERO, 1, active, False, now=1060.0)
    assert down is not None and down.replicas == 0 and "no request for 60 s" in down.reason
    assert decide_zero(ZERO, 1, active, True, now=5000.0) is None  # the router is waiting
    assert decide_zero(ZERO, 0, active, False, now=5000.0) is None  # stays at zero
    up = decide_zero(ZERO, 0, active, True, now=5000.0)
    assert up is not None and up.replicas == 1
    assert up.activity.last_active_at == 5000.0  # the idle window starts again
    keeps_one = AutoscalingSpec(min_replicas=1, max_replicas=3)
    assert decide_zero(keeps_one, 1, active, False, now=1e9) is None


def test_the_load_based_autoscaler_alone_never_reaches_zero() -> None:
    recent = Activity(1000.0, 0.0)
    decision, _ = decide_replicas(ZERO, 2, 2, 0.0, 0, (), recent, False, now=1010.0)
    assert decision.replicas >= 1  # an empty KV cache is no reason to drop the last engine
    decision, _ = decide_replicas(ZERO, 0, 0, None, 0, (), recent, False, now=1010.0)
    assert decision.replicas == 0  # at zero, no request: stays
    # an engine still loading (none ready) is not idle, however long it takes
    decision, activity = decide_replicas(ZERO, 1, 0, None, 0, (), recent, False, now=5000.0)
    assert decision.replicas == 1 and activity.last_active_at == 5000.0


def test_router_of_a_scale_to_zero_service_holds_and_may_annotate_only_its_own_object() -> None:
    owner = Owner("lazy", "serving", "u")
    spec = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                       "autoscaling": {"minReplicas": 0, "maxReplicas": 2,
                                       "holdTimeoutSeconds": 120}})
    args = router_args(owner, spec)
    assert args[args.index("--hold-timeout") + 1] == "120"
    assert args[args.index("--capacity-request") + 1] == "lazy"
    role = render_router_rbac(owner, spec)[1]
    assert {"apiGroups": ["serving.shoal.dev"], "resources": ["inferenceservices"],
            "resourceNames": ["lazy"], "verbs": ["get", "patch"]} in role["rules"]
    plain = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0}})
    assert "--hold-timeout" not in router_args(owner, plain)
    assert len(render_router_rbac(owner, plain)[1]["rules"]) == 1


def test_router_annotation_stamps_parse() -> None:
    assert parse_stamp("2026-12-01T15:00:00.250000Z") == 1796137200.25
    assert parse_stamp(None) is None and parse_stamp("yesterday") is None


def test_router_and_operator_agree_on_the_capacity_annotation() -> None:
    from shoal.operator.names import ANNOTATION_CAPACITY_REQUEST
    from shoal.runtime.router.replicas.capacity_request import CAPACITY_ANNOTATION

    assert CAPACITY_ANNOTATION == ANNOTATION_CAPACITY_REQUEST


def test_router_of_a_prefill_pool_at_zero_asks_for_it_without_holding_requests() -> None:
    owner = Owner("pd", "serving", "u")
    spec = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                       "prefill": {"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}})
    args = router_args(owner, spec)
    assert args[args.index("--capacity-request") + 1] == "pd"
    assert "--hold-timeout" not in args  # the decode engines compute prompts meanwhile
    role = render_router_rbac(owner, spec)[1]
    assert {"apiGroups": ["serving.shoal.dev"], "resources": ["inferenceservices"],
            "resourceNames": ["pd"], "verbs": ["get", "patch"]} in role["rules"]
    at_one = parse_spec({"model": {"uri": "builtin://default"}, "resources": {"gpus": 0},
                         "prefill": {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}}})
    assert "--capacity-request" not in router_args(owner, at_one)


def test_router_and_operator_agree_on_the_prefill_capacity_annotation() -> None:
    from shoal.operator.names import ANNOTATION_PREFILL_CAPACITY_REQUEST
    from shoal.runtime.router.replicas.capacity_request import PREFILL_CAPACITY_ANNOTATION

    assert PREFILL_CAPACITY_ANNOTATION == ANNOTATION_PREFILL_CAPACITY_REQUEST
