"""``shoal route``: the cache-affinity router in front of a fleet of engines.

The operator renders the router Deployment with these flags; keep them stable.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shoal.runtime.http_listener import add_listener_flags

from shoal.contract.kv import DEFAULT_BLOCK_SIZE
from shoal.contract.policies import DEFAULT_ROUTING_POLICY, ROUTING_POLICIES

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _default_namespace() -> str:
    if SA_NAMESPACE.exists():
        return SA_NAMESPACE.read_text().strip() or "default"
    return os.environ.get("POD_NAMESPACE", "default")


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    """Routing flags shared by ``shoal route`` and ``shoal fleet``."""
    parser.add_argument("--policy", choices=ROUTING_POLICIES, default=DEFAULT_ROUTING_POLICY,
                        help="routing policy (default: cache-affinity)")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="model dir with the engines' tokenizer: token-precise affinity "
                             "(engine block hashes) instead of the text-prefix approximation")
    parser.add_argument("--tokenizer-from-engine", action="store_true",
                        help="token-precise affinity with the tokenizer and chat template "
                             "fetched from the first ready engine (GET /tokenizer): exactly "
                             "what the engines encode with, no model files in the router")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="the engines' KV block size in tokens (default "
                             f"{DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--model-revision", default="",
                        help="the engines' --model-revision (part of every block hash)")
    parser.add_argument("--cache-sharing", default="tenant", choices=["tenant", "global"],
                        help="the engines' --cache-sharing: with tenant (the default) the "
                             "precise keys of an authenticated request are salted by its "
                             "tenant, as the engines salt its blocks")
    parser.add_argument("--chars-per-block", type=int, default=64,
                        help="approximate mode: characters per prefix block (default 64)")
    parser.add_argument("--kv-events", action="store_true",
                        help="precise mode: subscribe to each engine's KV-cache events at "
                             "tcp://<engine host>:<--kv-events-port>")
    parser.add_argument("--kv-events-port", type=int, default=5557,
                        help="port of the engines' --kv-events-endpoint (default 5557)")
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="seconds between scrapes of each engine's /metrics (default 1)")
    parser.add_argument("--health-interval", type=float, default=1.0,
                        help="seconds between /ready polls of each engine (default 1)")
    parser.add_argument("--load-factor", type=float, default=1.25,
                        help="bounded load: no replica takes a request that puts its "
                             "in-flight count above this x the mean (default 1.25) ...")
    parser.add_argument("--load-headroom", type=float, default=2.0, metavar="REQUESTS",
                        help="... or above the mean + the larger of this many requests and "
                             "3 standard deviations of an even random spread, whichever is "
                             "larger: chance imbalance at moderate concurrency keeps its "
                             "affinity (default 2)")
    parser.add_argument("--approx-capacity", type=int, default=50_000, metavar="BLOCKS",
                        help="approximate mode: prefix blocks remembered per replica (LRU); "
                             "near the engines' cache size, the router forgets what they "
                             "evict (default 50000)")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="replicas tried per request before its first byte (default 3)")


def add_security_flags(parser: argparse.ArgumentParser) -> None:
    """Edge authentication, exposure, timeouts and listener limits of ``shoal route``."""
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help="a key clients must send as a Bearer token on /v1/* "
                             "(repeatable); 401 otherwise. Each key is its own tenant, "
                             "sent to the engines as x-shoal-tenant")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="file with more keys, one per line (# comments)")
    parser.add_argument("--upstream-api-key", default=None, metavar="KEY",
                        help="the router's own Bearer key towards the engines (their "
                             "--api-key); client Authorization headers are never forwarded "
                             "when this or --api-key is set")
    parser.add_argument("--upstream-api-key-file", default=None, metavar="PATH",
                        help="file holding --upstream-api-key (its first key line), so the "
                             "key is in no process argument")
    parser.add_argument("--enable-debug", action="store_true",
                        help="serve /debug/blocks (the router's block view; behind "
                             "--api-key); off by default: block hashes confirm prompts")
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to connect to a replica (then the next one is tried)")
    parser.add_argument("--first-byte-timeout", type=float, default=300.0,
                        help="seconds a replica may take to send its response headers "
                             "(a non-streaming answer sends them at its end); 504 after")
    parser.add_argument("--idle-timeout", type=float, default=60.0,
                        help="seconds a replica may send nothing in the middle of an answer")
    parser.add_argument("--stream-stall-timeout", type=float, default=30.0,
                        help="seconds a client may read nothing before its connection is "
                             "dropped; 0: never")
    parser.add_argument("--quarantine-window", type=float, default=60.0,
                        help="seconds a request that failed on a replica is held to that "
                             "replica (never replayed on another); 0: off")
    add_listener_flags(parser)
    parser.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                        help="larger bodies get 413 before they are read")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "route", help="cache-affinity router (OpenAI-compatible reverse proxy)",
        description="Route OpenAI requests to engine replicas: prefix-cache affinity with "
                    "bounded load, health-aware, streaming pass-through.")
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=None,
                        help="listen port (default 8000; 9002 with --epp, the inference "
                             "extension's ext_proc port)")
    parser.add_argument("--epp", action="store_true",
                        help="serve as a Gateway API Inference Extension Endpoint Picker (Envoy "
                             "ext_proc over gRPC, plus gRPC health) instead of proxying")
    parser.add_argument("--epp-shed-limit", type=int, default=None, metavar="N",
                        help="--epp: answer 429 when every ready endpoint has N or more "
                             "requests open or waiting (default: never shed)")
    parser.add_argument("--epp-max-streams", type=int, default=1024, metavar="N",
                        help="--epp: ext_proc streams open at once; one more is answered 503 "
                             "with Retry-After (default 1024)")
    parser.add_argument("--epp-max-buffered-bytes", type=int, default=256 << 20,
                        metavar="BYTES",
                        help="--epp: request bodies all streams may buffer together for "
                             "their picks; past it 503 with Retry-After (default 256 MiB)")
    parser.add_argument("--epp-body-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="--epp: a stream's request must arrive (headers and body) "
                             "within this, else 408 (default 30)")
    parser.add_argument("--epp-metrics-port", type=int, default=None, metavar="PORT",
                        help="--epp: serve the picker's Prometheus /metrics over HTTP on this "
                             "port of --host (the inference extension's is 9090): P/D "
                             "decisions and each pool's queue and KV usage by role "
                             "(default: none)")
    parser.add_argument("--backend", action="append", default=[], metavar="URL",
                        help="engine base URL, e.g. http://10.0.0.5:8000 (repeatable; "
                             "static discovery)")
    parser.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                        help="static (--backend) or kubernetes (the engine Service's "
                             "EndpointSlices, watched)")
    parser.add_argument("--namespace", default=None,
                        help="kubernetes: namespace of the engine Service (default: the pod's)")
    parser.add_argument("--service", default="", help="kubernetes: engine Service name")
    parser.add_argument("--engine-port", type=int, default=None,
                        help="kubernetes: engine port (default: the slice's 'http' port)")
    parser.add_argument("--engine-metrics-port", type=int, default=None, metavar="PORT",
                        help="scrape the engines' /metrics on this port (their "
                             "--metrics-port, no API key needed) instead of the serving port")
    parser.add_argument("--kube-api", default=None, metavar="URL",
                        help="kubernetes API URL when not running in a pod")
    parser.add_argument("--hold-timeout", type=float, default=0.0, metavar="SECONDS",
                        help="scale from zero: hold a request that finds no ready replica "
                             "up to this long, then 503 with Retry-After (default 0: 503 at "
                             "once)")
    parser.add_argument("--hold-queue", type=int, default=256, metavar="N",
                        help="requests held at most while no replica is ready; more get 503 "
                             "(default 256)")
    parser.add_argument("--hold-queue-bytes", type=int, default=256 << 20, metavar="BYTES",
                        help="scale from zero: request bodies the held requests may keep "
                             "together; one more is answered 503 at once (default 256 MiB)")
    parser.add_argument("--capacity-request", default="", metavar="NAME",
                        help="kubernetes: annotate InferenceService NAME (in --namespace) "
                             "to ask the operator for a replica while requests are held, and, "
                             "with --prefill-backend, for a prefill replica when a prompt "
                             "wanted one and none was ready")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    add_router_flags(parser)
    parser.add_argument("--prefill-backend", action="append", default=[], metavar="URL",
                        help="P/D disaggregation: a prefill engine (repeatable; engines with "
                             "--kv-transfer-config). The decode replica is chosen first; a "
                             "prefill engine computes the prompt when more than --pd-threshold "
                             "of its tokens are not cached there")
    parser.add_argument("--prefill-service", default="", metavar="NAME",
                        help="P/D disaggregation: the prefill engines are the ready endpoints "
                             "of this Service (EndpointSlices in --namespace, its port named "
                             "http), each pod by its own IP; with --pd-sidecar, the hosts the "
                             "picker's x-prefiller-host-port may name (as llm-d's sidecar)")
    parser.add_argument("--pd-threshold", type=int, default=256, metavar="TOKENS",
                        help="uncached prompt tokens above which a prefill engine computes "
                             "the prompt (default 256)")
    parser.add_argument("--pd-sidecar", action="store_true",
                        help="the decode side of --epp's P/D (llm-d's routing sidecar): in "
                             "front of one decode engine (--backend), run the prefill leg on "
                             "the engine the picker names in x-prefiller-host-port, one of "
                             "--prefill-backend or a --prefill-service pod; no header: the "
                             "engine computes the prompt")
    add_security_flags(parser)
    parser.set_defaults(func=_main)


def config_from_args(args: argparse.Namespace):  # -> RouterConfig
    from shoal.runtime.router.config import RouterConfig

    return RouterConfig(
        policy=args.policy, backends=list(args.backend), discovery=args.discovery,
        namespace=args.namespace or _default_namespace(), service=args.service,
        engine_port=args.engine_port, engine_metrics_port=args.engine_metrics_port,
        kube_api=args.kube_api, tokenizer=args.tokenizer,
        tokenizer_from_engine=args.tokenizer_from_engine,
        block_size=args.block_size, model_revision=args.model_revision,
        chars_per_block=args.chars_per_block, cache_sharing=args.cache_sharing,
        kv_events=args.kv_events,
        kv_events_port=args.kv_events_port, health_interval=args.health_interval,
        scrape_interval=args.scrape_interval, load_factor=args.load_factor,
        load_headroom=args.load_headroom,
        max_attempts=args.max_attempts, approx_capacity=args.approx_capacity,
        hold_timeout=args.hold_timeout, hold_queue=args.hold_queue,
        hold_queue_bytes=args.hold_queue_bytes,
        capacity_request=args.capacity_request,
        api_keys=list(args.api_key), api_key_file=args.api_key_file,
        upstream_api_key=args.upstream_api_key,
        upstream_api_key_file=args.upstream_api_key_file, enable_debug=args.enable_debug,
        connect_timeout=args.connect_timeout, first_byte_timeout=args.first_byte_timeout,
        idle_timeout=args.idle_timeout, stream_stall_timeout=args.stream_stall_timeout,
        quarantine_window=args.quarantine_window,
        # shoal route's own (shoal fleet starts no prefill engines)
        prefill_backends=list(getattr(args, "prefill_backend", [])),
        prefill_service=getattr(args, "prefill_service", ""),
        pd_threshold=getattr(args, "pd_threshold", RouterConfig.pd_threshold),
        pd_sidecar=getattr(args, "pd_sidecar", False))


def _main(args: argparse.Namespace) -> int:
    import logging

    import uvicorn
    from shoal.runtime.http_listener import ListenerLimits, uvicorn_config
    from shoal.runtime.router.proxy.wiring import build_router

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request
    from shoal.runtime.heap import keep_large_blocks_mapped

    keep_large_blocks_mapped()  # request bodies go back to the OS when freed (heap.py)
    if args.epp:
        if args.pd_sidecar:
            raise SystemExit("shoal route: --pd-sidecar runs on the decode side, not in --epp")
        return _serve_epp(args)
    limits = ListenerLimits(max_connections=args.max_connections,
                            max_header_bytes=args.max_header_bytes,
                            max_body_bytes=args.max_request_body_bytes)
    try:
        limits.validate()
        app = build_router(config_from_args(args))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"shoal route: {exc}") from exc
    uvicorn.Server(uvicorn_config(app, args.host, args.port or 8000, limits, "warning",
                                  lifespan="on")).run()
    return 0


def _serve_epp(args: argparse.Namespace) -> int:
    import asyncio

    from shoal.runtime.router.epp.app import serve_epp
    from shoal.runtime.router.epp.server import EppLimits

    if args.epp_shed_limit is not None and args.epp_shed_limit < 1:
        raise SystemExit("shoal route: --epp-shed-limit must be >= 1")
    host = f"[{args.host}]" if ":" in args.host else args.host
    try:
        limits = EppLimits(max_body_bytes=args.max_request_body_bytes,
                           max_buffered_bytes=args.epp_max_buffered_bytes,
                           max_streams=args.epp_max_streams,
                           body_timeout_s=args.epp_body_timeout)
        asyncio.run(serve_epp(config_from_args(args), f"{host}:{args.port or 9002}",
                              args.epp_shed_limit, limits, args.epp_metrics_port))
    except (ValueError, OSError, RuntimeError) as exc:
        raise SystemExit(f"shoal route --epp: {exc}") from exc
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m shoal.runtime.router.cli``: the same as ``shoal route``."""
    parser = argparse.ArgumentParser(prog="shoal")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["route", *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
