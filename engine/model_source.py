"""Where a model's files come from: a local directory, or a HuggingFace Hub id resolved to a
snapshot directory of the HF cache (downloaded once, then read offline).

``epdserve download MODEL`` runs :func:`resolve_model` alone; the operator runs it in an init
container so the engine container starts with ``HF_HUB_OFFLINE=1`` on a warm cache. Token and
cache location are huggingface_hub's own: ``HF_TOKEN``, ``HF_HOME`` / ``HF_HUB_CACHE``.
"""

from __future__ import annotations

import argparse
import os
import sys

# What the engine reads: config, tokenizer, chat template, weights, generation and processor
# configs. Other repository files (original/ checkpoints, .bin/.pth/.gguf, docs) are skipped.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt", "*.tiktoken"]
IGNORE_PATTERNS = ["original/*"]


def resolve_model(model: str, revision: str | None = None) -> str:
    """A local directory holding `model`: the directory itself, or the HF cache snapshot of
    the hub id `model` at `revision` (downloaded unless cached). Raises ValueError naming
    `model` when it is neither."""
    if os.path.isdir(model):
        return model
    if model.startswith(("/", ".", "~")):  # a path, never a hub id
        raise ValueError(f"model {model!r}: no such directory")
    from huggingface_hub import constants, errors, snapshot_download

    where = f"model {model!r}" + (f" (revision {revision!r})" if revision else "")
    try:
        return snapshot_download(
            model,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except errors.HFValidationError:
        raise ValueError(
            f"model {model!r}: neither a directory nor a HuggingFace model id (org/name)"
        ) from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"{where}: revision not found on the HuggingFace Hub") from None
    except errors.RepositoryNotFoundError:  # also gated repos without a token
        raise ValueError(
            f"{where}: not found on the HuggingFace Hub, or private/gated "
            "(set HF_TOKEN to a token with access)"
        ) from None
    except errors.LocalEntryNotFoundError:
        raise ValueError(
            f"{where}: not in the HuggingFace cache {constants.HF_HUB_CACHE} and the Hub "
            "cannot be reached (offline: HF_HUB_OFFLINE is set, or no network); "
            "download it first with `epdserve download`"
        ) from None
    except OSError as exc:  # HTTP errors, disk full, permissions on the cache
        raise ValueError(f"{where}: download failed: {exc}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HuggingFace model id (org/name) or a model directory")
    p.add_argument(
        "--revision",
        default=os.environ.get("EPDSERVE_REVISION") or None,
        help="branch, tag or commit of the hub repo (default main); or EPDSERVE_REVISION",
    )
    p.add_argument(
        "--link",
        default=None,
        help="also make this path a symlink to the model directory (a stable path for pods)",
    )


def run(args: argparse.Namespace) -> int:
    """`epdserve download`: resolve (download) the model, print its local directory."""
    try:
        path = resolve_model(args.model, args.revision)
    except ValueError as exc:
        print(f"epdserve download: {exc}", file=sys.stderr)
        return 1
    if args.link:
        tmp = args.link + ".tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.symlink(os.path.abspath(path), tmp)
        os.replace(tmp, args.link)  # atomic: a reader never sees a missing link
    print(path)
    return 0
