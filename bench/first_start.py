"""How long ``shoal serve`` (the default model) takes to answer ``/ready``, from a cold cache.

Three starts, each in a fresh process and a cache directory of its own (``SHOAL_CACHE_DIR``),
one after another:

- ``fresh, no prebuild``: an empty cache, as a checkout before this change: the default model
  is written and the native CPU kernels compile on the first start;
- ``fresh after make setup``: an empty cache where ``python -m shoal.kernels.native_cpu
  --build`` (the step ``make setup`` and the image build run) has prebuilt the kernels; the
  model is still written on this start;
- ``started before``: the same cache again (model and kernels there);
- ``fresh pod, image prebuilt``: an empty cache (a pod's new emptyDir over /models) with the
  kernels prebuilt by ``--build --into DIR`` (the image build's step) into a separate
  directory named by ``SHOAL_PREBUILT_KERNELS``; the model is still written on this start.

The other rows point ``SHOAL_PREBUILT_KERNELS`` at an empty directory, so they compile or use
the cache exactly as their names say.

Each row also shows the engine core's startup phases from ``/ready`` (the kernels are built
in "loading", where the attention backend is chosen with the model); the rest of the time is the API
process (imports, writing the model on a fresh cache) and the engine's imports.

The machine is shared: the compile in particular stretches with the load, which is printed.

    .venv/bin/python bench/first_start.py [--skip-no-prebuild] [--skip-make-setup]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)


def time_to_ready(cache: Path, prebuilt: Path) -> tuple[float, dict]:
    env = {**os.environ, "SHOAL_CACHE_DIR": str(cache), "SHOAL_PREBUILT_KERNELS": str(prebuilt)}
    port = peers.free_port()
    cmd = [sys.executable, "-m", "shoal.cli", "serve", "--host", "127.0.0.1", "--port",
           str(port), "--log-level", "warning", "--shutdown-timeout", "1"]
    server = peers.ServerProcess("shoal", cmd, port, env, "/ready")
    try:
        server.wait_up(timeout=900)
        with urllib.request.urlopen(server.url + "/ready", timeout=10) as response:
            phases = json.loads(response.read()).get("phase_durations", {})
        return server.startup_seconds, phases
    finally:
        server.stop()


def prebuild(cache: Path, *into: str) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "shoal.kernels.native_cpu", "--build", *into],
                   check=True, env={**os.environ, "SHOAL_CACHE_DIR": str(cache)}, timeout=900)
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-no-prebuild", action="store_true",
                        help="skip the start that compiles the kernels itself")
    parser.add_argument("--skip-make-setup", action="store_true",
                        help="skip the two starts on a cache prebuilt by make setup")
    args = parser.parse_args()
    rows = []
    root = Path(tempfile.mkdtemp(prefix="shoal-first-start-"))
    none = root / "no-prebuilt"  # an empty prebuilt directory: those rows do not use one
    none.mkdir()
    try:
        if not args.skip_no_prebuild:
            load = peers.load_average()
            rows.append(("fresh, no prebuild", *time_to_ready(root / "bare", none), load))
        if not args.skip_make_setup:
            cache = root / "setup"
            load = peers.load_average()
            print(f"prebuild (the make setup step): {prebuild(cache):.1f} s (load {load})",
                  flush=True)
            load = peers.load_average()
            rows.append(("fresh after make setup", *time_to_ready(cache, none), load))
            load = peers.load_average()
            rows.append(("started before", *time_to_ready(cache, none), load))
        image = root / "image-kernels"
        load = peers.load_average()
        seconds = prebuild(root / "build-cache", "--into", str(image))
        print(f"prebuild (the image step, --into): {seconds:.1f} s (load {load})", flush=True)
        load = peers.load_average()
        rows.append(("fresh pod, image prebuilt", *time_to_ready(root / "pod", image), load))
        assert not (root / "pod" / "kernels").exists(), "the pod compiled into its cache"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'start':<26}{'/ready after':>13}  {'load 1/5/15':<16}engine phases (s)")
    for name, seconds, phases, load in rows:
        print(f"{name:<26}{seconds:>11.1f} s  {load:<16}{phases}")
    print("(targets: started before <= 15 s, fresh after make setup <= 60 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
