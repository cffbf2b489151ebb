"""``epdserve bench NAME [ARGS...]``: run ``bench/NAME.py`` of a source checkout."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = sorted(f.stem for f in BENCH_DIR.glob("*.py")) if BENCH_DIR.is_dir() else []
    p.add_argument("name", help=f"one of: {', '.join(names) or '(none: not a source checkout)'}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")


def run(args: argparse.Namespace) -> int:
    script = BENCH_DIR / f"{args.name}.py"
    if not script.is_file():
        print(f"epdserve bench: no benchmark {args.name!r} in {BENCH_DIR}", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.args])
