"""The endpoint picker's accounting and budgets, against a real `shoal route --epp` process
in front of a fake engine: one pick per stream (a stream sending several gives back all it
took), a body budget over all streams, a cap on open streams, a deadline for the request to
arrive, gRPC taking any body the body limit allows, and the memory of bodies given back to
the OS once the streams that sent them have ended."""

from __future__ import annotations

import json
import time

import psutil

from tests.router import epp_client as envoy
from tests.router.conftest import wait_until


def small() -> dict:
    return {"prompt": "hello there", "max_tokens": 1}


def test_a_stream_sending_several_picks_counts_once_and_gives_capacity_back(
        fake_fleet, spawn, free_port):
    fleet = fake_fleet(1)
    channel = envoy.start_epp(spawn, free_port, fleet.engines, "--epp-shed-limit", "2")
    for _ in range(3):  # each stream asks for five picks, then ends
        stream = envoy.EnvoyStream(channel)
        first = None
        for _ in range(5):
            stream.send(envoy.headers_message("/v1/models", end_of_stream=True))
            answer = stream.recv()
            assert answer.HasField("request_headers"), answer
            first = first or envoy.destination(answer)
            assert envoy.destination(answer) == first  # the same pick, not a new one
        stream.close()
    # all released: two requests can be open at once again (a leak would shed the first)
    held = []
    for _ in range(2):
        answer, stream = envoy.pick_buffered(channel, "/v1/completions", small(), keep_open=True)
        if not answer.HasField("request_body"):  # the release may lag the close a moment
            wait_until(lambda: envoy.pick_buffered(channel, "/v1/completions", small())[0]
                       .HasField("request_body"), timeout=10, what="capacity back")
            answer, stream = envoy.pick_buffered(channel, "/v1/completions", small(), keep_open=True)
        assert answer.HasField("request_body"), answer
        held.append(stream)
    shed, _ = envoy.pick_buffered(channel, "/v1/completions", small())
    assert shed.immediate_response.status.code == 429  # the shed limit itself still holds
    for stream in held:
        stream.close()


def test_buffered_bodies_share_one_budget_and_get_it_back(fake_fleet, spawn, free_port):
    fleet = fake_fleet(1)
    channel = envoy.start_epp(spawn, free_port, fleet.engines, "--epp-max-buffered-bytes",
                        str(1 << 20))
    part = b"x" * (700 << 10)
    first = envoy.EnvoyStream(channel)  # STREAMED: chunks arrive, the pick waits for the last
    first.send(envoy.headers_message("/v1/completions", end_of_stream=False, mode=envoy.Mode.STREAMED))
    assert first.recv().HasField("request_headers")
    first.send(envoy.body_message(part, end_of_stream=False))
    assert first.recv().HasField("request_body")
    second = envoy.EnvoyStream(channel)
    second.send(envoy.headers_message("/v1/completions", end_of_stream=False, mode=envoy.Mode.STREAMED))
    assert second.recv().HasField("request_headers")
    second.send(envoy.body_message(part, end_of_stream=False))
    refused = second.recv()
    assert refused.immediate_response.status.code == 503
    assert "retry-after" in {h.header.key for h in refused.immediate_response.headers.set_headers}
    second.close()
    first.close()  # its 700 KiB go back: the next body fits
    wait_until(lambda: envoy.pick_buffered(channel, "/v1/completions",
                                     {"prompt": "y" * (700 << 10), "max_tokens": 1})[0]
               .HasField("request_body"), timeout=10, what="budget back")


def test_a_body_over_grpcs_default_4_mib_cap_is_picked(fake_fleet, spawn, free_port):
    fleet = fake_fleet(1)
    channel = envoy.start_epp(spawn, free_port, fleet.engines)
    answer, _ = envoy.pick_buffered(channel, "/v1/completions",
                              {"prompt": "z" * (6 << 20), "max_tokens": 1})
    assert answer.HasField("request_body"), answer
    stream = envoy.EnvoyStream(channel)  # over the 16 MiB body limit in two chunks: 413
    stream.send(envoy.headers_message("/v1/completions", end_of_stream=False, mode=envoy.Mode.STREAMED))
    assert stream.recv().HasField("request_headers")
    stream.send(envoy.body_message(b"z" * (9 << 20), end_of_stream=False))
    assert stream.recv().HasField("request_body")
    stream.send(envoy.body_message(b"z" * (9 << 20), end_of_stream=True))
    assert stream.recv().immediate_response.status.code == 413
    stream.close()


