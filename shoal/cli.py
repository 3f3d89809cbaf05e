"""The one console script: ``shoal <subcommand>``.

Each subcommand lives in its own module with two functions: ``register(subparsers)``
(cheap, no heavy imports) and the handler it sets as ``func``, which imports what it
needs. So ``shoal operator`` never imports torch and ``shoal serve`` never imports kopf.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module that registers it (order = order in --help)
SUBCOMMANDS: dict[str, str] = {
    "serve": "shoal.runtime.api.cli",
    "route": "shoal.runtime.router.cli",
    "fleet": "shoal.runtime.router.fleet",
    "operator": "shoal.operator.cli",
    "make-model": "shoal.runtime.model.make_model",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="LLM serving on Kubernetes")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before anything loads OpenMP (torch), for this process and the engine/worker processes
    # it starts: waiting OpenMP threads that spin stall badly when the cores are shared (the
    # API process, other pods). Measured here: a 2-thread matmul loop beside one busy process
    # took 14.8 s spinning vs 3.1 s passive; on idle cores the two were within noise.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
