"""Engine-area fixtures: a minimal KV sequence for block-manager tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from shoal.runtime.kv.block_hash import ExtraKeys


@dataclass
class Seq:
    req_id: str
    all_token_ids: list[int]
    block_hashes: list[int] = field(default_factory=list)
    extra_digest: bytes = ExtraKeys().digest()


@pytest.fixture
def make_seq():
    def make(req_id: str, tokens: list[int], salt: str | None = None) -> Seq:
        return Seq(req_id, list(tokens), extra_digest=ExtraKeys(cache_salt=salt).digest())

    return make
