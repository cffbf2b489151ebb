"""The twins' block gathers copy exactly the blocks named, in the layout promised."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import cross_layer_cache

from epdserve.kernels.gather import block_ids, gather_blocks, gather_head_major


def test_block_ids_clamps_padding_and_keeps_the_first_blocks():
    table = torch.tensor([[3, 4, -1], [5, -1, -1]], dtype=torch.int32)
    assert block_ids(table, None, 2).tolist() == [3, 4, 5, 0]
    assert block_ids(table, torch.tensor([1]), 1).tolist() == [5]


def test_gather_blocks_copies_the_named_blocks_of_a_strided_view():
    _, key_cache, _ = cross_layer_cache(6, 16, 2, 8, torch.float32)
    ids = torch.tensor([4, 1, 4], dtype=torch.int32)
    out = gather_blocks(key_cache, ids, "test")
    assert torch.equal(out, key_cache[ids.long()].reshape(-1, 2, 8))


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "dtype"),
    [(1, 64, torch.bfloat16), (2, 64, torch.bfloat16), (2, 128, torch.bfloat16),
     (4, 64, torch.float32)],  # block gather; gather + transpose; head rows; head rows
)  # fmt: skip
def test_gather_head_major_lays_each_sequence_out_per_kv_head(kv_heads, head_dim, dtype):
    _, key_cache, _ = cross_layer_cache(9, 16, kv_heads, head_dim, dtype)
    ids = torch.tensor([[2, 7, 1], [8, 8, 3]], dtype=torch.int32)
    out = gather_head_major(key_cache, ids.view(-1), 2, "test")
    expected = key_cache[ids.long()].reshape(2, 48, kv_heads, head_dim).transpose(1, 2)
    assert torch.equal(out, expected.reshape(2 * kv_heads, 48, head_dim))


def test_length_groups_keep_similar_lengths_together():
    from epdserve.kernels.decode_ref import length_groups

    seqs = list(range(10, 20))
    blocks = [1, 9, 1, 9, 1, 9, 1, 9, 1, 9]
    groups = length_groups(seqs, blocks)
    assert sorted(map(sorted, groups)) == [[10, 12, 14, 16, 18], [11, 13, 15, 17, 19]]


def test_length_groups_leave_even_or_small_batches_whole_and_in_order():
    from epdserve.kernels.decode_ref import length_groups

    assert length_groups(list(range(10)), [4, 5] * 5) == [list(range(10))]
    assert length_groups([3, 1, 2], [1, 9, 1]) == [[3, 1, 2]]
    assert length_groups([], []) == []
