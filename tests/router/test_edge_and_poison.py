"""Pure parts of the router's edge: key checks, upstream headers, the failed-request window,
and the listener's rate-limited log (the processes are tested in test_containment.py)."""

from __future__ import annotations

import logging

from shoal.runtime.log_limits import RateLimitedLog
from shoal.runtime.router.edge_auth import EdgeAuth, read_key_file
from shoal.runtime.router.proxy.poison import FailedRequests, fingerprint

from shoal.contract.headers import TENANT_HEADER
from shoal.contract.tenant import tenant_of_key


def test_keys_authenticate_as_their_own_tenant_and_nothing_else_does():
    auth = EdgeAuth(("sk-a", "sk-b"))
    assert auth.tenant("Bearer sk-a") == tenant_of_key("sk-a") != auth.tenant("bearer sk-b")
    for given in (None, "", "sk-a", "Bearer sk-c", "Bearer sk-a2", "Basic sk-a"):
        assert auth.tenant(given) is None
    assert "sk-a" not in tenant_of_key("sk-a")  # the key itself never goes upstream


def test_upstream_headers_carry_the_routers_credential_and_tenant_only():
    client = [("authorization", "Bearer sk-a"), (TENANT_HEADER, "someone-else"),
              ("x-request-id", "r1")]
    auth = EdgeAuth(("sk-a",), upstream_key="sk-engine")
    assert auth.upstream_headers(client, "key-1") == [
        ("x-request-id", "r1"), ("Authorization", "Bearer sk-engine"), (TENANT_HEADER, "key-1")]
    # no router keys and no upstream key: the client's key passes through, a tenant never
    assert EdgeAuth().upstream_headers(client, None) == [("authorization", "Bearer sk-a"),
                                                         ("x-request-id", "r1")]


def test_anthropic_clients_x_api_key_authenticates_and_never_goes_upstream():
    auth = EdgeAuth(("sk-a",), upstream_key="sk-engine")
    assert auth.tenant(None, "sk-a") == tenant_of_key("sk-a")
    assert auth.tenant(None, "sk-b") is None
    assert auth.tenant("Bearer sk-b", "sk-a") is None  # the Bearer token is the one checked
    client = [("x-api-key", "sk-a"), ("anthropic-version", "2023-06-01")]
    assert auth.upstream_headers(client, "key-1") == [
        ("anthropic-version", "2023-06-01"), ("Authorization", "Bearer sk-engine"),
        (TENANT_HEADER, "key-1")]
    assert EdgeAuth().upstream_headers(client, None) == client  # pass-through mode


def test_key_file_skips_comments_and_blanks(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team a\nsk-1\n\n  sk-2  \n")
    assert read_key_file(str(path)) == ["sk-1", "sk-2"]


def test_a_failed_request_is_held_to_its_replica_for_the_window_only():
    failed = FailedRequests(window=10.0, capacity=2)
    key = fingerprint("t1", "/v1/completions", b'{"prompt": "x"}')
    assert key != fingerprint("t2", "/v1/completions", b'{"prompt": "x"}')
    failed.record(key, "http://a", now=100.0)
    entry = failed.lookup(key, now=105.0)
    assert entry is not None and entry.replica == "http://a"
    assert failed.lookup(key, now=110.0) is None and len(failed) == 0
    for i in range(3):  # bounded: the oldest is forgotten first
        failed.record(bytes([i]), "http://a", now=0.0)
    assert len(failed) == 2 and failed.lookup(bytes([0]), now=1.0) is None


def test_the_quarantine_key_is_the_requests_meaning_not_its_bytes():
    def key(body: bytes, tenant: str = "t1") -> bytes:
        return fingerprint(tenant, "/v1/completions", body)

    poison = key(b'{"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["a"]}}')
    for variant in (  # only fields that change nothing the engine computes, or the layout
            b'{"max_tokens":5,"prompt":"x","structured_outputs":{"choice":["a"]},"user":"u2"}',
            b'{"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["a"]}, '
            b'"metadata": {"k": "v"}, "stream": true, "stream_options": {"include_usage": true},'
            b' "request_id": "r-9", "store": false}'):
        assert key(variant) == poison, variant
    for different in (
            b'{"prompt": "y", "max_tokens": 5, "structured_outputs": {"choice": ["a"]}}',
            b'{"prompt": "x", "max_tokens": 6, "structured_outputs": {"choice": ["a"]}}',
            b'{"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["a"], '
            b'"user": "nested fields count"}}'):
        assert key(different) != poison, different
    # another tenant's identical request is not held back by this one's failure
    assert key(b'{"prompt": "x", "max_tokens": 5, "structured_outputs": {"choice": ["a"]}}',
               tenant="t2") != poison
    # what the stdlib cannot decode is keyed by its bytes, and never raises
    deep = b"[" * 100_000 + b"]" * 100_000
    assert key(deep) == key(deep) != key(deep + b" ")
    long_int = b'{"prompt": [' + b"9" * 5000 + b"]}"
    assert key(long_int) == key(long_int)
    assert key(b"\xff not json") != key(b"\xfe not json")


def test_log_lines_are_rate_limited_per_message():
    limiter = RateLimitedLog(window_s=60.0, burst=3)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    passed = [limiter.filter(record("Invalid HTTP request received.")) for _ in range(1000)]
    assert sum(passed) == 3
    assert limiter.filter(record("another message"))
