"""P/D's metrics, the same in the proxy's ``/metrics`` and the Endpoint Picker's: the
per-request decision (a prefill leg taken or skipped, and why) and each replica's queue and
KV usage as its last scrape saw them, labelled with its role.

Roles are llm-d's (``llm-d.ai/role``): ``prefill`` for the prefill pool, ``decode`` for the
pool requests are decoded on when there is a prefill pool, ``both`` when there is none. The
engines export their own role too (``shoal:kv_transfer_config_info``); here the router's view
of both pools is in one place, so a dashboard compares prefill and decode queues without a
join.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from shoal.runtime.router.replicas.pool import ReplicaPool

ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH = "prefill", "decode", "both"


def pd_decisions_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "shoal:router_pd_decisions", "P/D: requests by whether a prefill replica computed "
        "their prompt (remote), the decode replica did (local), or did after the prefill leg "
        "failed or found no prefill replica (failed), or a sidecar refused the picker's header "
        "(refused); reason: uncached_prompt, short_prompt, cached_prefix, unkeyed_body, "
        "no_prefill_replica, prefill_error, already_split, and for --pd-sidecar "
        "picker_named, no_header, not_allowed", ["decision", "reason"], registry=registry)


class RolePoolCollector(Collector):
    """Scraped queue and KV usage of every replica of the given pools, by role."""

    def __init__(self) -> None:
        self.pools: list[tuple[str, ReplicaPool]] = []

    def add(self, role: str, pool: ReplicaPool) -> None:
        self.pools.append((role, pool))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["replica", "role"]
        waiting = GaugeMetricFamily("shoal:router_replica_num_requests_waiting",
                                    "Requests waiting on the replica (its last scrape)",
                                    labels=labels)
        running = GaugeMetricFamily("shoal:router_replica_num_requests_running",
                                    "Requests running on the replica (its last scrape)",
                                    labels=labels)
        kv = GaugeMetricFamily("shoal:router_replica_kv_cache_usage_perc",
                               "The replica's KV-cache usage, 1 = full (its last scrape)",
                               labels=labels)
        for role, pool in self.pools:
            for replica in list(pool.replicas.values()):
                snapshot = replica.snapshot()
                waiting.add_metric([replica.url, role], snapshot.num_waiting)
                running.add_metric([replica.url, role], snapshot.num_running)
                kv.add_metric([replica.url, role], snapshot.kv_usage)
        yield from (waiting, running, kv)
