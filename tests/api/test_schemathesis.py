"""Property-based requests from the server's own /openapi.json (schemathesis): whatever a
client builds from the published schema, valid or not, the server never answers 5xx.

Bounded: a few examples per operation, derandomized, and generated requests ask for at most
a few tokens (``max_tokens`` capped), so the module runs in well under a minute."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

MAX_EXAMPLES = 12
TOKEN_CAP = 4


def capped(body: object) -> object:
    """Generation length is not what is under test; a CPU engine would take minutes for a
    generated max_tokens of thousands."""
    if isinstance(body, dict):
        # absent or null: chat's and /v1/responses' default is up to max_model_len
        if "messages" in body and body.get("max_tokens") is None \
                and body.get("max_completion_tokens") is None:
            body["max_tokens"] = TOKEN_CAP
        if "input" in body and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = TOKEN_CAP
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            count = _number(body.get(field))
            if count is not None and count > TOKEN_CAP:
                body[field] = TOKEN_CAP
    return body


def _number(value: object) -> float | None:
    """What the server's lax validation reads as a count: 3000, 3000.0 and "3000" alike (an
    uncapped 3000.0 generated past the 60 s read timeout on a loaded machine)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def test_no_request_built_from_the_schema_gets_a_5xx(server):
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize",
            "/detokenize"} <= paths
    seen: dict[str, set[int]] = {}
    for operation in operations:

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate])  # no shrinking: bounded time
        @given(case=operation.as_strategy())
        def no_server_error(case) -> None:
            case.body = capped(case.body)
            response = case.call(headers=server.headers(), timeout=60)
            seen.setdefault(f"{case.method} {case.path}", set()).add(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body,
                                                response.text)
            assert "Traceback" not in response.text

        no_server_error()
    print(seen)
