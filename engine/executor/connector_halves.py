"""Which half of each connector lives on which side of the executor: the core builds the
scheduler halves, every worker its own worker halves, from the same resolved config (so both
name blocks and stored values by the same fingerprint)."""

from __future__ import annotations

import logging

from epdserve.connectors.ec_connector import ECConnector, ECConnectorScheduler
from epdserve.connectors.kv_connector import (
    KVConnectorBase,
    KVConnectorRole,
    KVLayout,
    KVShard,
    create_connector,
)
from epdserve.connectors.storage import HeadSlice
from epdserve.engine.config import EngineConfig
from epdserve.engine.kv_transfer.setup import create_encoder_connector, model_fingerprint
from epdserve.engine.models.config import ModelConfig
from epdserve.engine.models.layers import Shard

log = logging.getLogger("epdserve.kv_transfer")


def kv_block_shape(config: EngineConfig, model_cfg: ModelConfig) -> tuple[int, ...]:
    """One stored block: every layer's K and V of ``block_size`` tokens, of every KV head of
    the model (whatever the TP: the fingerprint must not depend on it)."""
    return (model_cfg.num_layers, 2, config.block_size, model_cfg.num_kv_heads, model_cfg.head_dim)


def kv_dtype_label(config: EngineConfig) -> str:
    """The dtypes a stored block depends on: the model's, and the cache's where it differs
    (``--kv-cache-dtype fp8``), so pods that store blocks in another dtype never share them."""
    kv = config.kv_storage_dtype
    return config.dtype if kv == config.dtype else f"{config.dtype}/kv-{kv}"


def kv_head_slice(num_kv_heads: int, rank: int, size: int) -> HeadSlice:
    """The KV heads rank ``rank`` of ``size`` holds (``Shard.kv_heads``), and whether it stores
    them: with more ranks than KV heads, only the first rank of each head's replicas does."""
    first, count = Shard(rank, size).kv_heads(num_kv_heads)
    writes = size <= num_kv_heads or rank % (size // num_kv_heads) == 0
    return HeadSlice(first, count, writes, rank, size)


def kv_connector_half(
    config: EngineConfig, model_cfg: ModelConfig, role: KVConnectorRole, tp=None
) -> KVConnectorBase | None:
    """The ``role`` half of ``config.kv_transfer_config``'s connector, or None; the config is
    resolved (``resolve_identity``). ``tp``: a worker's ``TPGroup`` (its rank's heads and the
    collective the ranks agree on transfers with); None: one rank holding every head."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return None
    algo = config.prefix_caching_hash_algo
    shape = kv_block_shape(config, model_cfg)
    fp = model_fingerprint(
        config.model_digest, kv_dtype_label(config), shape, config.block_size, algo
    )
    if role == KVConnectorRole.SCHEDULER:  # once per pod
        log.info(
            "KV connector %s (%s), pool %r, fingerprint %s",
            transfer.kv_connector,
            transfer.kv_role,
            transfer.pool,
            fp,
        )
    heads, tp_size = model_cfg.num_kv_heads, config.tensor_parallel_size
    layout = KVLayout(fp, config.block_size, algo, heads, max(1, heads // tp_size))
    shard = None
    if tp is not None and tp.size > 1:
        heads = kv_head_slice(model_cfg.num_kv_heads, tp.rank, tp.size)
        shard = KVShard(heads, tp.all_reduce)
    return create_connector(transfer, role, layout, shard)


def encoder_connector_scheduler(config: EngineConfig) -> ECConnectorScheduler | None:
    """The encoder-cache connector's scheduler half (no store), or None."""
    if config.ec_transfer_config is None:
        return None
    return ECConnectorScheduler(config.ec_transfer_config)


def encoder_connector_worker(config: EngineConfig) -> ECConnector | None:
    """The encoder-cache connector's worker half (it loads and saves outputs), or None."""
    return create_encoder_connector(config)
