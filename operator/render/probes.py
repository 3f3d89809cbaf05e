"""Probe sizing: startup gets the whole startup budget, readiness is quick, liveness lenient.

Restarting an engine reloads its weights (minutes), so liveness tolerates ~30 s of silence;
readiness reacts within seconds so traffic leaves a draining or hung engine fast.
"""

from __future__ import annotations

import math
from typing import Any

STARTUP_PERIOD_SECONDS = 10
READINESS_PERIOD_SECONDS = 2
LIVENESS_PERIOD_SECONDS = 10
LIVENESS_FAILURES = 3
PRESTOP_SLEEP_SECONDS = 5  # let endpoint removal reach the router before SIGTERM starts the drain


def _http(path: str, port: str, period: int, failures: int, timeout: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def startup_probe(timeout_seconds: int, port: str = "http") -> dict[str, Any]:
    """Liveness is off until this succeeds; failing it for the whole budget restarts the pod."""
    failures = max(1, math.ceil(timeout_seconds / STARTUP_PERIOD_SECONDS))
    return _http("/health", port, STARTUP_PERIOD_SECONDS, failures, 5)


def liveness_probe(port: str = "http") -> dict[str, Any]:
    return _http("/health", port, LIVENESS_PERIOD_SECONDS, LIVENESS_FAILURES, 5)


def readiness_probe(port: str = "http") -> dict[str, Any]:
    return _http("/ready", port, READINESS_PERIOD_SECONDS, 2, 2)


def termination_grace_seconds(shutdown_timeout_seconds: int) -> int:
    """preStop sleep + the engine's own drain budget + a margin for process exit."""
    return PRESTOP_SLEEP_SECONDS + shutdown_timeout_seconds + 10
