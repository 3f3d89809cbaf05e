"""Response ids between the API and the router: a stored Responses conversation lives in
the memory of the API process that made it, so its id says which process that is.

``resp_<instance>_<hex>``: ``instance`` is the process's random tag, which its ``/ready``
body also reports (``{"instance": ...}``); a router (or endpoint picker) sends a
``previous_response_id`` follow-up to the replica whose /ready named that tag.
"""

from __future__ import annotations

import uuid

RESPONSE_ID_PREFIX = "resp_"
INSTANCE_CHARS = 16
READY_INSTANCE_FIELD = "instance"


def new_instance() -> str:
    return uuid.uuid4().hex[:INSTANCE_CHARS]


def response_id(instance: str) -> str:
    return f"{RESPONSE_ID_PREFIX}{instance}_{uuid.uuid4().hex}"


def instance_of(response_id: str) -> str | None:
    """The instance tag a response id carries (None: not an id in this form)."""
    if not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    tag, sep, _ = response_id[len(RESPONSE_ID_PREFIX):].partition("_")
    return tag if sep and len(tag) == INSTANCE_CHARS else None
