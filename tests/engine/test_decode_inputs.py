"""A decode step's inputs (one token per sequence) skip the ragged layout: they must equal
what the step's definition gives, and a step with a longer chunk must take the ragged path."""

from __future__ import annotations

from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.worker.input_batch import InputBatch

BLOCK = 4


def decoding_batch() -> InputBatch:
    """Three requests, each with its prompt computed and one token sampled (to compute)."""
    batch = InputBatch(8, 64, BLOCK)
    for i, (req_id, n) in enumerate({"a": 5, "b": 8, "c": 2}.items()):
        blocks = [10 * (i + 1) + j for j in range(-(-(n + 1) // BLOCK))]
        batch.add(req_id, list(range(100 * (i + 1), 100 * (i + 1) + n + 1)), SamplingParams(),
                  [blocks], n, n)  # fmt: skip
    return batch


def test_a_decode_step_is_each_sequences_next_token_at_its_slot():
    batch = decoding_batch()
    table = batch.block_table[0].copy()
    computed = {r: int(batch.num_computed[batch.row_of[r]]) for r in "abc"}
    inputs = batch.prepare({"b": 1, "a": 1, "c": 1})
    order = ["b", "a", "c"]
    rows = [batch.row_of[r] for r in order]
    pos = [computed[r] for r in order]
    assert inputs.positions.tolist() == pos
    assert inputs.input_ids.tolist() == [
        int(batch.token_ids[w, p]) for w, p in zip(rows, pos, strict=True)
    ]
    slots = [int(table[w, p // BLOCK]) * BLOCK + p % BLOCK for w, p in zip(rows, pos, strict=True)]
    assert inputs.slot_mapping[0].tolist() == slots
    assert inputs.seq_lens.tolist() == [p + 1 for p in pos]
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 3]
    assert inputs.logits_indices.tolist() == [0, 1, 2]
    assert inputs.sample_req_ids == order and inputs.every_token_samples
    assert inputs.sample_rows.tolist() == rows
    assert [int(batch.num_computed[w]) for w in rows] == [p + 1 for p in pos]


def test_a_step_with_a_longer_chunk_takes_the_ragged_path():
    batch = InputBatch(8, 64, BLOCK)
    batch.add("p", list(range(1, 11)), SamplingParams(), [[1, 2, 3]], 0, 10)
    batch.add("d", [7, 8, 9], SamplingParams(), [[5]], 2, 2)
    inputs = batch.prepare({"p": 4, "d": 1})  # a prefill chunk that does not sample
    assert inputs.positions.tolist() == [0, 1, 2, 3, 2]
    assert inputs.query_start_loc.tolist() == [0, 4, 5]
    assert inputs.sample_req_ids == ["d"] and inputs.logits_indices.tolist() == [4]
    assert not inputs.every_token_samples
    assert inputs.slot_mapping[0].tolist() == [4, 5, 6, 7, 22]
