"""`shoal operator`: run the InferenceService operator (kopf). Never imports torch."""

from __future__ import annotations

import argparse
import logging

from shoal.operator.names import ENGINE_METRICS_PORT


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "operator", help="run the Kubernetes operator for InferenceService objects",
        description="Reconciles serving.shoal.dev InferenceServices into engine and router "
                    "Deployments, gates pod readiness on /ready and reports status.")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="namespace to watch (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (the default)")
    parser.add_argument("--kubeconfig", help="kubeconfig file, or several joined with ':' "
                        "(merged like kubectl does); default: in-cluster credentials, then "
                        "$KUBECONFIG, then ~/.kube/config. Exec credential plugins are run.")
    parser.add_argument("--context", help="kubeconfig context (default: current-context)")
    parser.add_argument("--server", help="API server URL without auth (development and tests)")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="seconds between reconcile rounds of one object (default 5)")
    parser.add_argument("--engine-port", type=int, default=ENGINE_METRICS_PORT,
                        help="port of the engines' /ready and /metrics: their --metrics-port, "
                             f"which needs no API key (default {ENGINE_METRICS_PORT})")
    parser.add_argument("--probe-timeout", type=float, default=2.0,
                        help="seconds to wait for an engine's /ready or /metrics (default 2)")
    parser.add_argument("--liveness", metavar="URL",
                        help="serve the operator's own health check, e.g. http://0.0.0.0:8081/healthz")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the operator's own Prometheus metrics on this port")
    parser.add_argument("--peering", metavar="NAME",
                        help="kopf peering object for high availability (default: standalone)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=run_operator)


def run_operator(args: argparse.Namespace) -> int:
    import asyncio

    import kopf
    from shoal.operator.kube.credentials import CredentialsError, load_credentials
    from shoal.operator.loop.handlers import OperatorOptions, build_registry

    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.interval <= 0 or args.probe_timeout <= 0:
        raise SystemExit("shoal operator: --interval and --probe-timeout must be > 0")
    if args.metrics_port is not None and not 0 < args.metrics_port < 65536:
        raise SystemExit("shoal operator: --metrics-port must be a TCP port (1-65535)")
    try:
        credentials = asyncio.run(load_credentials(
            server=args.server, kubeconfig=args.kubeconfig, context=args.context))
    except CredentialsError as exc:
        raise SystemExit(f"shoal operator: {exc}") from exc
    logging.getLogger("shoal.operator").info("API server %s (%s)",
                                             credentials.configuration.host,
                                             credentials.description)
    options = OperatorOptions(credentials=credentials, interval=args.interval,
                              engine_port=args.engine_port, probe_timeout=args.probe_timeout,
                              metrics_port=args.metrics_port)
    kopf.run(
        registry=build_registry(options),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    return 0
