"""The operator's HTTP calls to one engine pod: GET /ready (and /metrics when ready), and the
LoRA adapter sync (list, load, unload: spec/adapters.py says when it runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from shoal.operator.decide.replica import ProbeResult

from shoal.contract.metrics import parse_engine_metrics

SYNC_TIMEOUT_S = 60.0


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


@dataclass(frozen=True)
class SyncPlan:
    load: list[tuple[str, str]]  # (name, path)
    unload: list[str]


def plan_sync(wanted: dict[str, str], served: dict[str, str]) -> SyncPlan:
    """What to load and unload so ``served`` (name -> path) becomes ``wanted``. A changed path
    is an unload and a load."""
    unload = sorted(n for n, p in served.items() if wanted.get(n) != p)
    load = sorted((n, p) for n, p in wanted.items() if served.get(n) != p)
    return SyncPlan(load, unload)


@dataclass
class SyncResult:
    served: list[str] = field(default_factory=list)  # adapters the replica serves afterwards
    errors: list[str] = field(default_factory=list)  # "name: why" for each failed change


async def sync_replica(http: httpx.AsyncClient, host: str, port: int,
                       wanted: dict[str, str]) -> SyncResult:
    """Bring one ready replica's adapters to ``wanted``; never raises."""
    base = f"http://{host}:{port}"
    result = SyncResult()
    try:
        listing = await http.get(f"{base}/v1/models", timeout=SYNC_TIMEOUT_S)
        cards = listing.json().get("data") or []
        served = {c["id"]: c.get("root", "") for c in cards if c.get("parent")}
    except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError) as exc:
        result.errors.append(f"listing adapters: {type(exc).__name__}: {exc}")
        return result
    plan = plan_sync(wanted, served)
    now = dict(served)
    for name in plan.unload:
        if await _post(http, f"{base}/v1/unload_lora_adapter", {"lora_name": name}, name,
                       result):
            now.pop(name, None)
    for name, path in plan.load:
        if await _post(http, f"{base}/v1/load_lora_adapter",
                       {"lora_name": name, "lora_path": path}, name, result):
            now[name] = path
    result.served = sorted(now)
    return result


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, str], name: str,
                result: SyncResult) -> bool:
    try:
        response = await http.post(url, json=body, timeout=SYNC_TIMEOUT_S)
    except httpx.HTTPError as exc:
        result.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        return False
    if response.status_code == 200:
        return True
    try:
        why = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        why = response.text[:200]
    result.errors.append(f"{name}: {response.status_code} {why}")
    return False
