"""The Endpoint Picker's decision: the proxy's routing policy, asked for an ``ip:port`` list.

The same ``RoutingPolicy`` object the proxy uses (cache affinity within the load bound, by
default) chooses the primary endpoint among the ready replicas, restricted to the gateway's
subset hint when it sends one; fallbacks are the policy's next choices with the earlier ones
excluded, which is the order the proxy would retry in. The EPP never sees the request's
bytes go by, but the ext_proc stream lives as long as the request, so a pick counts as in
flight on its replica until the stream ends: that is the bounded-load input here, as the
proxied request is for the proxy.

P/D (``--prefill-backend``), as llm-d's P/D profile handler: the decode endpoint is picked
first, exactly as above; then the proxy's own decision (``policies/pd_decider.py``: uncached
prompt tokens on that endpoint over ``--pd-threshold``) says whether a prefill endpoint, the
least loaded of the prefill pool, computes the prompt. It rides in the ``Pick`` and goes to
the data plane in llm-d's ``x-prefiller-host-port`` header; the decode endpoint's sidecar
(``shoal route --pd-sidecar``) runs the prefill leg there. The prefill endpoint counts the
request in flight until the response starts (the sidecar has finished the prefill leg by then).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from shoal.runtime.router.epp.protocol import Refusal
from shoal.runtime.router.pd_metrics import (
    ROLE_BOTH,
    ROLE_DECODE,
    ROLE_PREFILL,
    RolePoolCollector,
    pd_decisions_counter,
)
from shoal.runtime.router.policies.base import Decision, ReplicaSnapshot, RoutingPolicy
from shoal.runtime.router.policies.lora_affinity import adapter_for_keys, model_of, prefer_adapter
from shoal.runtime.router.policies.pd_decider import REASON_NO_PREFILL, least_loaded, pd_choice
from shoal.runtime.router.policies.request_keys import (
    KeyConfig,
    MalformedBody,
    PromptTokenizer,
    RequestKeys,
    keys_of_body,
)
from shoal.runtime.router.replicas.capacity_request import CapacityAsker
from shoal.runtime.router.replicas.pool import ReplicaPool
from shoal.runtime.router.replicas.response_home import HomeGone, response_home

KEYED_PATHS = ("/v1/completions", "/v1/chat/completions")
SHED_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Pick:
    url: str  # the primary replica, as the pool names it (http://ip:port)
    endpoints: tuple[str, ...]  # primary first, then fallbacks, as ip:port
    matched_blocks: int = 0
    prefill_url: str | None = None  # P/D: the prefill replica, as its pool names it
    prefill: str | None = None  # its ip:port for the header


def endpoint_of(url: str) -> str:
    """``http://10.0.0.5:8000`` -> ``10.0.0.5:8000`` (the protocol's form)."""
    return url.split("://", 1)[-1].rstrip("/")


def saturated(replicas: Sequence[ReplicaSnapshot], limit: int | None) -> bool:
    """Shed when every candidate already has ``limit`` requests open or queued on it."""
    return limit is not None and all(r.in_flight + r.num_waiting >= limit for r in replicas)


def choose_endpoints(policy: RoutingPolicy, keys: RequestKeys | None,
                     replicas: Sequence[ReplicaSnapshot], count: int,
                     now: float) -> list[Decision]:
    """The policy's first choice, then its choice among the rest, ``count`` deep."""
    left = list(replicas)
    decisions: list[Decision] = []
    while left and len(decisions) < count:
        decision = policy.choose(keys, left, now)
        decisions.append(decision)
        left = [r for r in left if r.url != decision.url]
    return decisions


