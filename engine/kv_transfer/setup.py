"""Resolves what a pod names blocks and stored values by (checkpoint digest, hash seed), once
at start, and builds its KV connector pair and encoder-cache connector from the typed config."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

from epdserve.connectors.ec_connector import ECConnector, create_ec_connector
from epdserve.connectors.storage import fingerprint
from epdserve.connectors.storage.codec import FORMAT_VERSION
from epdserve.connectors.storage.kv_codec import KV_FORMAT_VERSION, KV_LAYOUT
from epdserve.engine.config import EngineConfig

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


def resolve_identity(config: EngineConfig) -> EngineConfig:
    """The config with what a pod names its blocks and stored values by, resolved once at
    start: ``model_digest`` (read from the checkpoint only when a store or a derived seed needs
    it) and ``hash_seed``. Without ``--hash-seed``, a pod whose blocks are named to others (a KV
    connector or KV events) derives one every pod of this checkpoint derives alike, so
    hand-started pods that share a store or a router share prefix names; else it stays None
    (random). Already resolved: returned as is."""
    if config.model_digest is not None:
        return config
    names_blocks = config.kv_transfer_config is not None or config.enable_kv_events
    derive_seed = config.hash_seed is None and names_blocks
    if not (derive_seed or config.kv_transfer_config or config.ec_transfer_config):
        return config
    digest = weights_digest(os.fspath(config.model))
    seed = config.hash_seed
    if derive_seed:
        seed = f"epdserve-model:{digest}"
        log.info("hash seed derived from the checkpoint (%s); --hash-seed chooses one", seed)
    return replace(config, model_digest=digest, hash_seed=seed)


def model_fingerprint(
    digest: str, dtype: str, block_shape: tuple[int, ...], block_size: int, hash_algo: str
) -> str:
    """Identifies model (its ``weights_digest``) + dtype + layout + block size + hash
    algorithm + stored format, so blocks of other models (or of the same model in another
    geometry) are never shared, and pods of two format versions (a rolling upgrade) never
    read, refuse and delete each other's values. ``block_shape`` is the whole model's (every
    KV head): pods of any tensor-parallel size share one fingerprint."""
    return fingerprint(
        digest,
        dtype,
        KV_LAYOUT,
        tuple(block_shape),
        block_size,
        hash_algo,
        f"format-v{KV_FORMAT_VERSION}",
    )


def encoder_fingerprint(digest: str, dtype: str) -> str:
    """Identifies the vision encoder's outputs: same weights, same dtype, same format."""
    return fingerprint(digest, dtype, f"encoder-output-v{FORMAT_VERSION}")


def create_encoder_connector(config: EngineConfig) -> ECConnector | None:
    """The encoder-cache connector of ``config.ec_transfer_config``, or None; the config is
    resolved (``resolve_identity``)."""
    if config.ec_transfer_config is None:
        return None
    return create_ec_connector(
        config.ec_transfer_config, encoder_fingerprint(config.model_digest, config.dtype)
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
