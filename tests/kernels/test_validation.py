"""Bad arguments raise ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch
from kernels_testlib import make_batch

from epdserve.kernels import (
    paged_attention_ref,
    reshape_and_cache_ref,
    rms_norm_ref,
    rotary_embedding_ref,
)


def attention_args(**changes):
    batch = make_batch([(1, 5), (3, 9)], 4, 2, 16, 16)
    args = dict(zip(["query", "key_cache", "value_cache", "block_table", "seq_lens",
                     "query_start_loc"], batch.args(), strict=True))  # fmt: skip
    return args | {"scale": 0.25} | changes


@pytest.mark.parametrize(
    ("change", "name"),
    [
        (lambda a: {"query": a["query"][:, :3]}, "kv heads"),
        (lambda a: {"query": a["query"].to(torch.float64)}, "query"),
        (lambda a: {"query": a["query"].half()}, "query"),
        (lambda a: {"seq_lens": a["seq_lens"].float()}, "seq_lens"),
        (lambda a: {"query_start_loc": a["query_start_loc"][:2]}, "query_start_loc"),
        (lambda a: {"block_table": a["block_table"][:1]}, "block_table"),
        (lambda a: {"value_cache": a["value_cache"][:, :8]}, "value_cache"),
        (
            lambda a: {
                "key_cache": a["key_cache"][..., :8],
                "value_cache": a["value_cache"][..., :8],
            },
            "head_dim",
        ),
        (lambda a: {"sliding_window": 0}, "sliding_window"),
        (lambda a: {"soft_cap": -1.0}, "soft_cap"),
        (lambda a: {"seq_lens": torch.tensor([5, 2], dtype=torch.int32)}, "seq_lens"),
        (lambda a: {"seq_lens": torch.tensor([5, 99], dtype=torch.int32)}, "block_table"),
    ],
)
def test_paged_attention_rejects_bad_arguments_by_name(change, name):
    args = attention_args()
    with pytest.raises(ValueError, match=name):
        paged_attention_ref(**(args | change(args)))


def test_reshape_and_cache_rejects_a_slot_mapping_of_the_wrong_length():
    cache = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        reshape_and_cache_ref(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), cache, cache,
                              torch.tensor([1]))  # fmt: skip


def test_reshape_and_cache_rejects_mismatched_heads():
    cache = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match="key"):
        reshape_and_cache_ref(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), cache, cache,
                              torch.tensor([1]))  # fmt: skip


def test_rms_norm_rejects_a_weight_of_the_wrong_size():
    with pytest.raises(ValueError, match="weight"):
        rms_norm_ref(torch.zeros(2, 8), torch.ones(7), 1e-6)


def test_rms_norm_rejects_a_residual_of_another_shape():
    with pytest.raises(ValueError, match="residual"):
        rms_norm_ref(torch.zeros(2, 8), torch.ones(8), 1e-6, residual=torch.zeros(1, 8))


def test_rotary_rejects_an_odd_rot_dim():
    with pytest.raises(ValueError, match="cos_sin_cache"):
        rotary_embedding_ref(torch.tensor([0]), torch.zeros(1, 2, 8), torch.zeros(1, 1, 8),
                             torch.zeros(4, 5), True)  # fmt: skip


def test_rotary_rejects_float_positions():
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding_ref(torch.tensor([0.0]), torch.zeros(1, 2, 8), torch.zeros(1, 1, 8),
                             torch.zeros(4, 8), True)  # fmt: skip


def test_paged_attention_rejects_tensors_on_another_device():
    args = attention_args()
    with pytest.raises(ValueError, match="block_table is on meta"):
        paged_attention_ref(**(args | {"block_table": args["block_table"].to("meta")}))


def test_reshape_and_cache_rejects_tensors_on_another_device():
    cache = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping is on meta"):
        reshape_and_cache_ref(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), cache, cache,
                              torch.tensor([1], device="meta"))  # fmt: skip
