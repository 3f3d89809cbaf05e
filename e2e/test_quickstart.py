"""The documented walkthroughs, run as written (e2e/quickstart_*.sh), when asked for.

They create their own kind cluster or push images to a registry, so they are opt-in:
SHOAL_E2E_QUICKSTART=1 runs the kind walkthrough, SHOAL_E2E_REGISTRY=<registry> the GPU one
(against the current kube context). Each script also skips by itself without its tools.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(5400)]

HERE = Path(__file__).parent


@pytest.mark.parametrize("script, switch", [
    ("quickstart_kind.sh", "SHOAL_E2E_QUICKSTART"),
    ("quickstart_gpu.sh", "SHOAL_E2E_REGISTRY"),
])
def test_documented_walkthrough(script: str, switch: str) -> None:
    if not os.environ.get(switch):
        pytest.skip(f"set {switch} to run {script}")
    result = subprocess.run(["bash", str(HERE / script)], capture_output=True, text=True,
                            timeout=5000)
    output = result.stdout + result.stderr
    if result.returncode == 0 and result.stdout.startswith("SKIP:"):
        pytest.skip(result.stdout.strip())
    assert result.returncode == 0 and "PASS:" in result.stdout, output[-8000:]
