"""Registry of KV connectors: ``--kv-transfer-config``'s ``kv_connector`` picks the class."""

from __future__ import annotations

from epdserve.connectors.kv_connector.base import (
    KVConnectorBase,
    KVConnectorRole,
    KVLayout,
    KVShard,
)
from epdserve.connectors.kv_connector.config import KVTransferConfig
from epdserve.connectors.kv_connector.storage_connector import (
    RedisConnector,
    SharedStorageConnector,
)

KV_CONNECTORS: dict[str, type] = {
    "RedisConnector": RedisConnector,
    "SharedStorageConnector": SharedStorageConnector,
}


def register_connector(name: str, cls: type) -> None:
    """Make ``{"kv_connector": name}`` build ``cls(config, role, layout)`` (and
    ``shard=KVShard(...)`` for a worker side at TP > 1)."""
    KV_CONNECTORS[name] = cls


def create_connector(
    config: KVTransferConfig,
    role: KVConnectorRole,
    layout: KVLayout,
    shard: KVShard | None = None,
) -> KVConnectorBase:
    """``shard``: a tensor-parallel rank's heads and collective (worker side, TP > 1)."""
    cls = KV_CONNECTORS[config.kv_connector]
    return cls(config, role, layout) if shard is None else cls(config, role, layout, shard=shard)
