"""P/D disaggregation in the router: decode replica first, a prefill replica when worth it.

The policy picks the decode replica as for any request (cache affinity, load); then, as
llm-d's P/D decider does, the prompt tokens that replica is not believed to hold decide: above
``--pd-threshold`` a prefill replica (the least loaded of ``--prefill-backend``) computes the
prompt first, with vLLM's proxy flow (the request with ``kv_transfer_params.do_remote_decode``,
``max_tokens`` 1, not streamed), and the decode replica gets the original request with the
``kv_transfer_params`` the prefill answered, so it pulls the prompt's KV instead of computing
it. Short or cached prompts go straight to the decode replica. A prefill leg that fails (no
prefill replica ready, a connection error, a non-200, no params in the answer) is counted
and the request goes to the decode replica as it came: it computes the prompt itself.

Uncached tokens: with token-precise keys (a tokenizer), the prompt's tokens less the matched
blocks'; with approximate keys, characters over ``CHARS_PER_TOKEN``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDict
from shoal.runtime.router.policies.base import Decision
from shoal.runtime.router.policies.request_keys import KeyConfig, RequestKeys
from shoal.runtime.router.replicas.pool import Replica, ReplicaPool

log = logging.getLogger("shoal.router.pd")
CHARS_PER_TOKEN = 4  # approximate keys count characters; English text runs ~4 per token
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def uncached_tokens(keys: RequestKeys, matched_blocks: int, config: KeyConfig) -> int:
    """Prompt tokens the chosen replica is not believed to hold."""
    if keys.precise:
        return max(0, keys.num_units - matched_blocks * config.block_size)
    return max(0, keys.num_units - matched_blocks * config.chars_per_block) // CHARS_PER_TOKEN


def wants_remote_prefill(keys: RequestKeys | None, decision: Decision, config: KeyConfig,
                         threshold: int) -> bool:
    """No keys (a body the router cannot read): no P/D, the decode replica answers it."""
    return keys is not None and uncached_tokens(keys, decision.matched_blocks,
                                                config) > threshold


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's proxy's prefill leg: the same request, one token, not streamed."""
    leg = {**body, "kv_transfer_params": PREFILL_PARAMS, "max_tokens": 1, "stream": False}
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens"):  # min_tokens > 1 would contradict max 1
        leg.pop(name, None)
    return leg


def least_loaded(replicas: list[Replica]) -> Replica:
    return min(replicas, key=lambda r: (r.in_flight + r.metrics.waiting, r.url))


@dataclass
class PrefillOutcome:
    body: bytes  # what the decode replica gets
    decision: str  # remote | failed


class PrefillStage:
    def __init__(self, pool: ReplicaPool, threshold: int) -> None:
        if threshold < 0:
            raise ValueError("--pd-threshold must be >= 0")
        self.pool = pool
        self.threshold = threshold

    async def run(self, session: aiohttp.ClientSession, path: str, body: bytes,
                  headers: CIMultiDict, timeout_s: float) -> PrefillOutcome:
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):
            return PrefillOutcome(body, "failed")
        if not isinstance(request, dict) or "kv_transfer_params" in request:
            return PrefillOutcome(body, "failed")  # not ours to split (a proxy before us)
        candidates = self.pool.available()
        if not candidates:
            log.warning("no prefill replica ready: the decode replica computes the prompt")
            return PrefillOutcome(body, "failed")
        replica = least_loaded(candidates)
        replica.in_flight += 1
        try:
            async with asyncio.timeout(timeout_s):
                async with session.post(f"{replica.url}{path}",
                                        data=json.dumps(prefill_request(request)).encode(),
                                        headers=headers) as answer:
                    payload = await answer.read()
                    status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                self.pool.eject(replica.url, f"connect failed: {exc!r}")
            log.warning("prefill on %s failed (%r): the decode replica computes the prompt",
                        replica.url, exc)
            return PrefillOutcome(body, "failed")
        finally:
            replica.in_flight -= 1
        params = _params_of(payload) if status == 200 else None
        if params is None:
            log.warning("prefill on %s answered %d without kv_transfer_params: the decode "
                        "replica computes the prompt", replica.url, status)
            return PrefillOutcome(body, "failed")
        replica.requests += 1
        return PrefillOutcome(json.dumps({**request, "kv_transfer_params": params}).encode(),
                              "remote")


def _params_of(payload: bytes) -> dict | None:
    try:
        params = json.loads(payload).get("kv_transfer_params")
    except (ValueError, AttributeError, RecursionError):
        return None
    return params if isinstance(params, dict) and params.get("do_remote_prefill") else None
