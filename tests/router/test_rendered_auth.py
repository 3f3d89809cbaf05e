"""The auth flags the operator renders for spec.auth, run: two real `shoal serve` engines and
`shoal route` on loopback with exactly the rendered flags, the Secret volume standing in as a
directory holding the same two files.

Issue 36 in this deployed shape (client keys at the router; the engines take only the
router's key and the tenant it forwards): a Responses follow-up reaches the replica that
stores its conversation and only for the tenant that made it; hostile bodies get the engines'
400 through the router, never a 500."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from shoal.operator.render.auth import AUTH_MOUNT, engine_auth_args, router_auth_args
from shoal.operator.spec.service import parse_spec
from shoal.runtime.router.policies.request_keys import MAX_JSON_DEPTH

from shoal.contract.response_ids import instance_of

CLIENT_KEYS = ("sk-tenant-a", "sk-tenant-b")
ROUTER_KEY = "sk-router-only"
BODY = {"prompt": "hello", "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def mounted(args: list[str], secret_dir: Path) -> list[str]:
    """The rendered args with the Secret volume's mount point moved to ``secret_dir``."""
    return [a.replace(AUTH_MOUNT, str(secret_dir)) for a in args]


@pytest.fixture(scope="module")
def rendered_fleet(engine_fleet_factory, tmp_path_factory):
    secret_dir = tmp_path_factory.mktemp("secret")
    (secret_dir / "api-keys").write_text("# clients\n" + "\n".join(CLIENT_KEYS) + "\n")
    (secret_dir / "upstream-api-key").write_text(ROUTER_KEY + "\n")
    spec = parse_spec({"model": {"uri": "hf://org/m"},
                       "auth": {"apiKeySecretRef": {"name": "keys"}}})
    fleet = engine_fleet_factory(
        2, engine_args=mounted(engine_auth_args(spec), secret_dir),
        # least-load: new responses spread over both engines, and a follow-up placed by load
        # alone would often miss its home (cache affinity would follow the shared prefix)
        router_flags=["--health-interval", "0.2", "--scrape-interval", "0.2", "--policy",
                      "least-load",
                      *mounted(router_auth_args(spec), secret_dir)])
    return fleet.config.router_url, fleet.config.engine_urls()


def test_client_keys_work_at_the_router_and_nowhere_else(rendered_fleet):
    router, (engine, _) = rendered_fleet
    for headers in ({}, bearer("sk-wrong"), bearer(ROUTER_KEY)):
        r = httpx.post(f"{router}/v1/completions", json=BODY, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
    for key in CLIENT_KEYS:
        r = httpx.post(f"{router}/v1/completions", json=BODY, headers=bearer(key), timeout=60)
        assert r.status_code == 200, r.text
        # straight at the engine pod a client key is refused, so no client can name a
        # tenant there (the header is trusted only with the router's key)
        r = httpx.post(f"{engine}/v1/completions", json=BODY, timeout=30,
                       headers={**bearer(key), "x-shoal-tenant": "key-someone-else"})
        assert r.status_code == 401, r.text


def test_probes_need_no_key_and_engine_metrics_on_the_serving_port_do(rendered_fleet):
    """Prefix-cache counters are a cross-tenant oracle: with keys, the serving port's
    /metrics takes the router's key (the operator and Prometheus read --metrics-port)."""
    router, (engine, _) = rendered_fleet
    for url in (f"{router}/health", f"{router}/ready", f"{engine}/health", f"{engine}/ready"):
        assert httpx.get(url, timeout=10).status_code == 200, url
    assert httpx.get(f"{engine}/metrics", timeout=10).status_code == 401
    for key in CLIENT_KEYS:  # the engine knows only the router's key
        assert httpx.get(f"{engine}/metrics", headers=bearer(key), timeout=10).status_code == 401
    scraped = httpx.get(f"{engine}/metrics", headers=bearer(ROUTER_KEY), timeout=10)
    assert scraped.status_code == 200 and "shoal:num_requests_running" in scraped.text


def create(router: str, key: str, **body) -> httpx.Response:
    return httpx.post(f"{router}/v1/responses", headers=bearer(key), timeout=60,
                      json={"max_output_tokens": 2, **body})


def test_responses_follow_ups_reach_their_replica_and_only_their_tenant(rendered_fleet):
    """One stored response on each engine (the router spreads new ones by load); each is
    continued through the router several times: by load alone about half would land on the
    engine that does not store it and get 404. Another client key gets the 404 of an id
    that never existed; the owner still continues."""
    router, engines = rendered_fleet
    home_of = {httpx.get(f"{e}/ready", timeout=10).json()["instance"]: e for e in engines}
    assert len(home_of) == 2
    stored: dict[str, str] = {}  # engine -> a response id it stores
    for i in range(12):
        first = create(router, CLIENT_KEYS[0], input=f"Hello number {i}")
        assert first.status_code == 200, first.text
        stored.setdefault(home_of[instance_of(first.json()["id"])], first.json()["id"])
        if len(stored) == 2:
            break
    assert len(stored) == 2, "the router placed every new response on one engine"
    for response_id in stored.values():  # in a row: load's rotation alternates engines
        for _ in range(3):
            follow = create(router, CLIENT_KEYS[0], input="go on",
                            previous_response_id=response_id)
            assert follow.status_code == 200, follow.text
            assert instance_of(follow.json()["id"]) == instance_of(response_id)
    for response_id in stored.values():
        other = create(router, CLIENT_KEYS[1], input="mine now",
                       previous_response_id=response_id)
        assert other.status_code == 404, other.text
        assert other.json()["error"]["param"] == "previous_response_id"
    missing = create(router, CLIENT_KEYS[1], input="x", previous_response_id="resp_nothing")
    assert missing.status_code == 404
    # the same answer as for an id that never existed: nothing tells "someone else's" apart
    assert other.json()["error"]["message"] == missing.json()["error"]["message"].replace(
        "resp_nothing", response_id)


DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_CHAT = (b'{"messages": [{"role": "user", "content": '
             + b"[" * 100_000 + b"]" * 100_000 + b"}]}")
HUGE_IDS = b'{"prompt": [1, 2, 99999999999999999999999999], "max_tokens": 1}'


def test_hostile_bodies_get_the_engines_400_through_the_router(rendered_fleet):
    """100k-deep JSON (past the router's keying depth, MAX_JSON_DEPTH) and token ids beyond
    int64: the router keys what it can and forwards the rest; the engine answers 400."""
    assert MAX_JSON_DEPTH < 100_000
    router, engines = rendered_fleet
    headers = {**bearer(CLIENT_KEYS[0]), "content-type": "application/json"}
    with httpx.Client(timeout=60) as client:
        for path, body in (("/v1/completions", DEEP), ("/v1/chat/completions", DEEP),
                           ("/v1/chat/completions", DEEP_CHAT), ("/v1/completions", HUGE_IDS),
                           ("/v1/responses", DEEP)):
            answer = client.post(f"{router}{path}", content=body, headers=headers)
            assert answer.status_code == 400, (path, body[:40], answer.status_code,
                                               answer.text[:300])
            assert answer.json()["error"]["type"] == "BadRequestError", answer.text[:300]
        for engine in engines:
            assert client.get(f"{engine}/health").status_code == 200
        good = client.post(f"{router}/v1/completions", json=BODY, headers=bearer(CLIENT_KEYS[0]))
        assert good.status_code == 200, good.text
