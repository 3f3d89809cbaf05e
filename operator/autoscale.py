"""Built-in autoscaler (pure): replicas from KV-cache usage and waiting requests.

Like the HPA: desired = ceil(ready * max(kv / kv_target, waiting_per_replica / waiting_target)),
ignored within a 10% tolerance, clamped to [min, max]. Scale-up is immediate; scale-down takes
the highest recommendation of the last scaleDownDelaySeconds (stabilization window), so a short
lull never drops replicas that take minutes to load again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.operator.spec import AutoscalingSpec

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
