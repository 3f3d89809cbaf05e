"""HTTP headers and error codes between the router (or a gateway's endpoint picker) and the
engines: what each side may conclude from an answer (docs/architecture.md)."""

from __future__ import annotations

# On a 429 or 503, this header says that the engine did no work for the request (not ready,
# draining, queue full, connection cap), so another replica may take it. Without it, a 5xx
# means the request may have run, and must not be replayed elsewhere.
RETRY_SAFE_HEADER = "x-shoal-retry-safe"
# The authenticated tenant a trusted router forwards to the engines (docs/operations.md);
# engines salt the prefix cache by it, so the value is ``tenant.tenant_of_key`` of the key.
TENANT_HEADER = "x-shoal-tenant"
# The error code of a request that was running when its engine died (not retry-safe).
ENGINE_DIED_CODE = "engine_died"
# P/D through a gateway, llm-d's name for it: the endpoint picker names the prefill engine
# (host:port) that computes the prompt; the decode endpoint's sidecar (``shoal route
# --pd-sidecar``) runs that prefill leg first. Absent: the decode engine computes the prompt.
PREFILLER_HEADER = "x-prefiller-host-port"
