"""`python -m shoal.operator` = `shoal operator` (works without the other subcommands)."""

from __future__ import annotations

import argparse
import sys

from shoal.operator.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shoal")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(["operator", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
