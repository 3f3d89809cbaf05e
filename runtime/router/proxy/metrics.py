"""The router's own ``/metrics``: per-replica traffic, affinity hits, load imbalance, latency.

Per-replica numbers are read from the replica pool at scrape time (a custom collector), so
there is one source of truth; latencies are histograms observed by the proxy.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from shoal.runtime.router.pd_metrics import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_PREFILL,
    RolePoolCollector,
    pd_decisions_counter,
)
from shoal.runtime.router.replicas.kv_events import EventStreamState
from shoal.runtime.router.replicas.pool import ReplicaPool

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0)


def imbalance(in_flight: list[int]) -> float:
    """max / mean of in-flight counts (1.0 = perfectly even; 1.0 when idle)."""
    if not in_flight or sum(in_flight) == 0:
        return 1.0
    return max(in_flight) / (sum(in_flight) / len(in_flight))


class _PoolCollector(Collector):
    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.kv_event_states: Mapping[str, EventStreamState] = {}

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        replicas = list(self.pool.replicas.values())
        requests = CounterMetricFamily("shoal:router_requests", "Requests routed to a replica",
                                       labels=["replica"])
        hits = CounterMetricFamily("shoal:router_affinity_hits",
                                   "Requests routed to a replica believed to hold a prefix",
                                   labels=["replica"])
        ejections = CounterMetricFamily("shoal:router_ejections",
                                        "Times a replica was taken out of rotation",
                                        labels=["replica"])
        in_flight = GaugeMetricFamily("shoal:router_in_flight", "Open requests per replica",
                                      labels=["replica"])
        ready = GaugeMetricFamily("shoal:router_replica_ready", "1 if the replica is in rotation",
                                  labels=["replica"])
        for r in replicas:
            requests.add_metric([r.url], r.requests)
            hits.add_metric([r.url], r.affinity_hits)
            ejections.add_metric([r.url], r.ejections)
            in_flight.add_metric([r.url], r.in_flight)
            ready.add_metric([r.url], 1.0 if r.ready else 0.0)
        yield from (requests, hits, ejections, in_flight, ready)
        if self.kv_event_states:
            batches = CounterMetricFamily("shoal:router_kv_event_batches",
                                          "KV-event batches applied", labels=["replica"])
            gaps = CounterMetricFamily("shoal:router_kv_event_gaps",
                                       "Missed KV-event batches (sequence jumps)",
                                       labels=["replica"])
            restarts = CounterMetricFamily("shoal:router_kv_event_restarts",
                                           "Engine restarts seen (view cleared)",
                                           labels=["replica"])
            for url, state in list(self.kv_event_states.items()):
                batches.add_metric([url], state.batches)
                gaps.add_metric([url], state.gaps)
                restarts.add_metric([url], state.restarts)
            yield from (batches, gaps, restarts)
        yield GaugeMetricFamily("shoal:router_load_imbalance",
                                "max/mean in-flight over ready replicas",
                                value=imbalance([r.in_flight for r in replicas if r.ready]))


class RouterMetrics:
    def __init__(self, pool: ReplicaPool) -> None:
        self.registry = CollectorRegistry()
        self._pool_collector = _PoolCollector(pool)
        self.registry.register(self._pool_collector)
        self.roles = RolePoolCollector()
        self.roles.add(ROLE_BOTH, pool)
        self.registry.register(self.roles)
        self.decision_seconds = Histogram(
            "shoal:router_decision_seconds", "Request received to upstream request sent",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.first_byte_seconds = Histogram(
            "shoal:router_time_to_first_byte_seconds",
            "Request received to the first response byte from the replica",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.retries = Counter("shoal:router_retries", "Requests retried on another replica "
                               "before the first byte", registry=self.registry)
        self.affinity_spills = Counter(
            "shoal:router_affinity_spills", "Requests placed away from the replica believed "
            "to hold the most of their prefix, by reason (load_cap: it was over the load "
            "cap; engine_queue: its engine reported a waiting queue)", ["reason"],
            registry=self.registry)
        self.affinity_spilled_blocks = Counter(
            "shoal:router_affinity_spilled_blocks", "Prefix blocks believed cached on another "
            "replica that spilled requests gave up, by reason", ["reason"],
            registry=self.registry)
        self.no_replica = Counter("shoal:router_no_replica", "Requests refused with 503: no "
                                  "ready replica", registry=self.registry)
        self.client_disconnects = Counter("shoal:router_client_disconnects",
                                          "Requests cancelled upstream because the client left",
                                          registry=self.registry)
        self.unauthorized = Counter("shoal:router_unauthorized", "Requests refused with 401 "
                                    "at the router's edge", registry=self.registry)
        self.upstream_failures = Counter(
            "shoal:router_upstream_failures", "Requests a replica took and then failed (not "
            "replayed), by what failed", ["reason"], registry=self.registry)
        self.quarantined = Counter(
            "shoal:router_quarantined", "Repeats of a failed request refused because the "
            "replica it failed on is out of rotation", registry=self.registry)
        self.pd_decisions = pd_decisions_counter(self.registry)
        self.client_stalls = Counter("shoal:router_client_stalls", "Streams dropped because "
                                     "their client read nothing for the stall window",
                                     registry=self.registry)

    def watch_prefill_pool(self, prefill: ReplicaPool | None) -> None:
        """P/D: the main pool decodes; the prefill pool's replicas are exported too (a
        sidecar has none: the picker watches them)."""
        self.roles.pools = [(ROLE_DECODE, pool) for _, pool in self.roles.pools]
        if prefill is not None:
            self.roles.add(ROLE_PREFILL, prefill)

    def watch_kv_events(self, states: Mapping[str, EventStreamState]) -> None:
        """Export the KV-event subscriber's per-replica stream counters (precise mode)."""
        self._pool_collector.kv_event_states = states

    def render(self) -> bytes:
        return generate_latest(self.registry)
