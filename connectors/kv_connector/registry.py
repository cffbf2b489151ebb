"""Registry of KV connectors: ``--kv-transfer-config``'s ``kv_connector`` picks the class."""

from __future__ import annotations

from epdserve.connectors.kv_connector.base import KVConnectorBase, KVConnectorRole
from epdserve.connectors.kv_connector.config import KVTransferConfig
from epdserve.connectors.kv_connector.storage_connector import (
    KVLayout,
    RedisConnector,
    SharedStorageConnector,
)

KV_CONNECTORS: dict[str, type] = {
    "RedisConnector": RedisConnector,
    "SharedStorageConnector": SharedStorageConnector,
}


def register_connector(name: str, cls: type) -> None:
    """Make ``{"kv_connector": name}`` build ``cls(config, role, layout)``."""
    KV_CONNECTORS[name] = cls


def create_connector(
    config: KVTransferConfig, role: KVConnectorRole, layout: KVLayout
) -> KVConnectorBase:
    return KV_CONNECTORS[config.kv_connector](config, role, layout)
