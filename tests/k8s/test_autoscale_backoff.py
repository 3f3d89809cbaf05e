"""Scaling and recycling decisions are pure functions of load, history and time."""

from __future__ import annotations

import pytest
from shoal.operator.decide.autoscale import Recommendation, decide_scale, recommend
from shoal.operator.decide.backoff import (
    BASE_DELAY_SECONDS,
    MAX_DELAY_SECONDS,
    RecycleState,
    after_recycle,
    after_round,
    may_recycle,
    next_recycle_at,
)
from shoal.operator.spec.service import AutoscalingSpec

POLICY = AutoscalingSpec(min_replicas=1, max_replicas=8, target_kv_cache_usage=0.5,
                         target_waiting_requests=4, scale_down_delay_seconds=300)


@pytest.mark.parametrize("ready, kv, waiting, wanted", [
    (2, 0.5, 0, 2),      # on target
    (2, 0.53, 0, 2),     # within the 10% tolerance
    (2, 1.0, 0, 4),      # KV twice the target
    (2, 0.2, 16, 4),     # queue: 8 per replica vs 4
    (4, 0.1, 0, 1),      # idle: down to min
    (4, 1.0, 100, 8),    # clamped to max
])
def test_recommendation(ready: int, kv: float, waiting: int, wanted: int) -> None:
    assert recommend(POLICY, ready, ready, kv, waiting)[0] == wanted


def test_no_measurements_hold_the_current_count() -> None:
    assert recommend(POLICY, 3, 0, None, 0)[0] == 3


def test_scale_up_is_immediate() -> None:
    decision = decide_scale(POLICY, 2, 2, 1.0, 0, (), now=1000.0)
    assert decision.replicas == 4 and "KV cache" in decision.reason


def test_scale_down_waits_for_the_stabilization_window() -> None:
    history: tuple[Recommendation, ...] = ()
    now = 1000.0
    decision = decide_scale(POLICY, 4, 4, 1.0, 0, history, now)  # busy: wants 8
    history = decision.history
    for step in range(1, 10):  # load vanishes: recommendations drop to 1, replicas hold
        now = 1000.0 + step * 30
        decision = decide_scale(POLICY, 4, 4, 0.05, 0, history, now)
        history = decision.history
        assert decision.replicas == 4, f"dropped after {step * 30}s"
    now = 1000.0 + 301  # the busy recommendation left the window
    decision = decide_scale(POLICY, 4, 4, 0.05, 0, history, now)
    assert decision.replicas == 1
    assert all(r.at >= now - 300 for r in decision.history)


def test_a_short_lull_inside_the_window_never_scales_down() -> None:
    history = (Recommendation(900.0, 4),)
    assert decide_scale(POLICY, 4, 4, 0.0, 0, history, 1000.0).replicas == 4


def test_recycle_backoff_doubles_and_is_capped() -> None:
    state = RecycleState()
    assert may_recycle("CrashLoop", state, 0.0)
    assert not may_recycle("RankFailure", state, 0.0)  # the kubelet restart handles one crash
    state = after_recycle(state, 100.0)
    assert next_recycle_at(state) == 100.0 + BASE_DELAY_SECONDS
    assert not may_recycle("CrashLoop", state, 100.0 + BASE_DELAY_SECONDS - 1)
    state = after_recycle(state, 200.0)
    assert next_recycle_at(state) == 200.0 + 2 * BASE_DELAY_SECONDS
    for _ in range(20):
        state = after_recycle(state, 300.0)
    assert next_recycle_at(state) == 300.0 + MAX_DELAY_SECONDS
    assert after_round(state, all_ready=True) == RecycleState()
    assert after_round(state, all_ready=False) == state
