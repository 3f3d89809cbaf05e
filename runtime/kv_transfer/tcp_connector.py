"""The TCP KV connector: a producer serves its offered blocks on ``kv_ip:kv_port``; a
consumer pulls them on a small thread pool.

One pull is one connection: the consumer sends ``{request_id, first, hashes}``; the producer
answers a header ``{error, layout, num_blocks}`` and then, layer by layer, the K and V bytes of
the blocks (``KVBlockIO.read_layer``), so the consumer writes layer ``i`` while layer ``i+1``
is on the wire. The producer releases an offer once its bytes are copied out (the pull has
them whatever happens next) and answers a second pull of it with an error; the consumer
checks the layout against its own and every read against its deadline (socket timeouts), so
a dead or stalled producer fails the pull within ``transfer_timeout`` and the decode engine
computes the prompt itself.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec

from .connector import (
    KVBlockIO,
    KVConnector,
    KVLayout,
    PullJob,
    PullResult,
    TransferCounters,
)

logger = logging.getLogger("shoal.kv_transfer")
_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 20  # a request's or header's msgpack; larger is a protocol error
PULL_THREADS = 4


class _Pull(msgspec.Struct, array_like=True):
    request_id: str
    first: int
    hashes: list[int]


class _Header(msgspec.Struct, array_like=True):
    error: str
    layout: list
    num_blocks: int


@dataclass
class _Offer:
    block_ids: list[int]
    hashes: list[int]
    expires: float
    sending: bool = False


class TransferError(Exception):
    pass


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, size: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if deadline is not None and time.monotonic() > deadline:
            raise TransferError("the transfer ran past its timeout")
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise TransferError("the peer closed the connection mid-transfer")
        got += n
    return buf


def _recv_frame(sock: socket.socket, deadline: float | None = None) -> bytearray:
    (size,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline))
    if size > MAX_HEADER_BYTES:
        raise TransferError(f"a {size}-byte control frame is over the limit")
    return _recv_exact(sock, size, deadline)


class TcpConnector(KVConnector):
    def __init__(self, engine_id: str, host: str, port: int, transfer_timeout_s: float) -> None:
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.transfer_timeout_s = transfer_timeout_s
        self.counters = TransferCounters()
        self._io: KVBlockIO | None = None
        self._layout: KVLayout | None = None
        self._lock = threading.Lock()
        self._offers: dict[str, _Offer] = {}
        self._released: list[str] = []
        self._results: list[PullResult] = []
        self._event = threading.Event()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, block_io: KVBlockIO) -> None:
        self._io = block_io
        self._layout = block_io.layout()
        connector = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                connector._serve_one(self.request)

        server = socketserver.ThreadingTCPServer((self.host, self.port), Handler,
                                                 bind_and_activate=False)
        server.daemon_threads = True
        server.allow_reuse_address = True
        server.server_bind()
        server.server_activate()
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, name="kv-transfer-server",
                         daemon=True).start()
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-pull")

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- producer -------------------------------------------------------------------------
    def offer(self, request_id: str, block_ids: list[int], block_hashes: list[int],
              timeout_s: float) -> None:
        with self._lock:
            self._offers[request_id] = _Offer(list(block_ids), list(block_hashes),
                                              time.monotonic() + timeout_s)

    def _serve_one(self, sock: socket.socket) -> None:
        sock.settimeout(self.transfer_timeout_s)
        try:
            pull = msgspec.msgpack.decode(_recv_frame(sock), type=_Pull)
        except (TransferError, OSError, msgspec.DecodeError) as exc:
            logger.warning("kv transfer: a bad pull request (%s)", exc)
            return
        offer, error = self._claim(pull)
        layout = self._layout
        assert layout is not None and self._io is not None
        if offer is None:
            self._answer(sock, _Header(error, layout.as_list(), 0))
            return
        ids = offer.block_ids[pull.first:pull.first + len(pull.hashes)]
        sent = 0
        try:
            layers = [self._io.read_layer(layer, ids) for layer in range(layout.num_layers)]
        finally:
            self._release(pull.request_id)  # copied out: the blocks may go back to the pool
        try:
            _send_frame(sock, msgspec.msgpack.encode(_Header("", layout.as_list(), len(ids))))
            for data in layers:
                sock.sendall(data)
                sent += len(data)
        except OSError as exc:
            logger.warning("kv transfer of %s failed while sending: %s", pull.request_id, exc)
        with self._lock:
            self.counters.bytes_sent += sent
            self.counters.offers_sent += 1

    def _claim(self, pull: _Pull) -> tuple[_Offer | None, str]:
        with self._lock:
            offer = self._offers.get(pull.request_id)
            if offer is None or offer.sending:
                return None, f"no blocks wait for request {pull.request_id!r} here"
            end = pull.first + len(pull.hashes)
            if pull.first < 0 or end > len(offer.hashes) or not pull.hashes:
                return None, (f"request {pull.request_id!r} offers blocks 0..{len(offer.hashes)}"
                              f", not {pull.first}..{end}")
            if offer.hashes[pull.first:end] != pull.hashes:
                return None, (f"the block hashes of request {pull.request_id!r} differ (another "
                              "prompt, model revision, adapter or cache salt)")
            offer.sending = True
            return offer, ""

    def _release(self, request_id: str) -> None:
        with self._lock:
            if self._offers.pop(request_id, None) is not None:
                self._released.append(request_id)
        self._event.set()

    @staticmethod
    def _answer(sock: socket.socket, header: _Header) -> None:
        try:
            _send_frame(sock, msgspec.msgpack.encode(header))
        except OSError:
            pass

    # -- consumer -------------------------------------------------------------------------
    def pull(self, job: PullJob) -> None:
        assert self._pool is not None, "start() first"
        self._pool.submit(self._run_pull, job)

    def _run_pull(self, job: PullJob) -> None:
        started = time.monotonic()
        try:
            received = self._fetch(job)
            result = PullResult(job.request_id, True, num_bytes=received,
                                seconds=time.monotonic() - started)
        except Exception as exc:  # any failure: the decode engine computes the prompt
            result = PullResult(job.request_id, False, f"{type(exc).__name__}: {exc}",
                                seconds=time.monotonic() - started)
        with self._lock:
            self._results.append(result)
        self._event.set()

    def _fetch(self, job: PullJob) -> int:
        assert self._io is not None and self._layout is not None
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise TransferError("the transfer ran past its timeout before it started")
        with socket.create_connection((job.host, job.port), timeout=left) as sock:
            sock.settimeout(max(0.05, min(left, self.transfer_timeout_s)))
            _send_frame(sock, msgspec.msgpack.encode(
                _Pull(job.remote_request_id, job.first, job.block_hashes)))
            header = msgspec.msgpack.decode(_recv_frame(sock, job.deadline), type=_Header)
            if header.error:
                raise TransferError(f"the prefill engine refused: {header.error}")
            if KVLayout.from_list(header.layout) != self._layout:
                raise TransferError(f"KV layouts differ: remote {header.layout}, local "
                                    f"{self._layout.as_list()}")
            if header.num_blocks != len(job.block_ids):
                raise TransferError(f"{header.num_blocks} blocks offered, "
                                    f"{len(job.block_ids)} asked")
            layer_bytes = self._layout.block_bytes * len(job.block_ids)
            for layer in range(self._layout.num_layers):
                data = _recv_exact(sock, layer_bytes, job.deadline)
                self._io.write_layer(layer, job.block_ids, data)
        return layer_bytes * self._layout.num_layers

    # -- both -----------------------------------------------------------------------------
    def poll(self) -> tuple[list[PullResult], list[str]]:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, o in self._offers.items()
                       if not o.sending and o.expires <= now]
            for rid in expired:
                del self._offers[rid]
            self.counters.offers_expired += len(expired)
            results, self._results = self._results, []
            released, self._released = self._released + expired, []
            self._event.clear()
        for r in results:
            self.counters.pulls += 1
            if r.ok:
                self.counters.bytes_received += r.num_bytes
                self.counters.pull_seconds += r.seconds
            else:
                self.counters.pulls_failed += 1
        return results, released

    def wait(self, timeout_s: float) -> None:
        self._event.wait(timeout_s)

    def num_offers(self) -> int:
        with self._lock:
            return len(self._offers)
