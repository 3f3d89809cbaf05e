"""The pure parts of the limits: JSON depth, lone-surrogate location, the rate-limited log."""

from __future__ import annotations

import logging

import pytest
from shoal.runtime.api.body import decode_json, json_depth
from shoal.runtime.api.errors import APIError
from shoal.runtime.log_limits import RateLimitedLog


def test_json_depth_counts_containers_and_stops_early():
    assert json_depth(1, 10) == 0
    assert json_depth({"a": [1, {"b": []}]}, 10) == 4
    deep: list = []
    for _ in range(50_000):  # iterative: no recursion limit to hit
        deep = [deep]
    assert json_depth(deep, 64) == 65


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"messages": [{"content": "ok"}, {"content": "\\udfff"}]}', "messages.1.content"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(raw, param):
    with pytest.raises(APIError) as refused:
        decode_json(raw, 64)
    assert (refused.value.status, refused.value.param) == (400, param)


def test_deep_json_is_a_400_not_a_recursion_error():
    for depth in (100, 100_000):
        with pytest.raises(APIError) as refused:
            decode_json(b"[" * depth + b"]" * depth, 64)
        assert refused.value.status == 400 and "nested" in refused.value.message


def test_the_log_allows_a_burst_per_cause_then_counts(caplog):
    log = RateLimitedLog(logging.getLogger("test.limits"), burst=2, window_s=10, max_causes=3)
    assert [log.allow("a", now=0)[0] for _ in range(5)] == [True, True, False, False, False]
    assert log.allow("b", now=1) == (True, 0)  # causes are separate
    assert log.allow("a", now=11) == (True, 3)  # a new window reports what was suppressed
    for cause in "cdefg":  # the table stays bounded
        log.allow(cause, now=12)
    assert len(log._causes) == 3


def test_an_engine_traceback_never_reaches_a_client():
    from shoal.runtime.api.errors import engine_unavailable, public_reason

    crashed = 'the engine core failed:\nTraceback (most recent call last):\n  File "/srv/x.py"'
    assert public_reason(crashed) == "the engine core failed (details in the server log)"
    assert "Traceback" not in engine_unavailable(crashed).message
    assert public_reason("the engine core process exited with code 1") \
        == "the engine core process exited with code 1"
