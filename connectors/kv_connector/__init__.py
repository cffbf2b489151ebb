"""KV connectors (DESIGN.md §4): move KV blocks between pods through a shared store.

``KVTransferConfig.parse(text)`` parses ``--kv-transfer-config`` (once, at the edge);
``create_connector(config, role, layout)`` builds the scheduler- or worker-side instance.
"""

from epdserve.connectors.kv_connector.base import (
    BlockTransfer,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVLayout,
    KVRequest,
    KVShard,
    ScheduledRequest,
)
from epdserve.connectors.kv_connector.config import KV_ROLES, KVTransferConfig
from epdserve.connectors.kv_connector.registry import (
    KV_CONNECTORS,
    create_connector,
    register_connector,
)
from epdserve.connectors.kv_connector.storage_connector import (
    RedisConnector,
    SharedStorageConnector,
    StorageConnector,
)

__all__ = [
    "KV_CONNECTORS",
    "KV_ROLES",
    "BlockTransfer",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVLayout",
    "KVRequest",
    "KVShard",
    "KVTransferConfig",
    "RedisConnector",
    "ScheduledRequest",
    "SharedStorageConnector",
    "StorageConnector",
    "create_connector",
    "register_connector",
]
