"""Kubernetes Events on an InferenceService: what `kubectl describe` shows a user."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from shoal.operator.names import API_VERSION, KIND, MANAGER, Owner


def render_event(owner: Owner, event_type: str, reason: str, message: str,
                 now: datetime) -> dict[str, Any]:
    stamp = now.isoformat().replace("+00:00", "Z")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{owner.name}.{uuid.uuid4().hex[:16]}",
                     "namespace": owner.namespace},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name,
                           "namespace": owner.namespace, "uid": owner.uid},
        "type": event_type,  # Normal | Warning
        "reason": reason,
        "message": message[:1024],
        "source": {"component": MANAGER},
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
