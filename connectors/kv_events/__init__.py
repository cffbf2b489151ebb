"""KV-cache events: the vLLM-compatible wire schema, its codec, config and publishers.

Torch-free: the router imports this package.
"""

from epdserve.connectors.kv_events.config import KVEventsConfig, bind_address, binds
from epdserve.connectors.kv_events.curve import (
    CURVE_DIR_ENV,
    CurveClientKeys,
    CurveKeyError,
    CurveServerKeys,
)
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
    "CURVE_DIR_ENV",
    "DEVICE_MEDIUM",
    "STORE_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CurveClientKeys",
    "CurveKeyError",
    "CurveServerKeys",
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
    "bind_address",
    "binds",
    "create_publisher",
    "hash_to_int",
    "to_wire_event",
]
