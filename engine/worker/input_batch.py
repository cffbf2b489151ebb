"""Persistent per-request state in preallocated numpy arrays, one row per request.

The step's flat inputs (token ids, positions, slot mapping, block table) are built with a
fixed number of vectorized numpy operations whatever the batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress

import numpy as np
import torch

from epdserve.engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    req_id: str
    row: int
    params: SamplingParams
    num_prompt_tokens: int
    generator: torch.Generator | None


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: list[torch.Tensor]  # per KV-cache group
    block_table: list[torch.Tensor]  # per KV-cache group
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    logits_indices: torch.Tensor  # flat index of each sampling request's last token
    sample_req_ids: list[str]
    order: list[str]  # request ids in batch order
    lora_slots: torch.Tensor | None = None  # int32 [T] adapter slot per token; None: no adapter
    rows: np.ndarray | None = None  # each sequence's InputBatch row (its whole block table)
    sample_rows: np.ndarray | None = None  # the rows of ``sample_req_ids``
    # every token of the step samples, in order (decode steps): the logits need no gather
    every_token_samples: bool = False


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        num_groups: int = 1,
        device: torch.device | str = "cpu",
    ):
        self.device = torch.device(device)  # where seeded rows' generators live
        self.block_size = block_size
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self._arange = np.arange(max_num_reqs + 1, dtype=np.int64)  # sliced for offsets
        self._arange32 = self._arange.astype(np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((num_groups, max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # the same in every group
        self.lora_slot = np.full(max_num_reqs, -1, dtype=np.int32)  # -1: the base model
        self.num_lora_rows = 0
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.states: dict[str, RequestState] = {}
        self.row_of: dict[str, int] = {}  # request -> its row (the per-step lookups)
        self.num_prompt_logprobs = 0  # rows whose request asked for prompt logprobs
        self.num_added = 0  # requests added so far (the sampler checks it was told of each)

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        params: SamplingParams,
        block_ids: list[list[int]],
        num_computed: int,
        num_prompt_tokens: int,
        lora_slot: int = -1,
    ) -> None:
        row = self.free_rows.pop()
        self.lora_slot[row] = lora_slot
        self.num_lora_rows += int(lora_slot >= 0)
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.states[req_id] = RequestState(req_id, row, params, num_prompt_tokens, generator)
        self.row_of[req_id] = row
        self.num_added += 1
        self.num_prompt_logprobs += params.prompt_logprobs is not None

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            del self.row_of[req_id]
            self.num_prompt_logprobs -= state.params.prompt_logprobs is not None
            self.free_rows.append(state.row)
            self.num_lora_rows -= int(self.lora_slot[state.row] >= 0)
            self.lora_slot[state.row] = -1

    def append_blocks(self, row: int, block_ids: list[list[int]]) -> None:
        """Append each group's new block ids (every group grows by the same count)."""
        start = self.num_blocks[row]
        for g, ids in enumerate(block_ids):
            if ids:
                self.block_table[g, row, start : start + len(ids)] = ids
        if block_ids:
            self.num_blocks[row] = start + len(block_ids[0])

    def append_token(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

    def prepare(self, num_scheduled: dict[str, int]) -> StepInputs:
        order = list(num_scheduled)
        n = len(order)
        rows = np.fromiter(map(self.row_of.__getitem__, order), dtype=np.int64, count=n)
        starts = self.num_computed[rows]
        total = sum(num_scheduled.values())
        if total >= len(self._arange):
            self._arange = np.arange(total + 1, dtype=np.int64)
            self._arange32 = self._arange.astype(np.int32)
        if total == n:  # one token per sequence (decode steps): no ragged layout to build
            counts = None
            cu = self._arange[1 : n + 1]
            req_idx, positions = rows, starts
            start_loc = self._arange32[: n + 1]  # 0..n (a view: read-only by every reader)
        else:
            counts = np.fromiter(num_scheduled.values(), dtype=np.int64, count=n)
            cu = np.cumsum(counts)
            req_idx = np.repeat(rows, counts)
            positions = np.repeat(starts - cu + counts, counts) + self._arange[:total]
            start_loc = np.empty(n + 1, dtype=np.int32)
            start_loc[0], start_loc[1:] = 0, cu
        input_ids = self.token_ids[req_idx, positions]
        bs = self.block_size
        block_idx, offset = np.divmod(positions, bs)
        slots = []
        for table in self.block_table:  # block id * block size + offset, in place
            slot = table[req_idx, block_idx].astype(np.int64)
            slot *= bs
            slot += offset
            slots.append(torch.from_numpy(slot))
        seq_lens = starts + 1 if counts is None else starts + counts
        max_blocks = -(-int(np.maximum.reduce(seq_lens)) // bs)
        samples = seq_lens >= self.num_tokens[rows]
        every = np.count_nonzero(samples) == n  # (not .all(): a Python wrapper)
        if every:
            sample_pos = self._arange[:n] if counts is None else cu - 1
        else:
            sample_pos = (cu - 1)[samples]
        self.num_computed[rows] = seq_lens
        lora = None
        if self.num_lora_rows:  # base-only batches skip this
            adapters = self.lora_slot[rows]
            if (adapters >= 0).any():
                per_token = adapters if counts is None else np.repeat(adapters, counts)
                lora = torch.from_numpy(per_token)
        return StepInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            slot_mapping=slots,
            block_table=[torch.from_numpy(t[rows, :max_blocks]) for t in self.block_table],
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            query_start_loc=torch.from_numpy(start_loc),
            logits_indices=torch.from_numpy(sample_pos),
            sample_req_ids=order if every else list(compress(order, samples.tolist())),
            order=order,
            lora_slots=lora,
            rows=rows,
            sample_rows=rows if every else rows[samples],
            every_token_samples=every and counts is None,
        )
