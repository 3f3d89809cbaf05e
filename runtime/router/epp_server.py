"""``shoal route --epp``: the router as a Gateway API Inference Extension Endpoint Picker.

An Envoy ext_proc v3 gRPC service (one bidirectional stream per HTTP request) plus the gRPC
health service. Per stream (see ``epp_protocol`` for the wire shapes):

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
The pick holds its replica's in-flight count until the stream ends.
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
from shoal.runtime.router import epp_protocol as wire
from shoal.runtime.router.epp_picker import EndpointPicker, Pick

log = logging.getLogger("shoal.router.epp")

MAX_BODY_BYTES = 16 << 20
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)


@dataclass
class Exchange:
    """One request's state on its stream."""

    picker: EndpointPicker
    path: str = ""
    body: bytearray = field(default_factory=bytearray)
    subset: frozenset[str] | None = None
    full_duplex_request: bool = False
    body_withheld: bool = False  # request body mode NONE: the body never comes
    full_duplex_response: bool = False
    pick: Pick | None = None
    url: str | None = None  # where the in-flight count sits
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
            if len(self.body) + len(chunk.body) > MAX_BODY_BYTES:
                self.done = True
                return [wire.immediate(wire.Refusal(413, "request body over 16 MiB"))]
            self.body += chunk.body
            if chunk.end_of_stream:
                return await self._decide(headers_phase=self.full_duplex_request)
            return [] if self.full_duplex_request else [wire.body_continue()]
        if kind == "response_headers":
            served = (wire.served_endpoint(request.metadata_context)
                      if request.HasField("metadata_context") else None)
            if served and self.pick is not None:
                self.url = self.picker.served_elsewhere(self.pick, served)
            return [wire.response_continue(kind)]
        if kind == "response_body" and self.full_duplex_response:
            body = request.response_body
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
                    streamed_response=ext_proc.StreamedBodyResponse(
                        body=body.body, end_of_stream=body.end_of_stream)))))]
        return [wire.response_continue(kind or "")]

    async def _decide(self, headers_phase: bool) -> list[ext_proc.ProcessingResponse]:
        result = await self.picker.pick(self.path, bytes(self.body), self.subset)
        if isinstance(result, wire.Refusal):
            self.done = True
            return [wire.immediate(result)]
        self.pick, self.url = result, result.url
        if not headers_phase:
            return [wire.body_destination(result.endpoints)]
        answer = [wire.headers_destination(result.endpoints)]
        if self.full_duplex_request and self.body:
            answer += wire.body_streamed_back(bytes(self.body))
        elif self.full_duplex_request:  # headers did not end the stream, but the body was empty
            answer += wire.body_streamed_back(b"")
        self.body = bytearray()
        return answer

    def close(self) -> None:
        if self.url is not None:
            self.picker.release(self.url)
            self.url = None


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[
            ext_proc.ProcessingResponse]:
        exchange = Exchange(self.picker)
        try:
            async for request in request_iterator:
                for response in await exchange.handle(request):
                    yield response
                if exchange.done:
                    return
        finally:
            exchange.close()


class EppServer:
    """The gRPC server: ext_proc + health on one port."""

    def __init__(self, picker: EndpointPicker, address: str) -> None:
        self.picker = picker
        self.address = address
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker),
                                                               self.server)
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
