"""``shoal fleet``: N engines and one router on loopback, for demos and benchmarks.

The processes are managed by ``fleet.LocalFleet``; this module is the command line.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from shoal.runtime.router.local.fleet import FleetConfig, LocalFleet


def register(subparsers: argparse._SubParsersAction) -> None:
    from shoal.runtime.router.cli import add_router_flags

    parser = subparsers.add_parser(
        "fleet", help="N engines + one router on loopback (demos, benchmarks)",
        description="Start N `shoal serve` engines on 127.0.0.2.. and a `shoal route` router "
                    "on 127.0.0.1; Ctrl-C stops them all.")
    parser.add_argument("--replicas", type=int, default=2, help="number of engines (default 2)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="model dir for every engine (default: shoal serve's default)")
    parser.add_argument("--host", default="127.0.0.1", help="router address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="router port (default 8000)")
    parser.add_argument("--engine-port", type=int, default=8001,
                        help="port of every engine, each on its own 127.0.0.x (default 8001)")
    parser.add_argument("--engine-args", default="",
                        help="extra `shoal serve` flags for every engine, one quoted string")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for engines to become ready (default 600)")
    parser.add_argument("--engine-command", default=None,
                        help="command that starts one engine (default: this Python's "
                             "`-m shoal.cli serve`); --host/--port/--model are appended")
    parser.add_argument("--log-dir", default=None,
                        help="write each child's output to DIR/<name>.log instead of the terminal")
    add_router_flags(parser)
    parser.set_defaults(func=_main)


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    router_args = ["--policy", args.policy, "--block-size", str(args.block_size),
                   "--chars-per-block", str(args.chars_per_block),
                   "--scrape-interval", str(args.scrape_interval),
                   "--health-interval", str(args.health_interval),
                   "--load-factor", str(args.load_factor),
                   "--load-headroom", str(args.load_headroom),
                   "--max-attempts", str(args.max_attempts),
                   "--approx-capacity", str(args.approx_capacity)]
    if args.model_revision:
        router_args += ["--model-revision", args.model_revision]
    tokenizer = args.tokenizer or (args.model if args.kv_events and args.model
                                   and not args.tokenizer_from_engine else None)
    if tokenizer:
        router_args += ["--tokenizer", tokenizer]
    elif args.tokenizer_from_engine or args.kv_events:
        router_args.append("--tokenizer-from-engine")
    return FleetConfig(
        replicas=args.replicas, model=args.model, host=args.host, port=args.port,
        engine_port=args.engine_port, engine_args=shlex.split(args.engine_args),
        router_args=router_args, kv_events=args.kv_events, kv_events_port=args.kv_events_port,
        ready_timeout=args.ready_timeout,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        **({"engine_command": shlex.split(args.engine_command)} if args.engine_command else {}))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _main(args: argparse.Namespace) -> int:
    fleet = LocalFleet(config_from_args(args))
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        fleet.start()  # Ctrl-C or SIGTERM while starting: KeyboardInterrupt, stop() below
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        print(f"fleet ready: router {fleet.config.router_url} -> "
              f"{', '.join(fleet.config.engine_urls())} (Ctrl-C stops all)", flush=True)
        while not stopping:
            exited = fleet.first_exit()
            if exited is not None:
                name = fleet.names.get(exited.pid, str(exited.pid))
                print(f"fleet: {name} exited with {exited.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"shoal fleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        fleet.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m shoal.runtime.router.local.cli``: the same as ``shoal fleet``."""
    parser = argparse.ArgumentParser(prog="shoal")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["fleet", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
