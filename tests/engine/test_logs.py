"""Engine logging: text or one JSON object per line, level and format from flags or env."""

from __future__ import annotations

import json
import logging

import pytest

from epdserve.engine.logs import setup_logging


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:], root.level = handlers, level


def test_json_lines_carry_time_level_logger_message_and_exception(restore_root, capsys):
    setup_logging("info", "json")
    log = logging.getLogger("epdserve.test")
    log.debug("not shown")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("request %s failed", "r1")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["level"] == "ERROR" and entry["logger"] == "epdserve.test"
    assert entry["message"] == "request r1 failed" and "ValueError: boom" in entry["exc"]
    assert entry["time"].endswith("+00:00")


def test_the_core_process_reads_level_and_format_from_the_environment(restore_root, monkeypatch):
    monkeypatch.setenv("EPDSERVE_LOG_LEVEL", "warning")
    monkeypatch.setenv("EPDSERVE_LOG_FORMAT", "json")
    setup_logging()
    assert restore_root.level == logging.WARNING
    assert type(restore_root.handlers[0].formatter).__name__ == "JsonFormatter"


def test_an_unknown_format_is_refused(restore_root):
    with pytest.raises(ValueError, match="log_format"):
        setup_logging("info", "xml")
