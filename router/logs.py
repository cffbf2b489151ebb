"""The router's logging: quiet by default, as text or as one JSON object per line.

At INFO the router logs what changes (pods added, removed, unhealthy; hash-seed
mismatches) and never one line per request or per metrics scrape: httpx's
``HTTP Request: ...`` lines (one per scrape, per pod, per second, and one per proxied
request) only show at ``--log-level debug``, and uvicorn's access log only with
``--access-log``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# loggers that speak once per HTTP exchange: the scrapes and the proxied requests
PER_REQUEST_LOGGERS = ("httpx", "httpcore")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message
    (plus ``exc``, the traceback, when there is one: the engine pods write the same keys)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Send every record at ``level`` or above to ``stream`` (stderr) in ``fmt``.

    Replaces the root logger's handlers, so uvicorn must run with ``log_config=None``
    (its loggers then propagate here). Returns the installed handler."""
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
