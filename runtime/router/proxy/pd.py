"""P/D disaggregation in the router: the prefill leg, run before the decode replica's.

Two ways to say which prefill replica computes a prompt, one leg:

* ``shoal route --prefill-backend``: the proxy picks the decode replica as for any request
  (cache affinity, load); then the decision the Endpoint Picker makes too
  (``policies/pd_decider.py``) says whether a prefill replica (the least loaded of
  ``--prefill-backend``) computes the prompt first (``PrefillStage``);
* ``shoal route --pd-sidecar`` in front of one decode engine, as llm-d's routing sidecar: the
  Endpoint Picker has decided already and names the prefill replica in the request header
  ``x-prefiller-host-port``; no header, no prefill leg (``HeaderPrefill``). The header is
  honoured only for an address in ``--prefill-backend`` or, with ``--prefill-service``, a
  host among that Service's ready endpoints (a client-sent header must not make the sidecar
  post prompts anywhere: llm-d's sidecar keeps the same allowlist, the pods of its pool by
  IP, any port).

The leg is vLLM's proxy flow: the request with ``kv_transfer_params.do_remote_decode``,
``max_tokens`` 1, not streamed, then the decode replica gets the original request with the
``kv_transfer_params`` the prefill answered, so it pulls the prompt's KV instead of computing
it. A prefill leg that fails (no prefill replica ready, a connection error, a non-200, no
params in the answer) is counted and the request goes to the decode replica as it came: it
computes the prompt itself (llm-d's sidecar answers the prefill's error instead; computing
locally is slower but answers).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict
from shoal.runtime.router.policies.pd_decider import (
    REASON_NO_PREFILL,
    REASON_PREFILL_ERROR,
    least_loaded,
)
from shoal.runtime.router.replicas.capacity_request import CapacityAsker
from shoal.runtime.router.replicas.pool import ReplicaPool, normalize_url

from shoal.contract.headers import PREFILLER_HEADER

log = logging.getLogger("shoal.router.pd")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's proxy's prefill leg: the same request, one token, not streamed."""
    leg = {**body, "kv_transfer_params": PREFILL_PARAMS, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens"):  # min_tokens > 1 would contradict max 1
        leg.pop(name, None)
    return leg


@dataclass
class PrefillOutcome:
    body: bytes  # what the decode replica gets
    decision: str  # remote | local | failed | refused (a sidecar header naming no allowed
    # replica): the labels of shoal:router_pd_decisions
    reason: str  # why (pd_decider.REASON_* and the sidecar's below)


# the sidecar's reasons (``--pd-sidecar``: the picker decided, this hop carries it out)
REASON_PICKER_NAMED = "picker_named"  # remote: the picker's header named a prefill replica
REASON_NO_HEADER = "no_header"  # local: the picker named none (short or cached prompt)
REASON_NOT_ALLOWED = "not_allowed"  # refused: the header named no --prefill-backend
REASON_ALREADY_SPLIT = "already_split"  # local: the body carries kv_transfer_params already


def splittable(body: bytes) -> dict[str, Any] | None:
    """The request as JSON when a prefill leg may be cut from it: not one a proxy before us
    split already (it carries kv_transfer_params)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(request, dict) or "kv_transfer_params" in request:
        return None
    return request


async def prefill_leg(session: aiohttp.ClientSession, url: str, path: str,
                      request: dict[str, Any], body: bytes, headers: CIMultiDict,
                      timeout_s: float, reason: str,
                      ) -> tuple[PrefillOutcome, BaseException | None]:
    """Run the prefill on ``url``; the decode replica's body either way, and the transport
    error when there was one (the caller decides whether it ejects the replica). ``reason``:
    why the leg was taken, for a leg that succeeds."""
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}{path}",
                                    data=json.dumps(prefill_request(request)).encode(),
                                    headers=headers) as answer:
                payload = await answer.read()
                status = answer.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("prefill on %s failed (%r): the decode replica computes the prompt",
                    url, exc)
        return PrefillOutcome(body, "failed", REASON_PREFILL_ERROR), exc
    params = _params_of(payload) if status == 200 else None
    if params is None:
        log.warning("prefill on %s answered %d without kv_transfer_params: the decode "
                    "replica computes the prompt", url, status)
        return PrefillOutcome(body, "failed", REASON_PREFILL_ERROR), None
    return PrefillOutcome(json.dumps({**request, "kv_transfer_params": params}).encode(),
                          "remote", reason), None


class PrefillStage:
    """The proxy's own choice of prefill replica (``--prefill-backend``, least loaded)."""

    def __init__(self, pool: ReplicaPool, threshold: int,
                 asker: CapacityAsker | None = None) -> None:
        if threshold < 0:
            raise ValueError("--pd-threshold must be >= 0")
        self.pool = pool
        self.threshold = threshold
        # a prefill pool that scales to zero: no replica ready asks the operator for one
        # (the decode replica computes this prompt meanwhile; nothing waits)
        self.asker = asker

    async def run(self, session: aiohttp.ClientSession, path: str, body: bytes,
                  headers: CIMultiDict, timeout_s: float, reason: str) -> PrefillOutcome:
        """``reason``: why the decider wants the leg (the outcome's when it succeeds)."""
        request = splittable(body)
        if request is None:
            return PrefillOutcome(body, "local", REASON_ALREADY_SPLIT)
        candidates = self.pool.available()
        if not candidates:
            if self.asker is not None:
                self.asker.ask()
            else:
                log.warning("no prefill replica ready: the decode replica computes the prompt")
            return PrefillOutcome(body, "failed", REASON_NO_PREFILL)
        replica = self.pool.replicas[least_loaded([r.snapshot() for r in candidates]).url]
        replica.in_flight += 1
        try:
            outcome, error = await prefill_leg(session, replica.url, path, request, body,
                                               headers, timeout_s, reason)
        finally:
            replica.in_flight -= 1
        if isinstance(error, aiohttp.ClientConnectorError):
            self.pool.eject(replica.url, f"connect failed: {error!r}")
        if outcome.decision == "remote":
            replica.requests += 1
        return outcome


class HeaderPrefill:
    """The sidecar's prefill leg: the replica the Endpoint Picker named in
    ``x-prefiller-host-port``, if ``--prefill-backend`` allows it."""

    def __init__(self, allowed: list[str]) -> None:
        self.allowed = {normalize_url(url) for url in allowed}
        self.peer_hosts: set[str] = set()  # --prefill-service: its ready pods' addresses

    def allow_peers(self, urls: set[str]) -> None:
        """The prefill Service's ready endpoints now (its discovery publishes them)."""
        self.peer_hosts = {host for url in urls
                           if (host := urlsplit(normalize_url(url)).hostname)}

    def target(self, values: list[str]) -> str | None | PrefillOutcome:
        """The prefill replica's URL from the header's values; None: no header (decode
        computes the prompt, the picker decided so); a refused outcome for an address not
        allowed."""
        # llm-d's sidecar takes the first of several (comma-joined by a proxy or repeated)
        first = next((v.strip() for value in values for v in value.split(",") if v.strip()),
                     None)
        if first is None:
            return None
        url = normalize_url(first)
        if url not in self.allowed and urlsplit(url).hostname not in self.peer_hosts:
            log.warning("%s %r is neither a --prefill-backend nor a ready prefill pod: the "
                        "decode engine computes the prompt", PREFILLER_HEADER, first)
            return PrefillOutcome(b"", "refused", REASON_NOT_ALLOWED)
        return url

    async def run(self, session: aiohttp.ClientSession, path: str, body: bytes,
                  headers: CIMultiDict, named: list[str],
                  timeout_s: float) -> PrefillOutcome:
        """``named``: the header's values. The decode engine's body and the decision (local,
        no_header: the picker asked for no prefill leg)."""
        target = self.target(named)
        if target is None:
            return PrefillOutcome(body, "local", REASON_NO_HEADER)
        if isinstance(target, PrefillOutcome):
            return PrefillOutcome(body, target.decision, target.reason)
        request = splittable(body)
        if request is None:
            return PrefillOutcome(body, "local", REASON_ALREADY_SPLIT)
        outcome, _ = await prefill_leg(session, target, path, request, body, headers,
                                       timeout_s, REASON_PICKER_NAMED)
        return outcome


def _params_of(payload: bytes) -> dict | None:
    try:
        params = json.loads(payload).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