def test_streams_are_capped_and_a_silent_stream_times_out(fake_fleet, spawn, free_port):
    fleet = fake_fleet(1)
    channel = envoy.start_epp(spawn, free_port, fleet.engines, "--epp-max-streams", "1",
                        "--epp-body-timeout", "1")
    silent = envoy.EnvoyStream(channel)
    silent.send(envoy.headers_message("/v1/completions", end_of_stream=False, mode=envoy.Mode.BUFFERED))
    assert silent.recv().HasField("request_headers")
    other = envoy.EnvoyStream(channel)
    other.send(envoy.headers_message("/v1/models", end_of_stream=True))
    busy = other.recv()
    other.close()
    assert busy.immediate_response.status.code == 503
    started = time.monotonic()
    late = silent.recv()  # the body never comes: 408 once the deadline passes
    assert late.immediate_response.status.code == 408
    assert "within 1 s" in json.loads(late.immediate_response.body)["error"]["message"]
    assert time.monotonic() - started < 10
    silent.close()
    answer, _ = envoy.pick_buffered(channel, "/v1/completions", small())  # the slot is free again
    assert answer.HasField("request_body")


def epp_process() -> psutil.Process:
    for child in psutil.Process().children(recursive=True):
        if "--epp" in child.cmdline():
            return child
    raise AssertionError("no endpoint picker process")


def test_the_memory_of_buffered_bodies_goes_back_when_the_streams_end(
        fake_fleet, spawn, free_port):
    """The red team's 40 streams of 15 MiB left the picker 290 MiB larger for good; with the
    budget in place it still kept ~500 MiB (freed bodies in malloc's arenas, chunks held by
    cancelled streams' frames until a garbage collection). Bursts of 16 streams sending
    4 MiB chunks against a 48 MiB budget (most are refused 503 partway), each ended by the
    client: after each, the resident size returns to near where it started."""
    fleet = fake_fleet(1)
    channel = envoy.start_epp(spawn, free_port, fleet.engines, "--epp-max-buffered-bytes",
                              str(48 << 20))
    epp = epp_process()
    warm, _ = envoy.pick_buffered(channel, "/v1/completions",
                                  {"prompt": "w" * (6 << 20), "max_tokens": 1})
    assert warm.HasField("request_body")
    time.sleep(2)
    start = epp.memory_info().rss
    chunk = b"x" * (4 << 20)
    for burst in range(2):
        streams, refused = [], 0
        for _ in range(16):
            stream = envoy.EnvoyStream(channel)
            stream.send(envoy.headers_message("/v1/completions", end_of_stream=False,
                                              mode=envoy.Mode.STREAMED))
            assert stream.recv().HasField("request_headers")
            for _ in range(3):
                stream.send(envoy.body_message(chunk, end_of_stream=False))
                answer = stream.recv()
                if answer.HasField("immediate_response"):
                    assert answer.immediate_response.status.code == 503
                    refused += 1
                    break
            streams.append(stream)
        assert refused >= 8, refused  # the budget held: 16 x 12 MiB offered, 48 MiB taken
        peak = epp.memory_info().rss
        for stream in streams:
            stream.close()
        wait_until(lambda: epp.memory_info().rss < start + (40 << 20), timeout=20,
                   what=f"burst {burst}: RSS back from {peak >> 20} MiB near the "
                        f"{start >> 20} MiB it started at")
    answer, _ = envoy.pick_buffered(channel, "/v1/completions", small())
    assert answer.HasField("request_body")  # and the budget is whole again
