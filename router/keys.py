"""The router's chained block keys; they live in :mod:`epdserve.connectors.kv_events.keys`
(engines compute them too, for salted blocks) and are re-exported here."""

from epdserve.connectors.kv_events.keys import (
    chain_keys,
    extend_keys,
    first_block_salt,
    request_keys,
    root_key,
    token_bytes,
    without_lora,
)

__all__ = [
    "chain_keys",
    "extend_keys",
    "first_block_salt",
    "request_keys",
    "root_key",
    "token_bytes",
    "without_lora",
]
