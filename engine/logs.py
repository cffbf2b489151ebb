"""Logging of engine processes: ``--log-level`` and ``--log-format text|json``, passed to the
engine-core process through the environment so both processes of a pod log alike."""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure the root logger; unset arguments come from ``EPDSERVE_LOG_LEVEL`` /
    ``EPDSERVE_LOG_FORMAT`` (what a pod's engine-core process inherits)."""
    level = (level or os.environ.get("EPDSERVE_LOG_LEVEL") or "info").upper()
    fmt = fmt or os.environ.get("EPDSERVE_LOG_FORMAT") or "text"
    if fmt not in FORMATS:
        raise ValueError(f"log_format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if root.level > logging.DEBUG:  # one line per HTTP call of a client library: debug only
        logging.getLogger("httpx").setLevel(logging.WARNING)
