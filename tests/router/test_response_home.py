"""Responses follow-ups through the router and the endpoint picker go to the replica that
stores the conversation (its instance tag is in the response id and on its /ready), and get
a clear 404 when no replica has it any more, or 503 to retry while its replica is not ready."""

from __future__ import annotations

import json

import httpx
from shoal.runtime.router.replicas.pool import Replica
from shoal.runtime.router.replicas.response_home import HomeGone, response_home

from shoal.contract.response_ids import instance_of
from tests.router.conftest import wait_until
from tests.router.epp_client import destination, pick_buffered, start_epp

TAG = "0123456789abcdef"


def body(previous: str | None) -> bytes:
    return json.dumps({"input": "x", "previous_response_id": previous}).encode()


def test_the_home_is_the_replica_with_the_ids_instance_tag():
    replicas = {"http://a": Replica("http://a", ready=True, instance="f" * 16),
                "http://b": Replica("http://b", ready=True, instance=TAG)}
    assert instance_of(f"resp_{TAG}_abc") == TAG
    assert response_home("/v1/responses", body(f"resp_{TAG}_abc"), replicas) == "http://b"
    for no_constraint in (body(None), body("resp_plainhex"), b"[" * 100_000, b"{bad"):
        assert response_home("/v1/responses", no_constraint, replicas) is None
    assert response_home("/v1/chat/completions", body(f"resp_{TAG}_abc"), replicas) is None
    gone = response_home("/v1/responses", body(f"resp_{'e' * 16}_abc"), replicas)
    assert isinstance(gone, HomeGone) and gone.status == 404
    replicas["http://b"].ready = False
    waiting = response_home("/v1/responses", body(f"resp_{TAG}_abc"), replicas)
    assert isinstance(waiting, HomeGone) and waiting.status == 503 and waiting.retry_after_s


def test_follow_ups_through_the_router_reach_the_replica_that_stores_them(fake_fleet):
    fleet = fake_fleet(2, "--policy", "least-load")
    with httpx.Client(timeout=30) as client:
        first = client.post(f"{fleet.router}/v1/responses", json={"input": "hi"}).json()
        for _ in range(6):  # by load alone these would spread over both
            follow = client.post(f"{fleet.router}/v1/responses",
                                 json={"input": "more", "previous_response_id": first["id"]})
            assert follow.status_code == 200 and follow.json()["replica"] == first["replica"]
        gone = client.post(f"{fleet.router}/v1/responses",
                           json={"input": "x", "previous_response_id": f"resp_{'e' * 16}_1"})
        assert gone.status_code == 404
        error = gone.json()["error"]
        assert error["param"] == "previous_response_id" and "gone" in error["message"]
        home = f"http://{first['replica']}"
        fleet.admin(home, ready=False)
        wait_until(lambda: client.post(f"{fleet.router}/v1/responses", json={
            "input": "x", "previous_response_id": first["id"]}).status_code == 503,
            timeout=10, what="home not ready: 503")
        waiting = client.post(f"{fleet.router}/v1/responses",
                              json={"input": "x", "previous_response_id": first["id"]})
        assert int(waiting.headers["retry-after"]) >= 1


def test_the_endpoint_picker_picks_the_home_of_a_follow_up(fake_fleet, spawn, free_port):
    fleet = fake_fleet(2)
    channel = start_epp(spawn, free_port, fleet.engines)
    home = fleet.engines[1]
    tag = httpx.get(f"{home}/ready", timeout=5).json()["instance"]
    for _ in range(4):
        answer, _ = pick_buffered(channel, "/v1/responses",
                                  {"input": "x", "previous_response_id": f"resp_{tag}_1"})
        assert destination(answer)[0] == home.removeprefix("http://")
    gone, _ = pick_buffered(channel, "/v1/responses",
                            {"input": "x", "previous_response_id": f"resp_{'e' * 16}_1"})
    assert gone.immediate_response.status.code == 404
