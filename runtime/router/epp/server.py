"""``shoal route --epp``: the router as a Gateway API Inference Extension Endpoint Picker.

An Envoy ext_proc v3 gRPC service (one bidirectional stream per HTTP request) plus the gRPC
health service. Per stream (see ``protocol`` for the wire shapes):

* request headers ending the stream (a GET), or body mode NONE: pick now (by load alone
  when there is no body to key), answer the headers;
* request headers with a body to come: FULL_DUPLEX_STREAMED (told by the data plane in
  ``protocol_config``): the headers answer waits for the body; otherwise (BUFFERED, STREAMED)
  the headers are let through and the pick rides on the last body answer, while the data
  plane still holds the headers;
* the last body message: key the prompt, pick, answer; in full duplex the body goes back as
  streamed chunks (the data plane forwards only what it gets back);
* response messages pass untouched (echoed back in full duplex); the served endpoint the data
  plane reports moves the in-flight count there.
A stream makes at most one pick (a second request on the same stream gets the first pick
again, not another count), and the pick holds its replica's in-flight count until the
stream ends, however it ends. Bounds (``EppLimits``): a body over ``max_body_bytes`` is a
413; the bodies all streams buffer share ``max_buffered_bytes`` (past it: 503 with
Retry-After); at most ``max_streams`` streams are open (one more: 503 at its first
message); a stream has ``body_timeout_s`` from its start to its pick (then 408); and gRPC's
own message cap is the body limit plus room for the envelope, so the transport never
refuses a body the limit allows (gRPC's default would cap it at 4 MiB). Once a burst of
buffered bodies has drained, their memory goes back to the OS (``runtime/heap.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from shoal.runtime.heap import BurstTrimmer
from shoal.runtime.router.epp import protocol as wire
from shoal.runtime.router.epp.picker import EndpointPicker, Pick

log = logging.getLogger("shoal.router.epp")

MAX_BODY_BYTES = 16 << 20
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
ENVELOPE_BYTES = 64 << 10  # headers, metadata and protobuf framing around a body chunk
BUSY_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class EppLimits:
    max_body_bytes: int = MAX_BODY_BYTES
    max_buffered_bytes: int = 256 << 20  # request bodies held by all streams together
    max_streams: int = 1024
    body_timeout_s: float = 30.0  # from a stream's first message to its pick

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_buffered_bytes, self.max_streams) < 1 or \
                self.body_timeout_s <= 0:
            raise ValueError("EPP limits must be positive")


class BodyBudget:
    """Bytes of request bodies buffered across every stream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.trimmer = BurstTrimmer()  # their memory back to the OS after a burst

    def take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        self.trimmer.held(size)
        return True

    def give(self, size: int) -> None:
        self.used -= size
        self.trimmer.released(size)


