"""Persistent per-row sampling state (DESIGN.md §10): numpy arrays indexed by ``InputBatch``
row, written when a request joins or leaves, so a step gathers its rows' parameters with one
index per array instead of Python lists over requests (vLLM v1's persistent batch)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from epdserve.engine.sample.bad_words import BadWords
from epdserve.engine.sampling_params import SamplingParams


class RaggedRows:
    """Per row, a short list of token ids (and values): padded ``[rows, width]`` arrays and a
    count per row. The width grows when a row needs more (rare: a join, never a step)."""

    def __init__(self, num_rows: int, dtype=np.float32):
        self.count = np.zeros(num_rows, dtype=np.int64)
        self.ids = np.zeros((num_rows, 1), dtype=np.int64)
        self.values = np.zeros((num_rows, 1), dtype=dtype)

    def set(self, row: int, ids, values=None) -> None:
        n = len(ids)
        if n > self.ids.shape[1]:
            grow = n - self.ids.shape[1]
            self.ids = np.pad(self.ids, ((0, 0), (0, grow)))
            self.values = np.pad(self.values, ((0, 0), (0, grow)))
        self.count[row] = n
        if n:
            self.ids[row, :n] = ids
            if values is not None:
                self.values[row, :n] = values

    def entries(self, rows: np.ndarray, vocab: int):
        """``(i, id, value)`` flat arrays of the entries of ``rows`` (``i``: the index into
        ``rows``), ids outside the vocabulary left out."""
        counts = self.count[rows]
        if not counts.any():
            return None
        width = int(counts.max())
        ids = self.ids[rows, :width]
        keep = (np.arange(width) < counts[:, None]) & (ids < vocab)
        i = np.nonzero(keep)[0]
        return i, ids[keep], self.values[rows, :width][keep]


@dataclass
class StepParams:
    """The sampled rows' parameters for one step, in logits-row order."""

    temperature: np.ndarray  # float32; 1.0 for greedy rows (their logits are not divided)
    greedy: np.ndarray  # bool
    top_k: np.ndarray  # int64; 0: none
    top_p: np.ndarray  # float32
    min_p: np.ndarray  # float32
    seeded: list[tuple[int, torch.Generator]]  # (logits row, its generator)
    all_greedy: bool

    @classmethod
    def of(cls, params: list[SamplingParams], generators=None) -> StepParams:
        """Parameters of a list of requests, outside a batch (tests, one-off sampling)."""
        state = SamplingState(len(params))
        for i, p in enumerate(params):
            state.add(i, p, 0, generators[i] if generators else None)
        return state.gather(np.arange(len(params)))


class SamplingState:
    """Each ``InputBatch`` row's sampling parameters, as arrays."""

    def __init__(self, max_num_reqs: int, eos_token_id: int | None = None):
        n = max_num_reqs
        self.eos_token_id = eos_token_id  # masked, with stop_token_ids, under min_tokens
        self.temperature = np.ones(n, dtype=np.float32)
        self.greedy = np.ones(n, dtype=bool)  # an empty row counts as greedy
        self.top_k = np.zeros(n, dtype=np.int64)
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.penalised = np.zeros(n, dtype=bool)
        self.repetition = np.ones(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.num_prompt = np.zeros(n, dtype=np.int64)
        self.logprobs = np.full(n, -1, dtype=np.int64)  # -1: none wanted
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.stop_ids = RaggedRows(n)  # what min_tokens masks: EOS and stop_token_ids
        self.bias = RaggedRows(n)  # logit_bias
        self.bad_words = BadWords(n)
        self.generators: list[torch.Generator | None] = [None] * n
        self.seeded = np.zeros(n, dtype=bool)
        self.owner: list = [None] * n  # what added the row (the batch's request state)
        # rows of the batch that use each feature: a step skips what no row uses
        self.num_penalised = self.num_logprobs = self.num_bias = self.num_min_tokens = 0
        self.num_bad_words = self.num_random = 0

    def add(
        self,
        row: int,
        params: SamplingParams,
        num_prompt_tokens: int,
        generator: torch.Generator | None,
        owner=None,
    ) -> None:
        self.remove(row)
        self.owner[row] = owner
        p = params
        self.greedy[row] = p.greedy
        self.temperature[row] = 1.0 if p.greedy else p.temperature
        self.top_k[row] = p.top_k
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.penalised[row] = p.needs_penalties
        self.repetition[row] = p.repetition_penalty
        self.frequency[row] = p.frequency_penalty
        self.presence[row] = p.presence_penalty
        self.num_prompt[row] = num_prompt_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        bias = p.logit_bias or {}
        self.bias.set(row, list(bias), list(bias.values()))
        stops = []
        if p.min_tokens and p.structured_outputs is None:  # a grammar decides its own end
            eos = self.eos_token_id
            stops = ([] if p.ignore_eos or eos is None else [eos]) + list(p.stop_token_ids)
        self.min_tokens[row] = p.min_tokens if stops else 0
        self.stop_ids.set(row, stops)
        self.bad_words.set(row, p.bad_words_token_ids)
        self.generators[row] = generator
        self.seeded[row] = generator is not None
        self._count(row, 1)

    def remove(self, row: int) -> None:
        self._count(row, -1)
        self.owner[row] = None
        self.greedy[row] = True
        self.generators[row] = None
        self.seeded[row] = False
        self.penalised[row] = False
        self.logprobs[row] = -1
        self.min_tokens[row] = 0
        self.bias.set(row, [])
        self.stop_ids.set(row, [])
        self.bad_words.set(row, [])

    def _count(self, row: int, sign: int) -> None:
        self.num_penalised += sign * bool(self.penalised[row])
        self.num_logprobs += sign * bool(self.logprobs[row] >= 0)
        self.num_bias += sign * bool(self.bias.count[row])
        self.num_min_tokens += sign * bool(self.min_tokens[row])
        self.num_bad_words += sign * bool(self.bad_words.count[row])
        self.num_random += sign * (not self.greedy[row])

    def gather(self, rows: np.ndarray) -> StepParams:
        greedy = self.greedy[rows]
        gens = self.generators
        seeded = [(i, gens[rows[i]]) for i in np.flatnonzero(self.seeded[rows]).tolist()]
        return StepParams(
            temperature=self.temperature[rows],
            greedy=greedy,
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            seeded=seeded,
            all_greedy=bool(greedy.all()),
        )

    def min_tokens_entries(self, rows: np.ndarray, num_tokens: np.ndarray, vocab: int):
        """``(i, id)`` of the stop ids to mask: rows that have produced fewer than
        ``min_tokens`` tokens (vLLM: EOS and stop tokens cannot be sampled before then)."""
        produced = num_tokens[rows] - self.num_prompt[rows]
        active = np.flatnonzero(self.min_tokens[rows] > produced)
        if not active.size:
            return None
        found = self.stop_ids.entries(rows[active], vocab)
        if found is None:
            return None
        i, ids, _ = found
        return active[i], ids
