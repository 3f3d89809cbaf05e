"""kmock's KubernetesEmulator with the API-server semantics the operator relies on.

kmock stores objects exactly as sent and merges every PATCH naively. A real API server also:
assigns uid / generation / resourceVersion / creationTimestamp on create; bumps generation when
the spec changes; ignores status in main-resource writes and everything but status in /status
writes; treats server-side apply as create-or-replace of the applier's fields; merges pod
conditions by type in strategic-merge patches; filters lists and watches by labelSelector.
This subclass adds exactly those, and lets /api/v1/namespaces be listed (loaded by
conftest.py; not a test module).

Authentication, when `authenticate` is set: a request must carry a bearer token it accepts or
a client certificate the TLS layer verified, else 401 (as the API server answers an expired or
revoked token). Every request's credentials are recorded in `seen`. `drop_watches()` ends the
open watch streams, as an API server restart does; clients re-connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import parsing

_parse_path = parsing.parse_path


def _parse_path_with_namespaces(path: str) -> parsing.ParsedPath:
    """kmock reads /api/v1/namespaces[/name] as a namespace prefix and fails; kopf lists it."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath("", "v1", "namespaces", None,
                                  parts[3] if len(parts) == 4 else None, None)
    return _parse_path(path)


parsing.parse_path = _parse_path_with_namespaces

# Resources whose status only changes through the /status subresource.
STATUS_SUBRESOURCE = {"inferenceservices", "pods", "deployments"}
_versions = itertools.count(1)


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(base: Any, patch: Any) -> Any:
    """RFC 7386 merge patch (None deletes)."""
    if not isinstance(patch, Mapping) or not isinstance(base, Mapping):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(base.get(key), value)
    return out


