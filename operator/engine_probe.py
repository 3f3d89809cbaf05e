"""HTTP I/O against one engine pod: GET /ready, and GET /metrics when ready."""

from __future__ import annotations

from typing import Any

import httpx
from shoal.operator.replica import ProbeResult

from shoal.contract.metrics import parse_engine_metrics


async def probe_engine(http: httpx.AsyncClient, host: str, port: int) -> ProbeResult:
    base = f"http://{host}:{port}"
    try:
        ready = await http.get(f"{base}/ready")
    except httpx.HTTPError:
        return ProbeResult(ready_status=None)
    body: dict[str, Any] | None
    try:
        parsed = ready.json()
        body = parsed if isinstance(parsed, dict) else None
    except ValueError:
        body = None
    if ready.status_code != 200:
        return ProbeResult(ready_status=ready.status_code, ready_body=body)
    try:
        metrics = await http.get(f"{base}/metrics")
        metrics.raise_for_status()
    except httpx.HTTPError:
        # Ready but not scrapeable this round: still ready, just no figures.
        return ProbeResult(ready_status=200, ready_body=body)
    return ProbeResult(ready_status=200, ready_body=body,
                       metrics=parse_engine_metrics(metrics.text))
