"""Root fixtures shared by every test area: model checkpoints built once per machine.

``cached_model`` builds into ``$SHOAL_CACHE_DIR/models`` (default ``~/.cache/shoal``) the
first time and reuses it afterwards, so these fixtures cost seconds only on a fresh machine.
tiny models (< 1M parameters) are for unit tests; ``small_qwen3`` for integration tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def _model(arch: str, size: str) -> Path:
    from shoal.runtime.model.make_model import cached_model

    return cached_model(arch, size, seed=0)


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    """Llama with llama3 rope scaling and a single KV head (TP=2 replicates it)."""
    return _model("llama", "tiny")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    """Qwen2: qkv bias, tied embeddings, 2 KV heads."""
    return _model("qwen2", "tiny")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    """Qwen3: q/k RMSNorm, head_dim (32) independent of hidden/heads (16)."""
    return _model("qwen3", "tiny")


@pytest.fixture(scope="session")
def small_qwen3() -> Path:
    """Qwen3 with ~5.6M parameters: the integration-test model (random weights)."""
    return _model("qwen3", "small")


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_llama: Path, tiny_qwen2: Path, tiny_qwen3: Path) -> dict[str, Path]:
    """arch name -> tiny checkpoint dir, for tests parametrised over every architecture."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}


@pytest.fixture(scope="session")
def tiny_moe_model_dirs() -> dict[str, Path]:
    """Mixture-of-experts tiny checkpoints: qwen3_moe (renormalised top-k), qwen2_moe (gated
    shared expert, a dense layer), mixtral (block_sparse_moe names)."""
    from shoal.runtime.model.make_moe_model import MOE_ARCHS, cached_moe_model

    return {arch: cached_moe_model(arch, "tiny") for arch in MOE_ARCHS}
