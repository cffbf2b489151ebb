"""`epdserve operator`: run the InferencePool operator (kopf, standalone)."""

from __future__ import annotations

import argparse
import os
import socket

from epdserve.common.logs import FORMATS, LEVELS, setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `epdserve operator`."""
    env_ns = [n for n in os.environ.get("EPDSERVE_WATCH_NAMESPACES", "").split(",") if n]
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=env_ns,
        help="namespace to watch (repeatable; default: $EPDSERVE_WATCH_NAMESPACES, else all)",
    )
    parser.add_argument(
        "--liveness",
        default=os.environ.get("EPDSERVE_OPERATOR_LIVENESS", "http://0.0.0.0:8080/healthz"),
        help="liveness endpoint URL ('' to disable)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=None,
        help="drift-repair and status interval (default 30 or $EPDSERVE_OPERATOR_RESYNC_SECONDS)",
    )
    parser.add_argument(
        "--log-level", choices=LEVELS, default=None, help="default info or $EPDSERVE_LOG_LEVEL"
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help="text lines, or json: one object per line (default text or $EPDSERVE_LOG_FORMAT)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging (--log-level debug)")


def run(args: argparse.Namespace) -> int:
    """Start the operator; returns when it stops (SIGTERM/SIGINT)."""
    if args.resync_seconds is not None:  # read by main at import
        os.environ["EPDSERVE_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)
    os.environ["EPDSERVE_WATCH_NAMESPACES"] = ",".join(args.namespace)  # for the resync loop
    import kopf

    from epdserve.operator import main  # noqa: F401  (registers the handlers)

    setup_logging("debug" if args.verbose else args.log_level, args.log_format)
    kopf.run(
        standalone=True,
        # kopf's default identity looks the uid up in /etc/passwd, which an image run as an
        # arbitrary non-root uid (the chart's 65532, OpenShift's random ones) need not have.
        identity=f"epdserve-operator@{socket.gethostname()}/{os.getpid()}",
        namespaces=args.namespace,  # empty with clusterwide=True (None crashes kopf)
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0
