"""Stored KV blocks across tensor-parallel shapes (DESIGN.md §10, "KV layout"): each rank of a
TP 2 pod writes its half of the KV heads as a value of its own, in parallel, and a TP 1 pod
reads both; each rank of a TP 2 pod finds its heads in a TP 1 pod's whole-block value; heads
replicated past their count (TP 4) are stored once; a block with a part missing is a miss for
every reader; what a reader refuses is counted; and lookups find any cut, their own first."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from epdserve.connectors.kv_connector.store_lookup import Found, look_up, part_sizes
from epdserve.connectors.storage import (
    KVBlockIO,
    KVBlockMeta,
    SharedStorageBlockStore,
    SharedStorageConfig,
)
from epdserve.engine.executor.connector_halves import kv_head_slice

HEADS, BS = 2, 4
META = KVBlockMeta("fp-slices", BS, "sha256_cbor", HEADS)
FULL = (8, 2, 2, BS, HEADS, 8)  # [blocks, layers, 2, block_size, kv heads, head dim]
HASHES = [bytes([i]) * 32 for i in range(1, 4)]
IDS = [1, 2, 3]


@pytest.fixture
def store(tmp_path):
    s = SharedStorageBlockStore(SharedStorageConfig(str(tmp_path / "kv")))
    yield s
    s.close()


def rank_io(store, rank: int, size: int, meta=META, staging=None) -> KVBlockIO:
    heads = kv_head_slice(meta.num_kv_heads, rank, size)
    return KVBlockIO(store, "pool", meta, staging=staging, heads=heads)


def rank_cache(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s paged cache: its KV heads of the whole model's."""
    heads = kv_head_slice(HEADS, rank, size)
    return full[..., heads.first : heads.first + heads.count, :].clone()


def header(store, key: str) -> dict:
    with open(store.path_of(key), "rb") as f:
        data = f.read()
    (size,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + size])


# staged: the pinned-host path a device cache takes, run on CPU
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_tp2_pods_ranks_write_their_halves_and_a_tp1_pod_reads_both(store, staged):
    full = torch.randn(FULL)
    for rank in (0, 1):
        io = rank_io(store, rank, 2, staging=staged)
        assert io.save(rank_cache(full, rank, 2), IDS, HASHES) == [True] * 3
    assert store.stats.puts == 6  # one value per block and rank
    key = rank_io(store, 1, 2).key(HASHES[0])
    assert key.endswith("@h1+1")
    stored = header(store, key)
    assert stored["__metadata__"]["kv_heads"] == "1+1" and stored["__metadata__"]["tp"] == "1/2"
    assert stored["__metadata__"]["num_kv_heads"] == "2" and stored["kv"]["shape"] == [
        2,
        2,
        BS,
        1,
        8,
    ]
    reader = rank_io(store, 0, 1, staging=staged)
    assert reader.count_cached_prefix(HASHES) == 0  # not cut as a TP 1 pod cuts them ...
    assert reader.count_cached_prefix(HASHES, part_heads=1) == 3  # ... but all there
    dest = torch.zeros(FULL)
    assert reader.load(dest, [5, 6, 7], HASHES, part_heads=1) == [True] * 3
    assert torch.equal(dest[5:8], full[1:4]) and dest[:5].count_nonzero() == 0


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_each_rank_of_a_tp2_pod_takes_its_heads_from_a_tp1_pods_whole_blocks(store, staged):
    full = torch.randn(FULL)
    assert rank_io(store, 0, 1).save(full, IDS, HASHES) == [True] * 3
    assert store.stats.puts == 3 and rank_io(store, 0, 1).key(HASHES[0]).endswith(HASHES[0].hex())
    for rank in (0, 1):
        dest = torch.zeros(rank_cache(full, rank, 2).shape)
        gets = store.stats.gets
        io = rank_io(store, rank, 2, staging=staged)
        assert io.load(dest, IDS, HASHES, part_heads=2) == [True] * 3
        assert store.stats.gets - gets == 3  # the one whole-block value per block
        assert torch.equal(dest[1:4], rank_cache(full, rank, 2)[1:4])


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_a_partial_tail_block_moves_its_tokens_only(store, staged):
    full = torch.randn(FULL)
    for rank in (0, 1):
        io = rank_io(store, rank, 2, staging=staged)
        assert io.save(rank_cache(full, rank, 2), IDS, HASHES, tail_tokens=3) == [True] * 3
    [value] = store.get_many([rank_io(store, 0, 2).key(HASHES[2])])
    assert b'"shape":[2,2,3,1,8]' in value  # the tail's 3 tokens, not the block's 4
    dest = torch.zeros(FULL)
    reader = rank_io(store, 0, 1, staging=staged)
    assert reader.load(dest, [5, 6, 7], HASHES, tail_tokens=3, part_heads=1) == [True] * 3
    assert torch.equal(dest[5:7], full[1:3])
    assert torch.equal(dest[7, :, :, :3], full[3, :, :, :3])
    assert dest[7, :, :, 3:].count_nonzero() == 0  # the slots past the tail stay untouched


def test_replicated_heads_are_stored_once_and_every_replica_loads_them(store):
    assert [kv_head_slice(HEADS, r, 4).writes for r in range(4)] == [True, False, True, False]
    assert [kv_head_slice(HEADS, r, 4).first for r in range(4)] == [0, 0, 1, 1]
    full = torch.randn(FULL)
    for rank in range(4):
        assert rank_io(store, rank, 4).save(rank_cache(full, rank, 4), IDS, HASHES) == [True] * 3
    assert store.stats.puts == 2 * 3  # each head once per block
    for rank, size in [(r, 4) for r in range(4)] + [(0, 2), (1, 2)]:
        dest = torch.zeros(rank_cache(full, rank, size).shape)
        assert rank_io(store, rank, size).load(dest, IDS, HASHES, part_heads=1) == [True] * 3
        assert torch.equal(dest[1:4], rank_cache(full, rank, size)[1:4])


