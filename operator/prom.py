"""The few `shoal:` metrics the operator reads, parsed from Prometheus text exposition."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineMetrics:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0  # 0-1
    prefix_cache_queries: float = 0.0  # tokens, cumulative
    prefix_cache_hits: float = 0.0  # tokens, cumulative
    preemptions: float = 0.0
    finished: float = 0.0  # requests finished, cumulative (any reason): activity for scale to 0


_FIELDS = {
    "shoal:num_requests_running": "running",
    "shoal:num_requests_waiting": "waiting",
    "shoal:kv_cache_usage_perc": "kv_cache_usage",
    "shoal:prefix_cache_queries_total": "prefix_cache_queries",
    "shoal:prefix_cache_hits_total": "prefix_cache_hits",
    "shoal:num_preemptions_total": "preemptions",
    "shoal:request_success_total": "finished",
}


def _sample(line: str) -> tuple[str, float] | None:
    """`name{labels} value [timestamp]` -> (name, value); None for lines we do not read."""
    if "{" in line:
        name, _, rest = line.partition("{")
        close = rest.rfind("}")
        if close < 0:
            return None
        fields = rest[close + 1:].split()
    else:
        name, *fields = line.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return name.strip(), value


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Sums each metric over its label sets (one model per engine, so usually one sample)."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _sample(line)
        if sample is None:
            continue
        name, value = sample
        field = _FIELDS.get(name)
        if field is not None and math.isfinite(value):
            totals[field] = totals.get(field, 0.0) + value
    return EngineMetrics(**totals)
