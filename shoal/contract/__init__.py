"""What Shoal's processes agree on over the wire, in one place: the engine's metric names and
how their Prometheus text is read, the HTTP headers between router and engines, the
OpenAI-style error body, the tenant identity, the routing-policy names.

The API server, the router and the operator all import it; it imports nothing of Shoal and
nothing heavier than the standard library and ``prometheus_client`` (which the operator-only
install has), so the operator image can use it without torch
(tests/packaging/test_architecture.py checks both rules).
"""
