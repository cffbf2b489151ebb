"""KV-cache event wire schema, compatible with vLLM's ZMQ KV events.

A PUB message is ``[topic, seq (8-byte big-endian), payload]``. The payload is a msgpack
``EventBatch`` array ``[ts, events, data_parallel_rank]``; each event is a map whose first
key is ``"type"`` and whose default-valued fields are omitted (what vLLM 0.32 sends).
Older vLLM releases sent each event as an array ``["BlockStored", field, ...]``; the
decoder accepts both.
"""

from __future__ import annotations

from typing import Any

import msgspec

UINT64_MASK = (1 << 64) - 1
# ``medium`` values: vLLM names the tier a block lives in ("GPU", "CPU", ...; "GPU" even on a
# CPU run). Blocks a KV connector saved to the pool's shared store (Redis, a shared volume)
# are announced with "STORE": any pod of the pool can load them.
DEVICE_MEDIUM = "GPU"
STORE_MEDIUM = "STORE"
MAX_DIGEST_CHARS = 128  # ``lora_digest`` (ours): the adapter files' digest, hex


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the events; the msgspec tag (``"type"``) is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks newly cached by one request in one step.

    ``token_ids`` is the concatenation of every block's tokens (``block_size`` per hash);
    ``parent_block_hash`` is the hash of the block before the first one (None at a root).

    Blocks of a request with a ``cache_salt`` are sent without tokens and extra keys:
    ``token_ids`` is empty, ``extra_keys`` absent, and ``router_keys`` (our extension; absent,
    so byte-identical to vLLM, on every other event) holds the router's chained key of the
    leading blocks that a router can index (see :mod:`.keys`; image blocks and the blocks after
    them have none).

    ``lora_digest`` (our extension, absent otherwise) is the digest of the adapter's files
    when the blocks were computed: with ``lora_name`` it names the adapter's version.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    router_keys: list[int] | None = None
    lora_digest: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the cache (vLLM sends one hash per event)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every cached block of the pod was dropped (prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --- the older array-like event form (vLLM < 0.10), decode only -----------------------


class _LegacyEvent(msgspec.Struct, array_like=True, tag=True, omit_defaults=True, gc=False):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]
    data_parallel_rank: int | None = None


class _LenientBlockStored(KVCacheEvent, tag="BlockStored"):
    # map form with byte-string hashes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    router_keys: list[int] | None = None
    lora_digest: str | None = None


class _LenientBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _LenientBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_LenientBlockStored | _LenientBlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def hash_to_int(value: int | bytes) -> int:
    """A block hash as vLLM's wire integer: the low 64 bits, unsigned."""
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big")
    return value & UINT64_MASK


class EventDecodeError(ValueError):
    """A payload that is neither a map-form nor an array-form event batch."""


class EventDecoder:
    """Decodes payloads of either form into :class:`EventBatch`; never raises on garbage
    except :class:`EventDecodeError`, so callers count and skip it."""

    def __init__(self) -> None:
        self._fast = msgspec.msgpack.Decoder(EventBatch)
        self._lenient = msgspec.msgpack.Decoder(_LenientBatch)
        self._legacy = msgspec.msgpack.Decoder(_LegacyBatch)

    def decode(self, payload: bytes) -> EventBatch:
        """Decode one payload frame; raises EventDecodeError naming the problem."""
        try:
            batch = self._fast.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            batch = self._slow_decode(payload)
        for event in batch.events:
            if isinstance(event, BlockStored):
                _check_stored(event)
        return batch

    def _slow_decode(self, payload: bytes) -> EventBatch:
        errors = []
        for decoder in (self._lenient, self._legacy):
            try:
                raw = decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                errors.append(str(exc))
                continue
            return EventBatch(raw.ts, [_normalize(e) for e in raw.events], raw.data_parallel_rank)
        raise EventDecodeError("invalid KV event batch: " + " / ".join(errors))


def _check_stored(event: BlockStored) -> None:
    if event.block_size <= 0:
        raise EventDecodeError(f"BlockStored.block_size must be > 0, got {event.block_size}")
    digest = event.lora_digest
    if digest is not None and not (event.lora_name and 0 < len(digest) <= MAX_DIGEST_CHARS):
        raise EventDecodeError(
            f"BlockStored.lora_digest needs a lora_name and 1-{MAX_DIGEST_CHARS} characters"
        )
    if event.router_keys is not None:  # a salted request's blocks: keys instead of tokens
        if event.token_ids or len(event.router_keys) > len(event.block_hashes):
            raise EventDecodeError(
                "BlockStored.router_keys needs empty token_ids and at most one key per block"
            )
        return
    if len(event.token_ids) != len(event.block_hashes) * event.block_size:
        raise EventDecodeError(
            f"BlockStored.token_ids has {len(event.token_ids)} tokens for "
            f"{len(event.block_hashes)} blocks of {event.block_size}"
        )


def _normalize(event: Any) -> KVEvent:
    if isinstance(event, _LenientBlockStored | _LegacyBlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=[hash_to_int(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else hash_to_int(parent),
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            router_keys=getattr(event, "router_keys", None),
            lora_digest=getattr(event, "lora_digest", None),
        )
    if isinstance(event, _LenientBlockRemoved | _LegacyBlockRemoved):
        return BlockRemoved(
            [hash_to_int(h) for h in event.block_hashes], event.medium, event.group_idx
        )
    return AllBlocksCleared()


class EventEncoder:
    """Encodes batches exactly as vLLM 0.32 does (map events, defaults omitted)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        """The msgpack payload frame of one batch."""
        return self._encoder.encode(batch)


def to_wire_event(event: Any) -> KVEvent:
    """Any engine-side event with vLLM's field names (e.g. dataclasses with ``bytes``
    hashes) as the wire struct: hashes as their low 64 bits, absent fields at vLLM's
    values (``medium="GPU"``, ``kv_cache_spec_kind="full_attention"``). An event with
    ``router_keys`` (a salted request's blocks) goes out without its tokens and extra keys."""
    if isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
        return event
    kind = type(event).__name__
    if kind == "BlockStored":
        parent = event.parent_block_hash
        n = len(event.block_hashes)
        salted = getattr(event, "router_keys", None) is not None
        extra = None if salted else getattr(event, "extra_keys", None)
        return BlockStored(
            block_hashes=[hash_to_int(h) for h in event.block_hashes],
            parent_block_hash=None if parent is None else hash_to_int(parent),
            token_ids=[] if salted else list(event.token_ids),
            block_size=event.block_size,
            lora_id=getattr(event, "lora_id", None),
            medium=getattr(event, "medium", "GPU"),
            lora_name=getattr(event, "lora_name", None),
            extra_keys=None if salted else (list(extra) if extra else [None] * n),
            group_idx=getattr(event, "group_idx", 0),
            kv_cache_spec_kind=getattr(event, "kv_cache_spec_kind", "full_attention"),
            router_keys=_salted_keys(event),
            lora_digest=getattr(event, "lora_digest", None),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            [hash_to_int(h) for h in event.block_hashes],
            getattr(event, "medium", "GPU"),
            getattr(event, "group_idx", 0),
        )
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise TypeError(f"not a KV cache event: {kind}")


def _salted_keys(event: Any) -> list[int] | None:
    keys = getattr(event, "router_keys", None)
    return None if keys is None else list(keys)