def test_a_block_with_a_part_missing_is_a_miss_and_its_slot_stays_untouched(store):
    full = torch.randn(FULL)
    rank_io(store, 0, 2).save(rank_cache(full, 0, 2), IDS, HASHES)  # rank 1 saved block 0 only
    rank_io(store, 1, 2).save(rank_cache(full, 1, 2), IDS[:1], HASHES[:1])
    reader = rank_io(store, 0, 1)
    assert reader.count_cached_prefix(HASHES, part_heads=1) == 1
    dest = torch.zeros(FULL)
    assert reader.load(dest, IDS, HASHES, part_heads=1) == [True, False, False]
    assert dest[2:].count_nonzero() == 0
    assert (reader.stats.loaded, reader.stats.misses, reader.stats.rejected) == (1, 2, 0)
    # the rank holding head 0 alone finds its values: agreeing with rank 1 is the worker
    # side's job (tests/pd/test_kv_rank_agreement.py)
    assert rank_io(store, 0, 2).load(rank_cache(full, 0, 2), IDS, HASHES) == [True] * 3


@pytest.mark.parametrize(
    "shape, dtype", [((8, 2, 2, BS, 1, 4), torch.float32), ((8, 2, 2, BS, 1, 8), torch.bfloat16)]
)
def test_a_value_of_another_head_size_or_dtype_is_a_counted_miss(store, shape, dtype):
    rank_io(store, 0, 1).save(torch.randn(FULL), IDS, HASHES)
    reader = rank_io(store, 1, 2)
    assert reader.load(torch.zeros(shape, dtype=dtype), IDS, HASHES, part_heads=2) == [False] * 3
    assert reader.rejections.snapshot() == {"dtype_shape": 3}
    assert store.exists_many([reader.key(h, 0, 2) for h in HASHES]) == [False] * 3  # deleted


def test_a_value_naming_another_slice_or_head_count_is_refused(store):
    full = torch.randn(FULL)
    for rank in (0, 1):
        rank_io(store, rank, 2).save(rank_cache(full, rank, 2), IDS[:1], HASHES[:1])
    io = rank_io(store, 0, 1)
    # head 1's value copied under head 0's key: the key check refuses it first
    [value] = store.get_many([io.key(HASHES[0], 1, 1)])
    store.put_many([(io.key(HASHES[0], 0, 1), value)])
    assert io.load(torch.zeros(FULL), IDS[:1], HASHES[:1], part_heads=1) == [False]
    four = KVBlockMeta("fp-slices", BS, "sha256_cbor", 4)  # a 4-head model, same fingerprint
    KVBlockIO(store, "pool", four).save(torch.randn(8, 2, 2, BS, 4, 8), IDS[1:2], HASHES[1:2])
    assert io.load(torch.zeros(FULL), IDS[1:2], HASHES[1:2]) == [False]
    assert io.rejections.snapshot() == {"key": 1, "metadata": 1}


def test_a_lookup_tries_its_own_cut_first_and_then_every_other_in_one_more_round_trip(store):
    full = torch.randn(FULL)
    for rank in (0, 1):  # blocks 0-1 by a TP 2 pod ...
        rank_io(store, rank, 2).save(rank_cache(full, rank, 2), IDS[:2], HASHES[:2])
    rank_io(store, 0, 1).save(full, IDS[:1], HASHES[:1])  # ... block 0 by a TP 1 pod too
    assert part_sizes(8) == [8, 4, 2, 1]
    tp1 = rank_io(store, 0, 1)
    calls = []
    real = store.exists_many
    store.exists_many = lambda keys: calls.append(len(keys)) or real(keys)
    assert look_up(tp1, HASHES[:1], own=2) == Found(1, 2)  # its own: one round trip
    assert calls == [1]
    assert look_up(tp1, HASHES, own=2) == Found(2, 1)  # the TP 2 cut runs longer
    # own (3 blocks x 1 value), the other cut's block 1 (2 values), then its chain (3 x 2)
    assert calls == [1, 3, 2, 6]
    assert look_up(tp1, [bytes(32)] * 2, own=2) == Found(0, 2) and calls[4:] == [2, 2]


def test_every_tp_shape_names_blocks_by_the_same_fingerprint(models, tmp_path):
    from epdserve.connectors.kv_connector import KVConnectorRole
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.executor.connector_halves import kv_connector_half
    from epdserve.engine.kv_transfer.setup import resolve_identity
    from epdserve.engine.models.config import load_model_config

    path = str(models.get("llama"))
    transfer = {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}
    transfer["kv_connector_extra_config"] = {"path": str(tmp_path)}
    layouts = {}
    for tp, dtype in ((1, "float32"), (2, "float32"), (4, "float32"), (1, "bfloat16")):
        cfg = resolve_identity(
            EngineConfig(
                model=path,
                dtype=dtype,
                tensor_parallel_size=tp,
                kv_transfer_config=json.dumps(transfer),
            )
        )
        half = kv_connector_half(cfg, load_model_config(path), KVConnectorRole.SCHEDULER)
        layouts[tp, dtype] = half.layout
        half.close()
    fingerprints = {layouts[tp, "float32"].fingerprint for tp in (1, 2, 4)}
    assert len(fingerprints) == 1 and layouts[1, "float32"].num_kv_heads == 2
    assert [layouts[tp, "float32"].value_heads for tp in (1, 2, 4)] == [2, 1, 1]
    assert layouts[1, "bfloat16"].fingerprint not in fingerprints  # another dtype: a miss
