"""Builds a pod's KV connector pair and the fingerprint that keeps models apart in the store."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from epdserve.connectors.kv_connector import (
    KVConnectorBase,
    KVConnectorRole,
    KVLayout,
    KVTransferConfig,
    create_connector,
)
from epdserve.connectors.storage import fingerprint
from epdserve.connectors.storage.codec import FORMAT_VERSION, KV_LAYOUT

log = logging.getLogger("epdserve.kv_transfer")

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 * 1024


def weights_digest(model_dir: str) -> str:
    """A cheap content digest of a checkpoint: config.json, and per weight file its size plus
    16 evenly spread 64 KiB samples (fine-tunes of one architecture differ there; reading
    whole multi-GB checkpoints at every start-up would not be cheap)."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=16)
    config = root / "config.json"
    if config.is_file():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for i in range(SAMPLES_PER_FILE):
                f.seek(size * i // SAMPLES_PER_FILE)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def derived_hash_seed(model_dir: str) -> str:
    """The hash seed of a pod given none: every pod serving the same checkpoint derives the
    same one, so hand-started pods that share a store or a router share prefix names."""
    return f"epdserve-model:{weights_digest(os.fspath(model_dir))}"


def model_fingerprint(
    model_dir: str, dtype: str, block_shape: tuple[int, ...], block_size: int, hash_algo: str
) -> str:
    """Identifies model + dtype + layout + block size + hash algorithm + stored format, so
    blocks of other models (or of the same model in another geometry) are never shared, and
    pods of two format versions (a rolling upgrade) never read, refuse and delete each
    other's values."""
    return fingerprint(
        weights_digest(model_dir),
        dtype,
        KV_LAYOUT,
        tuple(block_shape),
        block_size,
        hash_algo,
        f"format-v{FORMAT_VERSION}",
    )


def encoder_fingerprint(model_dir: str, dtype: str) -> str:
    """Identifies the vision encoder's outputs: same weights, same dtype, same format."""
    return fingerprint(
        weights_digest(os.fspath(model_dir)), dtype, f"encoder-output-v{FORMAT_VERSION}"
    )


def create_kv_connectors(
    config, block_shape: tuple[int, ...]
) -> tuple[KVConnectorBase, KVConnectorBase] | None:
    """``(scheduler side, worker side)`` for ``config.kv_transfer_config``, or None."""
    if not config.kv_transfer_config:
        return None
    transfer = KVTransferConfig.from_json(config.kv_transfer_config)
    layout = KVLayout(
        model_fingerprint(
            os.fspath(config.model),
            config.dtype,
            block_shape,
            config.block_size,
            config.prefix_caching_hash_algo,
        ),
        config.block_size,
        config.prefix_caching_hash_algo,
    )
    log.info(
        "KV connector %s (%s), pool %r, fingerprint %s",
        transfer.kv_connector,
        transfer.kv_role,
        transfer.pool,
        layout.fingerprint,
    )
    return (
        create_connector(transfer, KVConnectorRole.SCHEDULER, layout),
        create_connector(transfer, KVConnectorRole.WORKER, layout),
    )


def store_rejections(kv_connectors, ec_connector) -> dict[str, dict[str, int]]:
    """Stored values this pod refused on load (each one deleted), by kind and reason."""
    counts: dict[str, dict[str, int]] = {}
    sources = [("kv_block", c) for c in kv_connectors] + [("encoder_output", ec_connector)]
    for kind, connector in sources:
        rejections = getattr(connector, "rejections", None)  # only storage connectors refuse
        for reason, n in (rejections() if rejections else {}).items():
            bucket = counts.setdefault(kind, {})
            bucket[reason] = bucket.get(reason, 0) + n
    return counts
