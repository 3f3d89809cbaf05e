"""Recycling crash-looping or stuck engine pods, with exponential backoff (pure).

The kubelet already restarts a dead container with its own backoff; the operator additionally
deletes a replica that keeps failing (CrashLoop, StartupTimeout) so the Deployment creates a
fresh pod, which may land on another node (a bad GPU is a common cause). It waits longer after
each recycle so a broken spec does not churn pods.
"""

from __future__ import annotations

from dataclasses import dataclass

BASE_DELAY_SECONDS = 60.0
MAX_DELAY_SECONDS = 3600.0
RECYCLE_REASONS = ("CrashLoop", "StartupTimeout")


@dataclass(frozen=True)
class RecycleState:
    count: int = 0  # recycles since the service was last fully ready
    last_at: float | None = None  # unix seconds


def next_recycle_at(state: RecycleState) -> float:
    if state.last_at is None:
        return 0.0
    delay = min(BASE_DELAY_SECONDS * (2 ** max(0, state.count - 1)), MAX_DELAY_SECONDS)
    return state.last_at + delay


def may_recycle(reason: str | None, state: RecycleState, now: float) -> bool:
    return reason in RECYCLE_REASONS and now >= next_recycle_at(state)


def after_recycle(state: RecycleState, now: float) -> RecycleState:
    return RecycleState(count=state.count + 1, last_at=now)


def after_round(state: RecycleState, all_ready: bool) -> RecycleState:
    """A fully ready service forgets its failures: the next incident starts at the base delay."""
    return RecycleState() if all_ready else state
