"""The auth flags the operator renders for spec.auth, run: a real `shoal serve` and `shoal route`
on loopback with exactly the rendered flags, the Secret volume standing in as a directory
holding the same two files."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from shoal.operator.render.auth import AUTH_MOUNT, engine_auth_args, router_auth_args
from shoal.operator.spec.service import parse_spec

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
        1, engine_args=mounted(engine_auth_args(spec), secret_dir),
        router_flags=["--health-interval", "0.2", "--scrape-interval", "0.2",
                      *mounted(router_auth_args(spec), secret_dir)])
    return fleet.config.router_url, fleet.config.engine_urls()[0]


def test_client_keys_work_at_the_router_and_nowhere_else(rendered_fleet):
    router, engine = rendered_fleet
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
    router, engine = rendered_fleet
    for url in (f"{router}/health", f"{router}/ready", f"{engine}/health", f"{engine}/ready"):
        assert httpx.get(url, timeout=10).status_code == 200, url
    assert httpx.get(f"{engine}/metrics", timeout=10).status_code == 401
    for key in CLIENT_KEYS:  # the engine knows only the router's key
        assert httpx.get(f"{engine}/metrics", headers=bearer(key), timeout=10).status_code == 401
    scraped = httpx.get(f"{engine}/metrics", headers=bearer(ROUTER_KEY), timeout=10)
    assert scraped.status_code == 200 and "shoal:num_requests_running" in scraped.text
