"""The Endpoint Picker protocol's wire shapes (gateway-api-inference-extension
docs/proposals/004-endpoint-picker-protocol, protocol version v1.0.0), as pure functions over
Envoy's ext_proc v3 messages from the ``xds-protos`` package.

What the data plane sends: request headers (``:path``, ...), the request body in one message
(BUFFERED) or in chunks (STREAMED, FULL_DUPLEX_STREAMED), optionally a subset of endpoints to
pick from in ``metadata_context.filter_metadata["envoy.lb.subset_hint"]
["x-gateway-destination-endpoint-subset"]`` and, on the response path, the endpoint that
served the request under ``envoy.lb`` / ``x-gateway-destination-endpoint-served``.
What the EPP answers: the picked ``ip:port`` (then fallbacks, comma separated) in the header
``x-gateway-destination-endpoint`` and the same string in ``dynamic_metadata["envoy.lb"]``,
or an ImmediateResponse: 503 when no endpoint is ready, 429 when the request is shed.
With P/D (llm-d's extension, not the protocol's): the prefill endpoint in the header
``x-prefiller-host-port``, or that header removed when the decode endpoint computes the prompt
(a client must not choose where the sidecar sends prompts; llm-d's EPP clears it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from shoal.contract.errors import error_json
from shoal.contract.headers import PREFILLER_HEADER

PROTOCOL_VERSION = "v1.0.0"
DESTINATION_ENDPOINT_KEY = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
STREAMED_CHUNK_LIMIT = 62_000  # bytes per streamed body chunk: some Envoys cap chunks at 64 KiB

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX_STREAMED = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BODY_NONE = processing_mode_pb2.ProcessingMode.NONE


@dataclass(frozen=True)
class Refusal:
    """No endpoint for this request: answered with an ImmediateResponse."""

    status: int  # 503 nothing ready (or nothing ready in the subset), 429 shed
    message: str
    retry_after_s: int | None = None


def header_map(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    """Envoy sends header values in ``raw_value`` (bytes); older Envoys in ``value``."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def _struct_strings(value: struct_pb2.Value) -> list[str]:
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values
                if v.WhichOneof("kind") == "string_value"]
    if kind == "string_value":  # tolerated: one endpoint, or "a,b" as in the answer's format
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return []


def subset_hint(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the data plane restricts this pick to; None when it sends no hint."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    return frozenset(_struct_strings(fields[SUBSET_KEY]))


def served_endpoint(metadata: base_pb2.Metadata) -> str | None:
    if DESTINATION_NAMESPACE not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[DESTINATION_NAMESPACE].fields
    if SERVED_KEY not in fields:
        return None
    served = _struct_strings(fields[SERVED_KEY])
    return served[0] if served else None


def destination_value(endpoints: Sequence[str]) -> str:
    if not endpoints:
        raise ValueError("a destination needs at least one endpoint")
    return ",".join(endpoints)


@dataclass(frozen=True)
class PrefillHint:
    """P/D in the picker: ``endpoint`` (ip:port) computes the prompt; None: nobody does
    before the decode endpoint, and a header the client sent is removed."""

    endpoint: str | None


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _destination_common(value: str, prefill: PrefillHint | None) -> ext_proc.CommonResponse:
    mutation = ext_proc.HeaderMutation(set_headers=[_set(DESTINATION_ENDPOINT_KEY, value)])
    if prefill is not None and prefill.endpoint is not None:
        mutation.set_headers.append(_set(PREFILLER_HEADER, prefill.endpoint))
    elif prefill is not None:
        mutation.remove_headers.append(PREFILLER_HEADER)
    # the route (and so the cluster) is chosen again with the new header in place
    return ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)


def _destination_metadata(value: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[
        DESTINATION_ENDPOINT_KEY].string_value = value
    return metadata


def headers_destination(endpoints: Sequence[str], prefill: PrefillHint | None = None,
                        ) -> ext_proc.ProcessingResponse:
    """The pick as the answer to the request headers (bodyless requests, full duplex)."""
    value = destination_value(endpoints)
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=_destination_common(value, prefill)),
        dynamic_metadata=_destination_metadata(value))


def body_destination(endpoints: Sequence[str], prefill: PrefillHint | None = None,
                     ) -> ext_proc.ProcessingResponse:
    """The pick as the answer to the last body message (BUFFERED, STREAMED): Envoy still holds
    the request headers then, so the mutation applies before the route is chosen."""
    value = destination_value(endpoints)
    return ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=_destination_common(value, prefill)),
        dynamic_metadata=_destination_metadata(value))


def headers_continue() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse()))


def body_continue() -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=ext_proc.CommonResponse()))


def body_streamed_back(body: bytes) -> list[ext_proc.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: Envoy forwards only what the processor sends back, so the body
    read for the pick goes back unchanged, in chunks, the last one ending the stream."""
    chunks = [body[i:i + STREAMED_CHUNK_LIMIT]
              for i in range(0, len(body), STREAMED_CHUNK_LIMIT)] or [b""]
    return [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(
                body=chunk, end_of_stream=i == len(chunks) - 1)))))
            for i, chunk in enumerate(chunks)]


def response_continue(kind: str) -> ext_proc.ProcessingResponse:
    """Pass the upstream's response headers or body through untouched."""
    if kind == "response_headers":
        return ext_proc.ProcessingResponse(
            response_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse()))
    if kind == "response_body":
        return ext_proc.ProcessingResponse(
            response_body=ext_proc.BodyResponse(response=ext_proc.CommonResponse()))
    if kind == "response_trailers":
        return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
    return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())


def immediate(refusal: Refusal) -> ext_proc.ProcessingResponse:
    """An OpenAI-style JSON error sent to the client by the data plane itself."""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
        key="content-type", raw_value=b"application/json"))]
    if refusal.retry_after_s is not None:
        headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
            key="retry-after", raw_value=str(refusal.retry_after_s).encode())))
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refusal.status),  # type: ignore[arg-type]
        headers=ext_proc.HeaderMutation(set_headers=headers),
        body=error_json(refusal.status, refusal.message), details=f"shoal-epp: {refusal.message}"))