def replacement_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch turning `old` into `new` (keys missing from `new` become None)."""
    out: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(old.get(key), Mapping):
            out[key] = replacement_patch(old[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge_conditions(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_type = {c.get("type"): dict(c) for c in old}
    for cond in new:
        by_type[cond.get("type")] = {**by_type.get(cond.get("type"), {}), **cond}
    return list(by_type.values())


def matches_selector(labels: Mapping[str, str], selector: str | None) -> bool:
    for term in (selector or "").split(","):
        term = term.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass(frozen=True)
class Seen:
    """The credentials one request carried, and what the emulator answered."""

    at: float  # time.monotonic()
    user_agent: str
    token: str | None
    client_cert: str | None  # the verified client certificate's subject CN
    path: str
    status: int  # 401 when refused; 0 when passed on


def _common_name(peercert: Any) -> str | None:
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    authenticate: Callable[[str | None, str | None], bool] | None = None  # (token, cert CN)
    seen: list[Seen] = attrs.field(factory=list)
    _drop: asyncio.Event = attrs.field(factory=asyncio.Event)

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if self.authenticate is None:
            return await super().__call__(raw_request)
        header = raw_request.headers.get("Authorization") or ""
        token = header[len("Bearer "):] if header.startswith("Bearer ") else None
        transport = raw_request.transport
        cert = _common_name(transport.get_extra_info("peercert")) if transport else None
        allowed = self.authenticate(token, cert)
        self.seen.append(Seen(time.monotonic(), raw_request.headers.get("User-Agent", ""),
                              token, cert, raw_request.path_qs, 0 if allowed else 401))
        if not allowed:
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                "message": "Unauthorized", "reason": "Unauthorized", "code": 401}, status=401)
        return await super().__call__(raw_request)

    def drop_watches(self) -> None:
        self._drop.set()
        self._drop = asyncio.Event()

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock logs every request and matches reactions by scanning that log: keep it short,
        # or each request gets slower as a long test runs.
        if len(self._requests) > 400:
            del self._requests[:-50]
        if request.resource is not None and request.action is not None:
            admitted = self._admit(request)
            if admitted is not request:
                # kmock matches reactions by the identity of the logged request: log the new one.
                index = next(i for i, r in enumerate(self._requests) if r is request)
                self._requests[index] = admitted
                request = admitted
        return await super()._handle(request)

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(dict(self.objects[key].raw))

    def _admit(self, request: kmock.Request) -> kmock.Request:
        action = str(request.action.value).upper()
        if action == "CREATE":
            return attrs.evolve(request, data=self._on_create(request, request.data))
        if action != "UPDATE":
            return request
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip()
        current = self._current(request)
        data = copy.deepcopy(request.data or {})
        plural = request.resource.plural
        if isinstance(data, list):  # JSON patch (kopf's finalizers): apply it, test ops included
            if current is None:
                return request
            try:
                patched = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise kmock.KubernetesError(status=409, reason="Conflict", message=str(exc)) \
                    from exc
            data = replacement_patch(current, patched)
        if content_type == "application/apply-patch+yaml":
            if current is None:  # server-side apply creates what is missing
                data.setdefault("metadata", {})["name"] = request.name
                return attrs.evolve(request, action=kmock.action.CREATE,
                                    data=self._on_create(request, data))
            data = self._apply_as_patch(current, data)
        if current is None:
            return request  # kmock answers 404
        if request.subresource == "status":
            data = {"status": data.get("status") or {}}
        elif request.subresource is None and plural in STATUS_SUBRESOURCE:
            data.pop("status", None)
        if content_type == "application/strategic-merge-patch+json":
            new_conditions = (data.get("status") or {}).get("conditions")
            if new_conditions is not None:
                old = (current.get("status") or {}).get("conditions") or []
                data["status"]["conditions"] = merge_conditions(old, new_conditions)
        meta = data.setdefault("metadata", {})
        if "spec" in data and merge(current.get("spec"), data["spec"]) != current.get("spec"):
            meta["generation"] = int(current["metadata"].get("generation") or 1) + 1
        meta["resourceVersion"] = str(next(_versions))
        return attrs.evolve(request, data=data)

    def _on_create(self, request: kmock.Request, data: dict[str, Any]) -> dict[str, Any]:
        data = copy.deepcopy(data)
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["generation"] = 1
        meta["resourceVersion"] = str(next(_versions))
        meta["creationTimestamp"] = _stamp()
        return data

    @staticmethod
    def _apply_as_patch(current: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
        """Single-manager server-side apply: the applied fields replace the previous ones."""
        patch: dict[str, Any] = {}
        for key, value in applied.items():
            if key in ("status", "metadata"):
                continue
            old = current.get(key)
            patch[key] = replacement_patch(old, value) if isinstance(old, Mapping) and \
                isinstance(value, Mapping) else value
        for key in current:
            if key not in applied and key not in ("status", "metadata", "apiVersion", "kind"):
                patch[key] = None
        old_meta = current.get("metadata") or {}
        new_meta = applied.get("metadata") or {}
        patch["metadata"] = {
            key: new_meta.get(key) for key in ("labels", "annotations", "ownerReferences")
            if key in new_meta or key in old_meta
        }
        for key in ("labels", "annotations"):
            if isinstance(new_meta.get(key), Mapping) and isinstance(old_meta.get(key), Mapping):
                patch["metadata"][key] = replacement_patch(old_meta[key], new_meta[key])
        return patch

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        result["items"] = [item for item in result["items"] if matches_selector(
            (item.get("metadata") or {}).get("labels") or {}, selector)]
        # A real list names its kind (DeploymentList); clients (the dynamic client) read it.
        resource = request.resource
        result["apiVersion"] = f"{resource.group}/{resource.version}" if resource.group \
            else resource.version
        result["kind"] = f"{self.resources[resource].kind}List"
        return result

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        selector = request.params.get("labelSelector")
        dropped = asyncio.ensure_future(self._drop.wait())
        events = aiter(super()._serve_watch(request))
        try:
            while True:
                following = asyncio.ensure_future(anext(events))
                await asyncio.wait({following, dropped}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():  # drop_watches(): end this stream
                    following.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await following
                    return
                try:
                    event = following.result()
                except StopAsyncIteration:
                    return
                if isinstance(event, dict) and selector:
                    labels = ((event.get("object") or {}).get("metadata") or {}).get(
                        "labels") or {}
                    if not matches_selector(labels, selector):
                        continue
                yield event
        finally:
            dropped.cancel()
