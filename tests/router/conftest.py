"""Router test helpers: free loopback ports and processes that are always stopped."""

from __future__ import annotations

import socket

import pytest


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_port():
    """free_port(host="127.0.0.1") -> a TCP port nobody listens on right now."""
    return _free_port
