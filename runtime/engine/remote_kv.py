"""The engine core's side of P/D disaggregation: offering a finished prefill's blocks, and
pulling a decode request's prompt blocks before it is scheduled.

Prefill (``do_remote_decode``): the scheduler keeps a request's full prompt blocks held when
it finishes at ``max_tokens`` (``Scheduler.take_parked``); ``park`` offers them through the
connector and answers the ``kv_transfer_params`` the decode engine needs. They go back to the
pool (still hashed, so still a prefix cache) when pulled or after ``abort_request_timeout``.

Decode (``do_remote_prefill``): ``begin`` hashes the prompt's full blocks (all but the last
token's, which the decode computes to sample its first token, as vLLM does), leaves out the
leading ones its own prefix cache holds (not sent again), holds the cached ones and fresh
blocks for the rest, and starts a pull. ``poll`` finishes pulls: a pulled block is published
in the prefix cache under its hash and the request enters the scheduler holding them, so its
admission finds them as its cached prefix and computes only the rest; a failed pull (the
prefill engine died, refused, or the transfer passed its timeout) releases them and the
request enters as an ordinary one: the decode engine computes the prompt itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from shoal.runtime.kv.block_hash import ExtraKeys, hash_prefix_blocks
from shoal.runtime.kv.kv_manager import KVCacheManager
from shoal.runtime.kv_transfer.connector import KVConnector, PullJob
from shoal.runtime.kv_transfer.params import KVTransferConfig, KVTransferParams
from shoal.runtime.log_limits import RateLimitedLog
from shoal.runtime.scheduler.request import Request
from shoal.runtime.wire.messages import EngineCoreRequest

logger = logging.getLogger("shoal.engine.remote_kv")


@dataclass
class _Pending:
    request: EngineCoreRequest
    hashes: list[int]  # the prompt's full blocks that may come from the prefill engine
    first: int  # blocks before it were in the local prefix cache
    aborted: bool = False


@dataclass
class Ready:
    """A decode request whose pull ended: what it enters the scheduler with."""

    request: EngineCoreRequest
    held: bool  # it holds pulled blocks until admitted
    external_tokens: tuple[int, int]  # the prompt's pulled span (start, end); (0, 0): none


class RemoteKV:
    def __init__(self, config: KVTransferConfig, connector: KVConnector, kv: KVCacheManager,
                 model_revision: str) -> None:
        self.config = config
        self.connector = connector
        self.kv = kv
        self.model_revision = model_revision
        self.pending: dict[str, _Pending] = {}
        self.blocks_skipped = 0
        # the counters /metrics last saw: a send is counted after its blocks went back
        self._counters_seen = replace(connector.counters)
        self._log = RateLimitedLog(logger)

    # -- decode side ----------------------------------------------------------------------
    def begin(self, request: EngineCoreRequest) -> bool:
        """Start pulling its prompt's blocks; False when there is nothing to pull (or no
        room to pull into): the caller schedules it now."""
        params = request.kv_transfer
        if params is None or not params.pullable or not self.config.consumes:
            return False
        kv, size = self.kv, self.kv.block_size
        num_blocks = (len(request.prompt_token_ids) - 1) // size
        extra = ExtraKeys(self.model_revision, request.adapter_id, request.cache_salt).digest()
        hashes = hash_prefix_blocks(request.prompt_token_ids, size, extra, max_blocks=num_blocks)
        hits = []
        for block_hash in hashes:
            block = kv.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        first = len(hits)
        self.blocks_skipped += first
        if first >= num_blocks:
            return False  # all here already
        fresh = kv.hold_new(request.request_id, hits, num_blocks - first)
        if fresh is None:
            self._log.log(logging.WARNING, "no room", "no KV blocks free to pull %d blocks of "
                          "%s into; computing the prompt here", num_blocks - first,
                          request.request_id)
            return False
        assert params.remote_host is not None and params.remote_port is not None
        assert params.remote_request_id is not None
        self.connector.pull(PullJob(
            request.request_id, params.remote_request_id, params.remote_host,
            params.remote_port, first, hashes[first:], [b.block_id for b in fresh],
            time.monotonic() + self.config.transfer_timeout))
        self.pending[request.request_id] = _Pending(request, hashes, first)
        return True

    def abort(self, request_ids: list[str]) -> None:
        """Its pull runs on (it writes into held blocks): released when it ends."""
        for request_id in request_ids:
            pending = self.pending.get(request_id)
            if pending is not None:
                pending.aborted = True

    def is_pending(self, request_id: str) -> bool:
        return request_id in self.pending

    def poll(self) -> tuple[list[Ready], bool]:
        """Pulls that ended (their requests, to schedule now) and whether any block went
        back to the pool or a transfer counter moved (stats to publish)."""
        results, released = self.connector.poll()
        counters = replace(self.connector.counters)
        changed = counters != self._counters_seen
        self._counters_seen = counters
        for request_id in released:  # offers pulled or expired
            changed |= self.kv.release_hold(request_id)
        ready = []
        for result in results:
            pending = self.pending.pop(result.request_id, None)
            if pending is None:
                continue
            changed = True
            request, first, size = pending.request, pending.first, self.kv.block_size
            if pending.aborted or not result.ok:
                self.kv.release_hold(request.request_id)
                if not pending.aborted:
                    self._log.log(logging.WARNING, result.error[:80], "KV pull for %s failed "
                                  "(%s); computing its prompt here", request.request_id,
                                  result.error)
                    ready.append(Ready(request, False, (0, 0)))
                continue
            end = len(pending.hashes)
            self.kv.publish_held(request.request_id, first, pending.hashes[first:],
                                 pending.hashes[first - 1] if first else None,
                                 request.prompt_token_ids[first * size:end * size],
                                 request.adapter_id)
            ready.append(Ready(request, True, (first * size, end * size)))
        return ready, changed

    # -- prefill side ---------------------------------------------------------------------
    def park(self, parked: list[tuple[Request, list[int]]]) -> dict[str, KVTransferParams]:
        """Offer finished prefills' held blocks; the params each response carries."""
        answers = {}
        for req, block_ids in parked:
            if not self.config.produces:
                self.kv.release_hold(req.req_id)
                continue
            hashes = self.kv.prefix_hashes(req, len(block_ids))
            self.connector.offer(req.req_id, block_ids, hashes, self.config.abort_request_timeout)
            answers[req.req_id] = KVTransferParams(
                do_remote_prefill=True, remote_engine_id=self.connector.engine_id,
                remote_request_id=req.req_id, remote_host=self.connector.host,
                remote_port=self.connector.port, remote_block_ids=block_ids)
        return answers

    def shutdown(self) -> None:
        self.connector.shutdown()
