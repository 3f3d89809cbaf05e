"""The one console script: ``shoal <subcommand>``.

Each subcommand lives in its own module with two functions: ``register(subparsers)`` and the
handler it sets as ``func``, which imports what it needs. Only the chosen subcommand's module is
imported: ``shoal operator`` loads neither torch nor the router's numpy/xxhash (the operator
image installs none of them), and ``shoal serve`` never imports kopf.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module that registers it, its one-line help); order = order in --help.
# The help is repeated here so that `shoal --help` imports no subcommand (a test keeps the two
# in step).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("shoal.runtime.api.cli", "serve a model over the OpenAI API"),
    "route": ("shoal.runtime.router.cli",
              "cache-affinity router (OpenAI-compatible reverse proxy)"),
    "fleet": ("shoal.runtime.router.local.cli",
              "N engines + one router on loopback (demos, benchmarks)"),
    "operator": ("shoal.operator.cli", "run the Kubernetes operator for InferenceService objects"),
    "make-model": ("shoal.runtime.model.make_model",
                   "write an HF-format checkpoint with random weights and a tokenizer"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand's full parser, or with `only`, that one's and a one-line entry for the
    others (their modules not imported)."""
    parser = argparse.ArgumentParser(prog="shoal", description="LLM serving on Kubernetes")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for name, (module_name, summary) in SUBCOMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module_name).register(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


# An OpenMP thread that finds no work spins this many times before it sleeps (libgomp; the
# default is 300,000, and 0 under OMP_WAIT_POLICY=PASSIVE). Long spins stall when the cores
# are shared (the API process, other pods): a 2-thread matmul loop beside one busy process
# took 14.8 s spinning vs 3.1 s passive. Never spinning costs a sleep and a wake-up per
# parallel region, about 80 per model step: `shoal serve`, 1 stream, 15 ms per token
# passive vs 9-10 ms at 20,000 spins, 16-128 streams within noise of each other
# (bench/serve_load.py, same run, 2 cores).
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "20000"}


def chosen_command(argv: list[str]) -> str:
    """The subcommand named on the command line ('' for none, e.g. `shoal --help`)."""
    first = next((a for a in argv if not a.startswith("-")), "")
    return first if first in SUBCOMMANDS else ""


def main(argv: list[str] | None = None) -> int:
    # Before anything loads OpenMP (torch), for this process and the engine/worker processes
    # it starts (see OPENMP_DEFAULTS).
    for name, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(only=chosen_command(argv)).parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
