"""`shoal route` flags: what the operator renders parses, and bad combinations fail clearly."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from shoal.runtime.router.cli import config_from_args, register
from shoal.runtime.router.config import RouterConfig
from shoal.runtime.router.proxy.wiring import build_router


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["route", *argv])


def test_operator_style_flags_parse_into_a_config():
    config = config_from_args(parse(
        "--host", "0.0.0.0", "--port", "8080", "--policy", "cache-affinity",
        "--discovery", "kubernetes", "--namespace", "ml", "--service", "chat-engine",
        "--engine-port", "8000", "--block-size", "32", "--kv-events", "--kv-events-port", "5600"))
    assert (config.discovery, config.namespace, config.service) == ("kubernetes", "ml",
                                                                    "chat-engine")
    assert (config.engine_port, config.block_size, config.kv_events_port) == (8000, 32, 5600)
    assert config.kv_events and config.policy == "cache-affinity"
    approx = config_from_args(parse("--backend", "http://a:1", "--approx-capacity", "64"))
    assert build_router(approx).policy.indexes == {}  # type: ignore[attr-defined]
    assert approx.approx_capacity == 64 and not approx.kv_events


@pytest.mark.parametrize("config,message", [
    (RouterConfig(), "--backend"),
    (RouterConfig(discovery="kubernetes"), "--service"),
    (RouterConfig(backends=["http://a:1"], policy="round-robin", kv_events=True), "kv-events"),
    (RouterConfig(backends=["http://a:1"], max_attempts=0), "max-attempts"),
    (RouterConfig(backends=["http://a:1"], approx_capacity=0), "approx-capacity"),
])
def test_bad_combinations_are_rejected(config, message):
    with pytest.raises(ValueError, match=message):
        build_router(config)


def test_route_without_backends_exits_with_a_message():
    result = subprocess.run([sys.executable, "-m", "shoal.runtime.router.cli"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--backend" in result.stderr
