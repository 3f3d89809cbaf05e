"""Request keying never raises: 100k-deep JSON and token ids beyond int64 are routed by load
(the engine answers its 400) through the router, and answered 400 at once by the endpoint
picker; never a 500 or a gRPC UNKNOWN."""

from __future__ import annotations

import json

import httpx
import pytest
from shoal.runtime.router.policies.request_keys import (
    MAX_JSON_DEPTH,
    KeyConfig,
    MalformedBody,
    RequestKeys,
    decode_body,
    keys_of_body,
    keys_or_none,
)

from tests.router.epp_client import pick_buffered, start_epp

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_CHAT = (b'{"messages": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000
             + b"}]}")
HUGE_IDS = b'{"prompt": [1, 2, 99999999999999999999999999], "max_tokens": 1}'
NEGATIVE_IDS = b'{"prompt": [1, -5], "max_tokens": 1}'


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("body", [DEEP, DEEP_CHAT, HUGE_IDS, NEGATIVE_IDS, b"{not json",
                                  b'"\\ud800"'])
def test_keying_a_hostile_body_returns_instead_of_raising(path, body):
    keys = keys_of_body(path, body, KeyConfig())
    assert isinstance(keys, MalformedBody) or keys is None
    assert keys_or_none(path, body, KeyConfig()) is None


def test_depth_is_bounded_and_good_bodies_still_key():
    nested = {"a": 1}
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = {"a": nested}
    assert decode_body(json.dumps(nested).encode()) == nested
    with pytest.raises(MalformedBody, match="nested"):
        decode_body(json.dumps({"x": nested}).encode())
    keys = keys_of_body("/v1/completions", b'{"prompt": [1, 2, 3], "max_tokens": 1}',
                        KeyConfig(block_size=1))
    assert isinstance(keys, RequestKeys) and len(keys.block_keys) == 3


def test_the_router_forwards_hostile_bodies_for_the_engines_400(fake_fleet):
    fleet = fake_fleet(2)
    with httpx.Client(timeout=30) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in (DEEP, DEEP_CHAT, HUGE_IDS):
                answer = client.post(f"{fleet.router}{path}", content=body,
                                     headers={"content-type": "application/json"})
                assert answer.status_code == 400, (path, body[:40], answer.text)
                assert answer.json()["error"]["message"] in ("bad body",
                                                             "token id out of range")
        assert client.get(f"{fleet.router}/health").status_code == 200
        good = client.post(f"{fleet.router}/v1/completions",
                           json={"prompt": "fine", "max_tokens": 1})
        assert good.status_code == 200
    assert sum(fleet.admin(url).get("bad_bodies", 0) for url in fleet.engines) == 6


def test_the_endpoint_picker_answers_hostile_bodies_400_at_once(fake_fleet, spawn, free_port):
    fleet = fake_fleet(1)
    channel = start_epp(spawn, free_port, fleet.engines)
    for path, body in [("/v1/completions", DEEP), ("/v1/completions", HUGE_IDS),
                       ("/v1/completions", NEGATIVE_IDS), ("/v1/chat/completions", DEEP),
                       ("/v1/chat/completions", DEEP_CHAT)]:
        answer, _ = pick_buffered(channel, path, body)
        assert answer.immediate_response.status.code == 400, (path, answer)
        error = json.loads(answer.immediate_response.body)["error"]
        assert error["type"] == "BadRequestError"
    good, _ = pick_buffered(channel, "/v1/completions", {"prompt": "fine", "max_tokens": 1})
    assert good.HasField("request_body")
