"""The ``epdserve`` console script: help, version, unknown commands."""

from __future__ import annotations

import subprocess
import sys


def epdserve(*args):
    code = "import sys; from epdserve.engine.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def test_help_lists_every_subcommand():
    result = epdserve("--help")
    assert result.returncode == 0
    for name in ("serve", "router", "operator", "up", "make-model", "bench"):
        assert name in result.stdout


def test_version_prints_the_package_version():
    from epdserve import __version__

    result = epdserve("--version")
    assert result.returncode == 0 and result.stdout.strip() == __version__


def test_unknown_subcommand_exits_nonzero_with_a_message():
    result = epdserve("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr and "frobnicate" in result.stderr


def test_make_model_rejects_an_unknown_arch():
    result = epdserve("make-model", "--arch", "gpt9", "--out", "/nonexistent")
    assert result.returncode == 2 and "gpt9" in result.stderr
