"""Static step inputs (DESIGN.md §10): a step's inputs move in one packed copy into buffers
allocated once at their maximum size, at offsets that depend only on the step's shape, with
a fixed-width block table. The packing runs on the CPU here (no pinned memory): what it
writes, where, and a whole engine run through it gives the tokens the unpacked path gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest_helpers import make_prompts

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.sampling_params import SamplingParams as Params
from epdserve.engine.worker.device_inputs import DeviceInputs
from epdserve.engine.worker.input_batch import InputBatch

BLOCK, MAX_LEN, MAX_REQS = 4, 64, 4


def batch_with(requests: dict[str, int]) -> InputBatch:
    """A batch of ``requests`` (id -> prompt length), each with its prompt's blocks."""
    batch = InputBatch(MAX_REQS, MAX_LEN, BLOCK)
    next_block = 1
    for req_id, n in requests.items():
        blocks = list(range(next_block, next_block + -(-n // BLOCK)))
        next_block += len(blocks)
        batch.add(req_id, list(range(100, 100 + n)), Params(), [blocks], 0, n)
    return batch


def packer() -> DeviceInputs:
    return DeviceInputs("cpu", 32, MAX_REQS, MAX_LEN // BLOCK, 1, pin=False)


def test_a_packed_step_holds_the_step_and_the_requests_whole_tables():
    batch = batch_with({"a": 5, "b": 9})
    inputs = batch.prepare({"a": 5, "b": 9})
    dev = packer().pack(inputs, batch.block_table)
    for name in ("input_ids", "positions", "seq_lens", "query_start_loc", "logits_indices"):
        got, want = getattr(dev, name), getattr(inputs, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(dev.slot_mapping[0], inputs.slot_mapping[0])
    table = dev.block_table[0]
    assert table.shape == (2, MAX_LEN // BLOCK) and table.dtype == torch.int32  # fixed width
    assert torch.equal(table, torch.from_numpy(batch.block_table[0][inputs.rows]))
    cut = inputs.block_table[0].shape[1]
    assert torch.equal(table[:, :cut], inputs.block_table[0])


def test_steps_of_one_shape_read_the_same_addresses_and_nothing_is_reallocated():
    batch = batch_with({"a": 3, "b": 6, "c": 2})
    pack = packer()
    first = pack.pack(batch.prepare({"a": 3, "b": 6}), batch.block_table)  # prefill
    addresses = []
    for _ in range(3):  # decode steps: 2 sequences, 1 token each
        batch.append_token(np.array([0, 1]), np.array([7, 7]))
        dev = pack.pack(batch.prepare({"a": 1, "b": 1}), batch.block_table)
        addresses.append([t.data_ptr() for t in (dev.input_ids, dev.seq_lens, dev.block_table[0])])
    assert addresses[0] == addresses[1] == addresses[2]
    assert first.input_ids.data_ptr() == dev.input_ids.data_ptr()  # one buffer, from offset 0
    pack.pack(batch.prepare({"c": 2}), batch.block_table)
    assert pack.num_allocations == 1


def test_a_step_beyond_the_planned_maximum_grows_the_buffers_once_and_stays_correct():
    batch = batch_with({"a": 40})
    pack = DeviceInputs("cpu", 8, MAX_REQS, MAX_LEN // BLOCK, 1, pin=False)
    inputs = batch.prepare({"a": 40})
    dev = pack.pack(inputs, batch.block_table)
    assert pack.num_allocations == 1 and torch.equal(dev.input_ids, inputs.input_ids)


@pytest.fixture(scope="module")
def llm(models):
    return LLM(model=str(models.get("llama")), max_model_len=256)


def test_an_engine_stepping_through_the_packed_copy_gives_the_same_tokens(llm, monkeypatch):
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(DeviceInputs, "move", DeviceInputs.pack)  # the device path, on CPU
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert packed == plain
