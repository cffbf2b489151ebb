"""Checks for features other components have not shipped yet: a scenario that needs one
skips with the reason, and starts running on its own once the feature lands."""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _router_flags() -> set[str]:
    from epdserve.router import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return {flag for action in parser._actions for flag in action.option_strings}


def _discovery_reads_roles() -> bool:
    """Whether k8s discovery splits a pool's pods by their `epdserve.io/role` label."""
    from epdserve.router import cli, discovery

    return any("epdserve.io/role" in inspect.getsource(m) for m in (cli, discovery))


def pd_routing_gap() -> str | None:
    """None when the router can run a prefill/decode pool found by k8s discovery."""
    if any("prefill" in flag or "decode" in flag for flag in _router_flags()):
        if _discovery_reads_roles():
            return None
        return (
            "router has P/D flags but its k8s discovery ignores the epdserve.io/role label, "
            "so an operator-made P/D pool cannot be routed"
        )
    return (
        "router has no P/D mode: `epdserve router` has no --prefill-*/--decode-* option and "
        "its k8s discovery ignores the epdserve.io/role label (it would treat prefill pods "
        "as colocated)"
    )


def encoder_role_gap() -> str | None:
    """None when `epdserve serve --role encoder` exists and the router routes E/P/D."""
    done = subprocess.run(
        [str(BIN / "epdserve"), "serve", "/nonexistent-model", "--role", "encoder"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "not available" in done.stderr + done.stdout:
        return "--role encoder not implemented yet (`epdserve serve --role encoder` refuses)"
    if not any("encoder" in flag for flag in _router_flags()) and not _discovery_reads_roles():
        return "router has no E/P/D mode (no encoder routing, roles not read from k8s labels)"
    return None
