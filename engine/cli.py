"""The ``epdserve`` console script.

Every subcommand's implementation is imported only when that subcommand runs, so
``epdserve router`` and ``epdserve operator`` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module defining add_arguments(parser) and run(args), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("epdserve.engine.entrypoints.serve_cli", "run an engine pod (OpenAI server)"),
    "router": ("epdserve.router.cli", "run the cache-aware OpenAI gateway"),
    "operator": ("epdserve.operator.cli", "run the InferencePool kopf operator"),
    "up": ("epdserve.engine.entrypoints.up_cli", "run a whole pool locally (no cluster)"),
    "download": ("epdserve.engine.model_source", "fetch a HuggingFace model into the HF cache"),
    "make-model": ("epdserve.engine.make_model", "write a tiny random HF checkpoint"),
    "bench": ("epdserve.engine.entrypoints.bench_cli", "run a benchmark from bench/"),
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            return None  # the subcommand is not part of this build
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="epdserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)

    # Only the chosen subcommand's module is imported, and only now.
    if argv and argv[0] in SUBCOMMANDS:
        name = argv[0]
        module = _load(SUBCOMMANDS[name][0])
        if module is None:
            print(f"epdserve {name}: not available in this build yet", file=sys.stderr)
            return 2
        sub_parser = argparse.ArgumentParser(
            prog=f"epdserve {name}", description=SUBCOMMANDS[name][1]
        )
        module.add_arguments(sub_parser)
        return int(module.run(sub_parser.parse_args(argv[1:])) or 0)

    args = parser.parse_args(argv)  # exits 2 with a message on an unknown command
    if args.version:
        from epdserve import __version__

        print(__version__)
        return 0
    parser.print_help()
    return 0 if not argv else 2


if __name__ == "__main__":
    sys.exit(main())