@dataclass
class Exchange:
    """One request's state on its stream."""

    picker: EndpointPicker
    limits: EppLimits = EppLimits()
    budget: BodyBudget | None = None
    path: str = ""
    body: bytearray = field(default_factory=bytearray)
    subset: frozenset[str] | None = None
    full_duplex_request: bool = False
    body_withheld: bool = False  # request body mode NONE: the body never comes
    full_duplex_response: bool = False
    pick: Pick | None = None
    url: str | None = None  # where the in-flight count sits
    prefill_url: str | None = None  # P/D: the prefill replica's in-flight count, until the answer
    done: bool = False  # an immediate response ended the exchange

    async def handle(self, request: ext_proc.ProcessingRequest) -> list[
            ext_proc.ProcessingResponse]:
        kind = request.WhichOneof("request")
        if request.HasField("protocol_config"):
            mode = request.protocol_config
            self.full_duplex_request = mode.request_body_mode == wire.FULL_DUPLEX_STREAMED
            self.body_withheld = mode.request_body_mode == wire.BODY_NONE
            self.full_duplex_response = mode.response_body_mode == wire.FULL_DUPLEX_STREAMED
        if request.HasField("metadata_context") and self.subset is None:
            self.subset = wire.subset_hint(request.metadata_context)
        if kind == "request_headers":
            self.path = wire.header_map(request.request_headers).get(":path", "")
            if request.request_headers.end_of_stream or self.body_withheld:
                return await self._decide(headers_phase=True)
            return [] if self.full_duplex_request else [wire.headers_continue()]
        if kind == "request_body":
            chunk = request.request_body
            if self.pick is not None:  # a second request on one stream: not picked again
                return [wire.body_continue()]
            limit = self.limits.max_body_bytes
            if len(self.body) + len(chunk.body) > limit:
                self.done = True
                return [wire.immediate(wire.Refusal(413, f"request body over {limit} bytes"))]
            if self.budget is not None and not self.budget.take(len(chunk.body)):
                self.done = True
                return [wire.immediate(wire.Refusal(
                    503, "the endpoint picker is buffering too many request bodies; retry "
                    "later", retry_after_s=BUSY_RETRY_AFTER_S))]
            self.body += chunk.body
            if chunk.end_of_stream:
                return await self._decide(headers_phase=self.full_duplex_request)
            return [] if self.full_duplex_request else [wire.body_continue()]
        if kind == "response_headers":
            served = (wire.served_endpoint(request.metadata_context)
                      if request.HasField("metadata_context") else None)
            if served and self.pick is not None:
                self.url = self.picker.served_elsewhere(self.pick, served)
            self._release_prefill()  # the sidecar's prefill leg ends before the answer starts
            return [wire.response_continue(kind)]
        if kind == "response_body" and self.full_duplex_response:
            body = request.response_body
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
                    streamed_response=ext_proc.StreamedBodyResponse(
                        body=body.body, end_of_stream=body.end_of_stream)))))]
        return [wire.response_continue(kind or "")]

    async def _decide(self, headers_phase: bool) -> list[ext_proc.ProcessingResponse]:
        if self.pick is not None:  # one pick per stream: the in-flight count is counted once
            result: Pick | wire.Refusal = self.pick
        else:
            result = await self.picker.pick(self.path, bytes(self.body), self.subset)
        if isinstance(result, wire.Refusal):
            self.done = True
            return [wire.immediate(result)]
        self.pick = result
        if self.url is None:
            self.url = result.url
            self.prefill_url = result.prefill_url
        # P/D configured: say which prefill endpoint, or clear a header the client sent
        hint = wire.PrefillHint(result.prefill) if self.picker.prefill_pool is not None else None
        if not headers_phase:
            self._drop_body()
            return [wire.body_destination(result.endpoints, hint)]
        answer = [wire.headers_destination(result.endpoints, hint)]
        if self.full_duplex_request and self.body:
            answer += wire.body_streamed_back(bytes(self.body))
        elif self.full_duplex_request:  # headers did not end the stream, but the body was empty
            answer += wire.body_streamed_back(b"")
        self._drop_body()
        return answer

    def _drop_body(self) -> None:
        if self.budget is not None:
            self.budget.give(len(self.body))
        self.body = bytearray()

    def close(self) -> None:
        """Every way a stream ends: its body bytes and its in-flight count go back."""
        self._drop_body()
        self._release_prefill()
        if self.url is not None:
            self.picker.release(self.url)
            self.url = None

    def _release_prefill(self) -> None:
        if self.prefill_url is not None:
            self.picker.release_prefill(self.prefill_url)
            self.prefill_url = None


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker, limits: EppLimits = EppLimits()) -> None:
        self.picker = picker
        self.limits = limits
        self.budget = BodyBudget(limits.max_buffered_bytes)
        self.streams = 0

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[
            ext_proc.ProcessingResponse]:
        if self.streams >= self.limits.max_streams:
            try:  # answer the first message (the data plane waits for an answer), then end
                async with asyncio.timeout(self.limits.body_timeout_s):
                    await anext(request_iterator.__aiter__())
            except (StopAsyncIteration, TimeoutError):
                return
            yield wire.immediate(wire.Refusal(
                503, f"the endpoint picker has {self.streams} requests open; retry later",
                retry_after_s=BUSY_RETRY_AFTER_S))
            return
        self.streams += 1
        exchange = Exchange(self.picker, self.limits, self.budget)
        requests = request_iterator.__aiter__()
        deadline = asyncio.get_running_loop().time() + self.limits.body_timeout_s
        try:
            while not exchange.done:
                try:  # the deadline bounds the wait for the request, not the response
                    if exchange.pick is None:
                        async with asyncio.timeout_at(deadline):
                            request = await anext(requests)
                    else:
                        request = await anext(requests)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    exchange.done = True
                    responses = [wire.immediate(wire.Refusal(
                        408, "the request was not received within "
                        f"{self.limits.body_timeout_s:g} s"))]
                else:
                    responses = await exchange.handle(request)
                for response in responses:
                    yield response
        finally:
            self.streams -= 1
            exchange.close()
            # gRPC frees the call's buffers after this returns: the trim waits for quiet
            self.budget.trimmer.touch()


class EppServer:
    """The gRPC server: ext_proc + health on one port."""

    def __init__(self, picker: EndpointPicker, address: str,
                 limits: EppLimits = EppLimits()) -> None:
        self.picker = picker
        self.address = address
        self.health = health.aio.HealthServicer()
        # the transport takes any message the body limit allows (gRPC's default is 4 MiB)
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limits.max_body_bytes + ENVELOPE_BYTES)])
        self.processor = ExternalProcessor(picker, limits)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(address)

    async def set_ready(self, ready: bool) -> None:
        """Liveness is SERVING while the process answers; readiness and the ext_proc service
        once discovery has synced (the protocol's "datastore synced")."""
        serving = health_pb2.HealthCheckResponse.SERVING
        waiting = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("liveness", serving)
        for service in ("", "readiness", EXT_PROC_SERVICE):
            await self.health.set(service, serving if ready else waiting)

    async def start(self) -> None:
        await self.server.start()
        await self.set_ready(False)

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def run_until_cancelled(server: EppServer) -> None:
    try:
        await server.wait()
    except asyncio.CancelledError:
        await server.stop()
        raise
