"""Where a Responses follow-up must go: the replica that stores its conversation.

A stored response lives in the memory of the API process that made it. Its id carries that
process's instance tag (``shoal.contract.response_ids``), and each replica's ``/ready`` names
its instance (``Replica.instance``), so the router needs no table of its own: a request
with ``previous_response_id`` is sent to the replica with that tag, and only there. When no
known replica has the tag (it restarted or was removed: the conversation went with it) the
answer is a clear 404 at once; when that replica is known but not ready, a 503 to retry.
Anything else (no previous id, an id in another form, a body that is not JSON) is routed by
load, and the engine judges it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shoal.runtime.router.policies.request_keys import RequestKeyError, decode_body
from shoal.runtime.router.replicas.pool import Replica

from shoal.contract.errors import error_json
from shoal.contract.response_ids import instance_of

RESPONSES_PATH = "/v1/responses"
GONE_RETRY_AFTER_S = 1


@dataclass(frozen=True)
class HomeGone:
    status: int  # 404: no replica has it any more; 503: its replica is not ready now
    message: str
    retry_after_s: int | None = None

    def body(self) -> bytes:
        return error_json(self.status, self.message, "previous_response_not_found"
                          if self.status == 404 else None, "previous_response_id")


def previous_response_id(raw: bytes) -> str | None:
    try:
        body = decode_body(raw)
    except RequestKeyError:
        return None
    value = body.get("previous_response_id") if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def response_home(path: str, raw: bytes,
                  replicas: Mapping[str, Replica]) -> str | HomeGone | None:
    """The one replica URL this request may go to, why it cannot go anywhere, or None
    (no constraint: route by load)."""
    if path != RESPONSES_PATH:
        return None
    response_id = previous_response_id(raw)
    instance = instance_of(response_id) if response_id is not None else None
    if instance is None:
        return None
    for url, replica in replicas.items():
        if replica.instance == instance:
            if not replica.ready:
                return HomeGone(503, f"the replica that stores response {response_id!r} is "
                                "not ready; retry", GONE_RETRY_AFTER_S)
            return url
    return HomeGone(404, f"response {response_id!r} is gone: the replica that stored it has "
                    "restarted or left the pool")
