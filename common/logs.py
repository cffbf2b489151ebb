"""The one logging setup of every epdserve process: engine pods, the router, the operator.

Text lines or one JSON object per line, at a level; quiet by default: the HTTP client's
``HTTP Request: ...`` lines (one per scrape, per pod, per second, and one per proxied
request) only show at debug. Unset arguments come from ``EPDSERVE_LOG_LEVEL`` /
``EPDSERVE_LOG_FORMAT``, which is how a pod's engine-core process logs like its API process.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# loggers that speak once per HTTP exchange: metric scrapes and proxied requests
PER_REQUEST_LOGGERS = ("httpx", "httpcore")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message; ``exc``
    (the traceback) and ``stack`` when there are; ``object`` (namespace/name) for a record
    about one Kubernetes object (kopf's per-object loggers set ``k8s_ref``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict):
            entry["object"] = "/".join(p for p in (ref.get("namespace"), ref.get("name")) if p)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: str | None = None, fmt: str | None = None, stream=None) -> logging.Handler:
    """Send every record at ``level`` or above to ``stream`` (stderr) in ``fmt``.

    Replaces the root logger's handlers, so a uvicorn server must run with
    ``log_config=None`` (its loggers then propagate here). Returns the installed handler."""
    level = level or os.environ.get("EPDSERVE_LOG_LEVEL") or "info"
    fmt = fmt or os.environ.get("EPDSERVE_LOG_FORMAT") or "text"
    if level.lower() not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, got {level!r}")
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = logging.getLevelName(level.upper())
    root.setLevel(numeric)
    quiet = numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING)
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(quiet)
    return handler
