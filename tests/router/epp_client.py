"""``start_epp`` runs `shoal route --epp` and connects; ``EnvoyStream`` is a test client
that speaks ext_proc to an Endpoint Picker the way Envoy does: one
bidirectional gRPC stream per HTTP request, ProcessingRequests sent as the request
arrives, ProcessingResponses read as the processor answers."""

from __future__ import annotations

import json
import queue
import sys
from collections.abc import Iterator
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.router.conftest import wait_until

Mode = processing_mode_pb2.ProcessingMode
_END = object()


class EnvoyStream:
    """One request's ext_proc stream."""

    def __init__(self, channel: grpc.Channel, timeout: float = 30.0) -> None:
        self._outbox: queue.Queue[Any] = queue.Queue()
        self._responses = ext_proc_grpc.ExternalProcessorStub(channel).Process(
            self._requests(), timeout=timeout)
        self.first = True

    def _requests(self) -> Iterator[ext_proc.ProcessingRequest]:
        while True:
            item = self._outbox.get()
            if item is _END:
                return
            yield item

    def send(self, request: ext_proc.ProcessingRequest) -> None:
        self._outbox.put(request)

    def recv(self) -> ext_proc.ProcessingResponse:
        return next(self._responses)

    def close(self) -> None:
        self._outbox.put(_END)
        self._responses.cancel()


def metadata(subset: list[str] | None = None, served: str | None = None) -> base_pb2.Metadata:
    md = base_pb2.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        md.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if served is not None:
        md.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": served})
    return md


def headers_message(path: str, end_of_stream: bool, mode: int | None = None,
                    subset: list[str] | None = None) -> ext_proc.ProcessingRequest:
    pairs = [(":method", "POST" if not end_of_stream else "GET"), (":path", path),
             (":authority", "gateway.example"), ("content-type", "application/json")]
    headers = ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                            for k, v in pairs]),
        end_of_stream=end_of_stream)
    request = ext_proc.ProcessingRequest(request_headers=headers)
    if mode is not None:
        request.protocol_config.request_body_mode = mode  # type: ignore[assignment]
        request.protocol_config.response_body_mode = mode  # type: ignore[assignment]
    if subset is not None:
        request.metadata_context.CopyFrom(metadata(subset))
    return request


def body_message(chunk: bytes, end_of_stream: bool) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=chunk, end_of_stream=end_of_stream))


def response_headers_message(served: str | None = None) -> ext_proc.ProcessingRequest:
    request = ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders())
    if served is not None:
        request.metadata_context.CopyFrom(metadata(served=served))
    return request


def destination(response: ext_proc.ProcessingResponse) -> tuple[str, str]:
    """(header value, dynamic-metadata value) of a pick answer."""
    common = (response.request_headers.response if response.HasField("request_headers")
              else response.request_body.response)
    header = {h.header.key: h.header.raw_value.decode()
              for h in common.header_mutation.set_headers}["x-gateway-destination-endpoint"]
    meta = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value
    return header, meta


def pick_buffered(channel: grpc.Channel, path: str, body: dict[str, Any] | bytes,
                  subset: list[str] | None = None,
                  keep_open: bool = False) -> tuple[ext_proc.ProcessingResponse, EnvoyStream]:
    """BUFFERED body mode: headers -> continue, whole body -> the pick (or an immediate
    response, which may already answer the headers)."""
    stream = EnvoyStream(channel)
    stream.send(headers_message(path, end_of_stream=False, mode=Mode.BUFFERED, subset=subset))
    first = stream.recv()
    if first.HasField("immediate_response"):
        stream.close()
        return first, stream
    assert first.HasField("request_headers")
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    stream.send(body_message(raw, end_of_stream=True))
    answer = stream.recv()
    if not keep_open:
        stream.close()
    return answer, stream


def start_epp(spawn, free_port, backends: list[str], *flags: str) -> grpc.Channel:
    port = free_port("127.0.0.1")
    argv = [sys.executable, "-m", "shoal.runtime.router.cli", "--epp", "--host", "127.0.0.1",
            "--port", str(port), "--health-interval", "0.2", "--scrape-interval", "0.2", *flags]
    for url in backends:
        argv += ["--backend", url]
    spawn(argv)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)

    def ready() -> bool:
        try:
            answer = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
            return answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    wait_until(ready, timeout=60, what="EPP readiness")
    return channel
