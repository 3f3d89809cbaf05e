"""The replicas the router knows, their health and load, kept fresh in the background.

Health: each replica's ``/ready`` is polled every ``health_interval``; a non-200 or an error
ejects it, the next 200 brings it back. The proxy also ejects a replica at once when a
connection to it fails (passive ejection), so a killed pod stops getting traffic before the
next poll. Load: ``/metrics`` is scraped every ``scrape_interval`` (running, waiting, KV
usage, prefix-cache counters); the router's own in-flight count is exact and immediate.
With ``metrics_port`` the scrape goes to that port of each replica (the engines'
``--metrics-port``, which needs no API key), since an engine with keys guards ``/metrics`` on
its serving port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from shoal.runtime.router.policies.base import ReplicaSnapshot

from shoal.contract.metrics import EngineMetrics, LoraInfo, parse_engine_metrics, parse_lora_info
from shoal.contract.response_ids import READY_INSTANCE_FIELD

log = logging.getLogger("shoal.router.replicas")


@dataclass
class Replica:
    url: str
    ready: bool = False
    in_flight: int = 0
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    metrics_time: float = 0.0  # monotonic time of the last successful scrape
    requests: int = 0  # routed here (for the router's metrics)
    affinity_hits: int = 0  # routed here because a prefix match was found
    ejections: int = 0
    instance: str | None = None  # the API process's tag in its response ids (its /ready)
    lora: LoraInfo | None = None  # scraped lora_requests_info; None: LoRA off

    def snapshot(self) -> ReplicaSnapshot:
        return ReplicaSnapshot(self.url, self.in_flight, int(self.metrics.waiting),
                               int(self.metrics.running), self.metrics.kv_cache_usage,
                               self.lora)


def ready_instance(body: bytes) -> str | None:
    """The ``instance`` a /ready body names (an engine's; other servers may send none)."""
    try:
        value = json.loads(body).get(READY_INSTANCE_FIELD) if body.startswith(b"{") else None
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def metrics_url(url: str, port: int | None) -> str:
    """The replica's /metrics: on its serving port, or on ``port`` of the same host."""
    if port is None:
        return f"{url}/metrics"
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, f"{parts.hostname}:{port}", "/metrics", "", ""))


class ReplicaPool:
    def __init__(self, health_interval: float = 1.0, scrape_interval: float = 1.0,
                 probe_timeout: float = 2.0,
                 scrape_headers: dict[str, str] | None = None,
                 metrics_port: int | None = None) -> None:
        if health_interval <= 0 or scrape_interval <= 0:
            raise ValueError("health and scrape intervals must be > 0")
        self._session: aiohttp.ClientSession | None = None  # made in start(), in the loop
        self.health_interval = health_interval
        self.scrape_interval = scrape_interval
        self.probe_timeout = probe_timeout
        self.scrape_headers = scrape_headers or {}  # the router's credential for /metrics
        self.metrics_port = metrics_port
        self.replicas: dict[str, Replica] = {}
        self.on_change: list[Callable[[set[str]], None]] = []
        self.on_ready: list[Callable[[str], None]] = []  # a replica just passed /ready
        self._task: asyncio.Task[None] | None = None
        self._first_check: asyncio.Event = asyncio.Event()

    def sync(self, urls: Iterable[str]) -> None:
        """Discovery says these are the replicas now; new ones start unready until probed."""
        wanted = {normalize_url(u) for u in urls}
        changed = False
        for gone in set(self.replicas) - wanted:
            del self.replicas[gone]
            changed = True
        for url in wanted - set(self.replicas):
            self.replicas[url] = Replica(url)
            changed = True
        if changed:
            for callback in self.on_change:
                callback(set(self.replicas))

    def available(self, exclude: set[str] = frozenset()) -> list[Replica]:  # type: ignore[assignment]
        return [r for url, r in sorted(self.replicas.items()) if r.ready and url not in exclude]

    def eject(self, url: str, reason: str) -> None:
        replica = self.replicas.get(url)
        if replica is not None and replica.ready:
            replica.ready = False
            replica.ejections += 1
            log.warning("ejected %s: %s", url, reason)

    async def check_all(self, scrape: bool) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.probe_timeout))
        await asyncio.gather(*(self._check(self._session, r, scrape)
                               for r in list(self.replicas.values())))

    async def _check(self, session: aiohttp.ClientSession, replica: Replica,
                     scrape: bool) -> None:
        try:
            async with session.get(f"{replica.url}/ready") as response:
                replica.instance = ready_instance(await response.read()) or replica.instance
                ready = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ready = False
        was_ready = replica.ready
        if ready and not replica.ready:
            log.info("replica %s is ready", replica.url)
        elif not ready and replica.ready:
            replica.ejections += 1
            log.warning("ejected %s: /ready failed", replica.url)
        replica.ready = ready
        if ready and not was_ready:
            for callback in self.on_ready:
                callback(replica.url)
        if ready and scrape:
            try:
                async with session.get(metrics_url(replica.url, self.metrics_port),
                                       headers=self.scrape_headers) as response:
                    text = await response.text()
                    if response.status == 200:
                        replica.metrics = parse_engine_metrics(text)
                        replica.lora = parse_lora_info(text)
                        replica.metrics_time = time.monotonic()
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                pass  # keep the last numbers; health is decided by /ready

    async def run(self) -> None:
        tick = min(self.health_interval, self.scrape_interval)
        next_health = next_scrape = 0.0
        while True:
            now = time.monotonic()
            if now >= next_health or now >= next_scrape:
                scrape = now >= next_scrape
                await self.check_all(scrape)
                self._first_check.set()
                if now >= next_health:
                    next_health = now + self.health_interval
                if scrape:
                    next_scrape = now + self.scrape_interval
            await asyncio.sleep(tick / 4)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="replica health")

    async def wait_first_check(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._first_check.wait(), timeout)
        except TimeoutError:
            pass

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
