"""The ZeroMQ topic KV events are published on: ``kv@<pod>@<model>``, the topic llm-d's
KV-events subscriber reads (it takes the pod and the model from the topic), unless
``--kv-events-topic`` names another. The pod is the ``POD_IP`` the Kubernetes downward
API sets (llm-d's deployments key pods by address), else ``POD_NAME``, else the host name.
"""

from __future__ import annotations

import os
import socket


def kv_events_topic(configured: str | None, model: str) -> str:
    if configured is not None:
        return configured
    pod = os.environ.get("POD_IP") or os.environ.get("POD_NAME") or socket.gethostname()
    return f"kv@{pod}@{model}"
