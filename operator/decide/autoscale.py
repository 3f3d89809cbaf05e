"""Built-in autoscaler (pure): replicas from KV-cache usage and waiting requests, and, with
minReplicas 0, scale to zero after an idle window and back to one on the router's request.

Like the HPA: desired = ceil(ready * max(kv / kv_target, waiting_per_replica / waiting_target)),
ignored within a 10% tolerance, clamped to [min, max]. Scale-up is immediate; scale-down takes
the highest recommendation of the last scaleDownDelaySeconds (stabilization window), so a short
lull never drops replicas that take minutes to load again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from shoal.operator.spec.service import AutoscalingSpec

TOLERANCE = 0.1


@dataclass(frozen=True)
class Recommendation:
    at: float  # unix seconds
    replicas: int


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    recommendation: int
    history: tuple[Recommendation, ...]
    reason: str


def recommend(policy: AutoscalingSpec, current: int, ready: int, kv_usage: float | None,
              waiting: int) -> tuple[int, str]:
    """The replica count the load asks for right now (before stabilization)."""
    if ready == 0 or kv_usage is None:
        # Nothing measured: hold (a scale decision on no data would flap while engines load).
        return min(max(current, policy.min_replicas), policy.max_replicas), "no ready replicas"
    kv_ratio = kv_usage / policy.target_kv_cache_usage
    queue_ratio = (waiting / ready) / policy.target_waiting_requests
    ratio = max(kv_ratio, queue_ratio)
    why = (f"KV cache {kv_usage:.0%} (target {policy.target_kv_cache_usage:.0%})"
           if kv_ratio >= queue_ratio else
           f"{waiting / ready:.1f} waiting per replica (target {policy.target_waiting_requests:g})")
    if abs(ratio - 1.0) <= TOLERANCE:
        wanted = current
    else:
        wanted = math.ceil(ready * ratio - 1e-9)
    return min(max(wanted, policy.min_replicas), policy.max_replicas), why


def decide_scale(policy: AutoscalingSpec, current: int, ready: int, kv_usage: float | None,
                 waiting: int, history: tuple[Recommendation, ...], now: float) -> ScaleDecision:
    wanted, why = recommend(policy, current, ready, kv_usage, waiting)
    window_start = now - policy.scale_down_delay_seconds
    kept = tuple(r for r in history if r.at >= window_start) + (Recommendation(now, wanted),)
    if wanted >= current:
        target = wanted
    else:
        target = max(r.replicas for r in kept)  # highest recent recommendation bounds the drop
        target = min(target, current)
    target = min(max(target, policy.min_replicas), policy.max_replicas)
    return ScaleDecision(replicas=target, recommendation=wanted, history=kept, reason=why)


@dataclass(frozen=True)
class Activity:
    """When the engines last had work: kept in status.autoscaler between rounds."""

    last_active_at: float  # unix seconds
    requests_seen: float  # finished requests summed over the ready engines, last observed


def observe_activity(previous: Activity | None, running: int, waiting: int,
                     finished: float | None, now: float) -> Activity:
    """Active now when a request runs or waits, or the finished count moved since the last
    round (a request that came and went between two rounds). ``finished`` is None when no
    engine could be scraped: nothing is known, so nothing moves."""
    if previous is None:
        return Activity(now, finished or 0.0)
    if finished is None:
        return previous
    if running or waiting or finished != previous.requests_seen:
        return Activity(now, finished)
    return previous


def parse_stamp(value: str | None) -> float | None:
    """The router's RFC 3339 annotation -> unix seconds (None: absent or unreadable)."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class ZeroDecision:
    replicas: int
    reason: str
    activity: Activity  # a scale from zero counts as activity: the idle window restarts


def decide_zero(policy: AutoscalingSpec, current: int, activity: Activity,
                capacity_requested: bool, now: float) -> ZeroDecision | None:
    """minReplicas 0 only. At 0, a capacity request from the router -> 1 (the load-based
    autoscaler takes over from there). Above 0, idle for scaleToZeroAfterSeconds -> 0.
    None: leave it to the load-based decision."""
    if not policy.scales_to_zero:
        return None
    if current == 0:
        if capacity_requested:
            return ZeroDecision(1, "the router asked for a replica", Activity(
                now, activity.requests_seen))
        return None
    idle = now - activity.last_active_at
    if capacity_requested:  # the router is holding requests right now: not idle
        return None
    if idle >= policy.scale_to_zero_after_seconds:
        return ZeroDecision(0, f"no request for {idle:.0f} s (scaleToZeroAfterSeconds "
                               f"{policy.scale_to_zero_after_seconds})", activity)
    return None


def decide_replicas(policy: AutoscalingSpec, current: int, ready: int, kv_usage: float | None,
                    waiting: int, history: tuple[Recommendation, ...], activity: Activity,
                    capacity_requested: bool, now: float) -> tuple[ScaleDecision, Activity]:
    """The round's decision: to or from zero first (minReplicas 0), else the load-based one,
    which with minReplicas 0 never goes below 1 on its own: only the idle window reaches 0.
    The idle window runs only while an engine is ready: one still loading is not idle."""
    if current > 0 and ready == 0:
        activity = Activity(now, activity.requests_seen)
    zero = decide_zero(policy, current, activity, capacity_requested, now)
    if zero is not None:
        return ScaleDecision(zero.replicas, zero.replicas, history, zero.reason), zero.activity
    decision = decide_scale(policy, current, ready, kv_usage, waiting, history, now)
    if policy.scales_to_zero and current > 0 and decision.replicas < 1:
        decision = ScaleDecision(1, decision.recommendation, decision.history, decision.reason)
    return decision, activity
