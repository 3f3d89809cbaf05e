"""Reading a replica's Prometheus ``/metrics`` text into the few numbers routing uses."""

from __future__ import annotations

import math
from dataclasses import dataclass

RUNNING = "shoal:num_requests_running"
WAITING = "shoal:num_requests_waiting"
KV_USAGE = "shoal:kv_cache_usage_perc"
PREFIX_QUERIES = "shoal:prefix_cache_queries_total"
PREFIX_HITS = "shoal:prefix_cache_hits_total"
WANTED = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS)


@dataclass(frozen=True)
class EngineMetrics:
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_cache_queries: float = 0.0  # tokens, cumulative
    prefix_cache_hits: float = 0.0


def parse_samples(text: str) -> dict[str, float]:
    """Sum of every sample per metric name (labels, e.g. model_name, are summed over)."""
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, value_part = rest.rpartition("}")
        else:
            name, _, value_part = line.partition(" ")
        fields = value_part.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[name.strip()] = totals.get(name.strip(), 0.0) + value
    return totals


def parse_engine_metrics(text: str) -> EngineMetrics:
    samples = parse_samples(text)
    return EngineMetrics(
        num_running=samples.get(RUNNING, 0.0),
        num_waiting=samples.get(WAITING, 0.0),
        kv_usage=min(max(samples.get(KV_USAGE, 0.0), 0.0), 1.0),
        prefix_cache_queries=samples.get(PREFIX_QUERIES, 0.0),
        prefix_cache_hits=samples.get(PREFIX_HITS, 0.0),
    )
