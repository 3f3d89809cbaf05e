"""Admission: the bounded queue counts what waits beyond the batch that max_num_seqs AND the
KV cache allow; Retry-After follows the recent completion rate."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from shoal.runtime.api.admission import (
    MAX_RETRY_AFTER_S,
    CompletionRate,
    batch_capacity,
    decide,
    kv_blocks_estimate,
    retry_after,
)


def test_a_footprint_is_the_prompt_plus_half_the_generation_budget():
    assert kv_blocks_estimate(10, 100, 4096, 16) == 4  # 10 + 50 tokens -> 4 blocks
    assert kv_blocks_estimate(10, None, 1034, 16) == 33  # 10 + 1024/2 -> 33 blocks
    assert kv_blocks_estimate(1000, 5000, 1034, 16) == 64  # capped by the room left
    assert kv_blocks_estimate(1, 0, 4096, 16) == 1


def test_the_batch_is_max_num_seqs_while_the_kv_cache_holds_it():
    assert batch_capacity(10, 10 * 4, max_num_seqs=8, num_kv_blocks=1000) == 8
    assert batch_capacity(0, 0, max_num_seqs=8, num_kv_blocks=1000) == 8
    assert batch_capacity(10, 40, max_num_seqs=8, num_kv_blocks=0) == 8  # KV unknown


def test_the_kv_cache_bounds_the_batch_when_requests_are_long():
    # 10 requests of 25 blocks on average, 100 blocks: only 4 run at once
    assert batch_capacity(10, 250, max_num_seqs=256, num_kv_blocks=100) == 4
    # one request bigger than the cache still counts as one running request
    assert batch_capacity(1, 500, max_num_seqs=256, num_kv_blocks=100) == 1


def test_kv_bound_requests_are_refused_where_max_num_seqs_alone_would_queue_them():
    common = dict(max_num_seqs=256, num_kv_blocks=100, max_queued=2, completions_per_s=None)
    # 5 in flight of 25 blocks: batch 4, 1 queued; a 6th makes 2 queued (the limit): admitted
    six = decide(in_flight=5, in_flight_blocks=125, new=1, new_blocks=25, **common)
    assert (six.admit, six.batch, six.queued_after) == (True, 4, 2)
    seventh = decide(in_flight=6, in_flight_blocks=150, new=1, new_blocks=25, **common)
    assert (seventh.admit, seventh.queued_after, seventh.retry_after_s) == (False, 3, 1)
    # short requests (1 block each) in the same cache all run at once
    short = decide(in_flight=6, in_flight_blocks=6, new=1, new_blocks=1, **common)
    assert (short.admit, short.batch, short.queued_after) == (True, 100, 0)


def test_with_ample_kv_the_max_num_seqs_bound_is_unchanged():
    common = dict(max_num_seqs=4, num_kv_blocks=10_000, max_queued=2, completions_per_s=None)
    assert decide(in_flight=5, in_flight_blocks=5, new=1, new_blocks=1, **common).admit
    refused = decide(in_flight=6, in_flight_blocks=6, new=1, new_blocks=1, **common)
    assert (refused.admit, refused.batch, refused.queued_after) == (False, 4, 3)


def test_retry_after_is_the_excess_over_the_completion_rate_clamped():
    assert retry_after(excess=1, completions_per_s=None) == 1
    assert retry_after(excess=1, completions_per_s=4.0) == 1
    assert retry_after(excess=10, completions_per_s=0.5) == 20
    assert retry_after(excess=1000, completions_per_s=0.5) == MAX_RETRY_AFTER_S


def test_the_completion_rate_covers_the_recent_window_only():
    rate = CompletionRate(window_s=10.0)
    assert rate.per_second(100.0) is None
    rate.record(2, now=100.0)
    assert rate.per_second(100.0) == 2.0  # one moment counts as a 1 s span
    rate.record(3, now=104.0)
    assert rate.per_second(105.0) == pytest.approx(5 / 5.0)
    assert rate.per_second(112.0) == pytest.approx(3 / 8.0)  # the first record aged out
    assert rate.per_second(200.0) is None


@pytest.mark.slow
def test_a_server_refuses_what_its_kv_cache_cannot_run_with_retry_after(start_server):
    # 64 blocks of 16 tokens; a 900-token budget means ~29 blocks each: 2 run at once, so
    # with one queue slot the 4th request is refused although max_num_seqs is 256
    server = start_server("--num-kv-blocks", "64", "--max-queued-requests", "1")
    body = {"model": server.model, "prompt": "hold the line", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        holders = [http.stream("POST", "/v1/completions", json=body) for _ in range(3)]
        responses = [h.__enter__() for h in holders]
        try:
            assert [r.status_code for r in responses] == [200, 200, 200]
            # keep the line iterators: a dropped one closes its connection (a hang-up)
            lines = [r.iter_lines() for r in responses]
            assert all(next(it).startswith("data: ") for it in lines)  # generating
            client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError) as refused:
                client.completions.create(model=server.model, prompt="one more",
                                          max_tokens=900)
            assert "KV cache" in refused.value.message
            assert 1 <= int(refused.value.response.headers["retry-after"]) <= MAX_RETRY_AFTER_S
        finally:
            for holder in holders:
                holder.__exit__(None, None, None)
    assert server.get("/ready").status_code == 200
    # once the holders have hung up (and were aborted), the same request is admitted
    deadline = time.monotonic() + 10
    while server.metric("shoal:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    after = client.completions.create(model=server.model, prompt="one more", max_tokens=3)
    assert after.choices[0].finish_reason == "length"
