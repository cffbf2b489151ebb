"""KV-cache events: the vLLM-compatible wire schema, its codec, config and publishers.

Torch-free: the router imports this package.
"""

from epdserve.connectors.kv_events.config import KVEventsConfig, binds
from epdserve.connectors.kv_events.publisher import (
    EventPublisher,
    NullEventPublisher,
    PublisherStats,
    ZmqEventPublisher,
    create_publisher,
)
from epdserve.connectors.kv_events.schema import (
    DEVICE_MEDIUM,
    STORE_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    KVEvent,
    hash_to_int,
    to_wire_event,
)

__all__ = [
    "DEVICE_MEDIUM",
    "STORE_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventDecodeError",
    "EventDecoder",
    "EventEncoder",
    "EventPublisher",
    "KVEvent",
    "KVEventsConfig",
    "NullEventPublisher",
    "PublisherStats",
    "ZmqEventPublisher",
    "binds",
    "create_publisher",
    "hash_to_int",
    "to_wire_event",
]