class EndpointPicker:
    def __init__(self, pool: ReplicaPool, policy: RoutingPolicy, key_config: KeyConfig,
                 tokenizer: PromptTokenizer | None = None, endpoints_per_pick: int = 3,
                 shed_limit: int | None = None, prefill_pool: ReplicaPool | None = None,
                 pd_threshold: int = 256) -> None:
        if endpoints_per_pick < 1:
            raise ValueError("endpoints per pick must be >= 1")
        self.pool = pool
        self.policy = policy
        self.key_config = key_config
        self.tokenizer = tokenizer
        self.endpoints_per_pick = endpoints_per_pick
        self.shed_limit = shed_limit
        self.prefill_pool = prefill_pool  # P/D: None, every prompt is computed where it decodes
        self.pd_threshold = pd_threshold
        # a prefill pool that scales to zero: a prompt that wanted a prefill replica and found
        # none ready asks the operator for one (replicas/capacity_request.py)
        self.prefill_asker: CapacityAsker | None = None
        # what the picker's /metrics (--epp-metrics-port) serves
        self.registry = CollectorRegistry()
        self.pd_decisions = pd_decisions_counter(self.registry)
        roles = RolePoolCollector()
        roles.add(ROLE_BOTH if prefill_pool is None else ROLE_DECODE, pool)
        if prefill_pool is not None:
            roles.add(ROLE_PREFILL, prefill_pool)
        self.registry.register(roles)
        pool.on_change.append(policy.sync)
        policy.sync(set(pool.replicas))

    async def keys(self, path: str, body: bytes) -> RequestKeys | Refusal | None:
        """The prompt's keys; None: pick by load (the model server judges the body); a
        400 refusal for a body no model server accepts (not JSON, too deep, ids out of
        range), answered at once instead of spending an engine on it."""
        path = path.split("?", 1)[0]
        if not self.policy.uses_prefix or path not in KEYED_PATHS or not body:
            return None
        # salted by the adapter, as the model servers hash its blocks (lora_affinity.py)
        adapter = adapter_for_keys(model_of(body), (r.lora for r in self.pool.replicas.values()))
        if self.tokenizer is not None:  # tokenizing is CPU work: off the event loop
            keys = await asyncio.to_thread(keys_of_body, path, body, self.key_config,
                                           self.tokenizer, None, adapter)
        else:
            keys = keys_of_body(path, body, self.key_config, None, None, adapter)
        return Refusal(400, str(keys)) if isinstance(keys, MalformedBody) else keys

    async def pick(self, path: str, body: bytes,
                   subset: frozenset[str] | None) -> Pick | Refusal:
        keys = await self.keys(path, body)
        if isinstance(keys, Refusal):
            return keys
        home = response_home(path.split("?", 1)[0], body, self.pool.replicas)
        if isinstance(home, HomeGone):
            return Refusal(home.status, home.message, home.retry_after_s)
        candidates = self.pool.available()
        if home is not None:  # a Responses follow-up: only where its conversation is stored
            candidates = [r for r in candidates if r.url == home]
        if subset is not None:
            candidates = [r for r in candidates if endpoint_of(r.url) in subset]
            if not candidates:
                return Refusal(503, "no ready endpoint in the gateway's subset hint")
        if not candidates:
            return Refusal(503, "no ready endpoint in the pool")
        snapshots = [r.snapshot() for r in candidates]
        if saturated(snapshots, self.shed_limit):
            return Refusal(429, "every endpoint is saturated; retry later",
                           retry_after_s=SHED_RETRY_AFTER_S)
        if any(s.lora is not None for s in snapshots):  # some endpoint serves adapters
            snapshots = prefer_adapter(model_of(body), snapshots)
        now = time.monotonic()
        decisions = choose_endpoints(self.policy, keys, snapshots, self.endpoints_per_pick, now)
        primary = decisions[0]
        self.policy.routed(primary.url, keys, now)
        replica = self.pool.replicas[primary.url]
        replica.in_flight += 1
        replica.requests += 1
        if primary.matched_blocks:
            replica.affinity_hits += 1
        prefill = self._prefill_for(path, keys, primary)
        return Pick(primary.url, tuple(endpoint_of(d.url) for d in decisions),
                    primary.matched_blocks, prefill,
                    endpoint_of(prefill) if prefill is not None else None)

    def _prefill_for(self, path: str, keys: RequestKeys | None,
                     decode: Decision) -> str | None:
        """P/D: the prefill replica for this prompt, or None (decode computes it)."""
        if self.prefill_pool is None or path.split("?", 1)[0] not in KEYED_PATHS:
            return None
        choice = pd_choice(keys, decode, self.key_config, self.pd_threshold)
        if not choice.remote:
            self.pd_decisions.labels("local", choice.reason).inc()
            return None
        candidates = self.prefill_pool.available()
        if not candidates:  # the decode endpoint computes the prompt, as the proxy's fallback
            self.pd_decisions.labels("failed", REASON_NO_PREFILL).inc()
            if self.prefill_asker is not None:
                self.prefill_asker.ask()
            return None
        self.pd_decisions.labels("remote", choice.reason).inc()
        replica = self.prefill_pool.replicas[
            least_loaded([r.snapshot() for r in candidates]).url]
        replica.in_flight += 1
        replica.requests += 1
        return replica.url

    def release_prefill(self, url: str) -> None:
        replica = self.prefill_pool.replicas.get(url) if self.prefill_pool else None
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1

    def served_elsewhere(self, pick: Pick, served: str) -> str:
        """The data plane reports a fallback served it: the in-flight count moves there."""
        for url, replica in self.pool.replicas.items():
            if endpoint_of(url) == served and url != pick.url:
                self.release(pick.url)
                replica.in_flight += 1
                return url
        return pick.url

    def release(self, url: str) -> None:
        replica = self.pool.replicas.get(url)
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1
