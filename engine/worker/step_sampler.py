"""The sampling half of a step (DESIGN.md §10): the forward's logits become tokens, appended
to the ``InputBatch``'s histories, with the log-probabilities requests asked for. Under tensor
parallelism the output rank samples and the other ranks follow its tokens.

Each row's sampling parameters live in a ``SamplingState`` written when a request joins or
leaves (``add``/``remove``, called by the runner next to the batch's own; a row whose request
was not added is added when it first samples); a step gathers its
rows' parameters with one index per array, and penalties, logit bias, min-tokens masks and
logprobs run as batched tensor ops. The tokens (and logprobs) come back in one copy."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import SchedulerOutput
from epdserve.engine.sample.host_copy import HostCopy
from epdserve.engine.sample.ops import (
    add_at,
    apply_penalties,
    batch_logprobs,
    compute_logprobs,
    mask_at,
    penalty_entries,
    split_logprobs,
)
from epdserve.engine.sample.sampler import argmax_rows, sample
from epdserve.engine.sample.state import SamplingState
from epdserve.engine.structured.mask import apply_bitmask
from epdserve.engine.worker.input_batch import InputBatch


class StepSampler:
    def __init__(self, model, batch: InputBatch):
        self.model = model
        self.batch = batch
        eos = getattr(getattr(model, "config", None), "eos_token_ids", None) or ()
        self.state = SamplingState(batch.token_ids.shape[0], eos[0] if eos else None)
        self.host = HostCopy(model.device)
        self._announced = 0  # of the batch's adds (``InputBatch.num_added``), those told here

    def add(self, req_id: str) -> None:
        """A request joined the batch (after ``InputBatch.add``)."""
        self._join(self.batch.states[req_id])
        self._announced += 1

    def _join(self, s) -> None:
        self.state.add(s.row, s.params, s.num_prompt_tokens, s.generator, owner=s)

    def remove(self, req_id: str) -> None:
        """A request leaves the batch (before ``InputBatch.remove`` frees its row)."""
        s = self.batch.states.get(req_id)
        if s is not None:
            self.state.remove(s.row)

    def sample(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        sched: SchedulerOutput,
        rows: np.ndarray | None = None,
    ):
        """``(tokens, logprobs)``: each request's sampled token ids, in ``req_ids``' order,
        and the logprobs of those that asked, by request. ``rows``: their batch rows, when
        the caller has them."""
        rows = self._rows(req_ids, rows)
        tokens = raw = None
        try:
            tokens, raw = self._choose(logits, rows, req_ids, sched)
        finally:  # the other ranks wait for the tokens: -1s when sampling raised
            if self.model.tp.size > 1:
                sent = torch.full((len(req_ids),), -1, dtype=torch.int64, device=logits.device)
                tokens = self.model.tp.broadcast(sent if tokens is None else tokens.to(torch.int64))
        want = lp = None
        if raw is not None:  # the logprobs of the rows that want them, on the device
            want, raw_lp = raw
            ks = self.state.logprobs[rows[want]]
            chosen = tokens if len(want) == len(rows) else tokens[_on(want, tokens.device)]
            lp = batch_logprobs(raw_lp, chosen, int(ks.max()))
        token_np, *lp_np = self.host.start(tokens, *(lp or ())).wait()  # the step's one sync
        self.batch.append_token(rows, token_np)
        logprobs = {}
        if lp is not None:
            per = split_logprobs(*(a.tolist() for a in lp_np), ks.tolist())
            logprobs = {req_ids[i]: one for i, one in zip(want.tolist(), per, strict=True)}
        return [[t] for t in token_np.tolist()], logprobs

    def _rows(self, req_ids: list[str], rows: np.ndarray | None) -> np.ndarray:
        """The batch rows of ``req_ids``. A request the batch holds but this sampler was not
        told of (or whose row changed hands) joins now: looked for only when the batch has
        had more adds than ``add`` was called for, never in the runner's steps."""
        batch = self.batch
        if rows is None:
            rows = np.fromiter(map(batch.row_of.__getitem__, req_ids), np.int64, len(req_ids))
        if self._announced != batch.num_added:
            owner = self.state.owner
            for s in list(batch.states.values()):
                if owner[s.row] is not s:
                    self._join(s)
            self._announced = batch.num_added
        return rows

    def _choose(self, logits: torch.Tensor, rows: np.ndarray, req_ids, sched: SchedulerOutput):
        """The step's tokens, and ``(rows, log-probabilities)`` of the rows that want them."""
        logits, raw = self.process(logits, rows, req_ids, sched)
        st = self.state
        if not st.num_random or np.count_nonzero(st.greedy[rows]) == len(rows):  # all greedy
            return argmax_rows(logits), raw  # no per-step parameters to gather
        return sample(logits, st.gather(rows)), raw

    def process(self, logits: torch.Tensor, rows: np.ndarray, req_ids, sched: SchedulerOutput):
        """The logits to sample from (bias, min-tokens masks, grammar, penalties; ``logits``
        may change in place), and the raw logprobs of the rows that want them."""
        st, vocab = self.state, logits.shape[1]
        raw = None
        if st.num_logprobs:
            want = np.flatnonzero(st.logprobs[rows] >= 0)
            if want.size:  # of the model, before any bias
                sub = logits if want.size == len(rows) else logits[_on(want, logits.device)]
                raw = (want, torch.log_softmax(sub, dim=-1))
        if st.num_bias and (found := st.bias.entries(rows, vocab)) is not None:
            add_at(logits, *found)
        if st.num_min_tokens:
            found = st.min_tokens_entries(rows, self.batch.num_tokens, vocab)
            if found is not None:  # EOS and stop tokens cannot come before min_tokens
                mask_at(logits, *found)
        if st.num_bad_words:
            b = self.batch
            found = st.bad_words.entries(rows, b.token_ids, b.num_tokens, st.num_prompt, vocab)
            if found is not None:  # the last token of a word the output would complete
                mask_at(logits, *found)
        if sched.grammar_req_ids:  # structured outputs: only the grammar's tokens remain
            index = {r: i for i, r in enumerate(req_ids)}
            grammar_rows = [index[r] for r in sched.grammar_req_ids]
            apply_bitmask(logits, grammar_rows, sched.grammar_bitmask, len(grammar_rows))
        if st.num_penalised:
            pen = np.flatnonzero(st.penalised[rows])
            if pen.size:
                self._penalise(logits, rows, pen)
        return logits, raw

    def _penalise(self, logits: torch.Tensor, rows: np.ndarray, pen: np.ndarray) -> None:
        """Penalties of the rows ``pen`` (indices into ``rows``), from the batch's padded
        token histories, as batched ops on their distinct tokens."""
        st, b = self.state, self.batch
        prow = rows[pen]
        lengths = b.num_tokens[prow]
        history = b.token_ids[prow, : int(lengths.max())]
        i, token, count = penalty_entries(history, lengths, st.num_prompt[prow], logits.shape[1])
        src = prow[i]  # each entry's batch row: its parameters
        apply_penalties(
            logits,
            (pen[i], token, count),
            st.repetition[src],
            st.frequency[src],
            st.presence[src],
        )

    def follow(self, req_ids: list[str]) -> None:
        """Append the tokens the output rank sampled (tensor parallelism, other ranks)."""
        tokens = torch.empty(len(req_ids), dtype=torch.int64, device=self.model.device)
        token_np = self.model.tp.broadcast(tokens).cpu().numpy()
        if (token_np < 0).any():  # its sampling raised: this step fails on every rank
            raise RuntimeError("the output rank could not sample this step")
        rows = [self.batch.states[r].row for r in req_ids]
        self.batch.append_token(np.asarray(rows, dtype=np.int64), token_np)

    def prompt_logprobs(self, hidden: torch.Tensor, inputs) -> dict:
        out = {}
        if not self.batch.num_prompt_logprobs:
            return out  # no row of the batch asked for them
        for i, req_id in enumerate(inputs.order):
            state = self.batch.states[req_id]
            k = state.params.prompt_logprobs
            if k is None:
                continue
            start, end = int(inputs.query_start_loc[i]), int(inputs.query_start_loc[i + 1])
            first_pos = int(inputs.positions[start])
            # position p predicts prompt token p+1; the last prompt token predicts nothing here
            last_pos = min(int(inputs.positions[end - 1]), state.num_prompt_tokens - 2)
            if last_pos < first_pos:
                continue
            n = last_pos - first_pos + 1
            logits = self.model.compute_logits(hidden[start : start + n])
            if logits is None:  # not the output rank: it joined the gather, that is all
                continue
            targets = torch.from_numpy(
                self.batch.token_ids[state.row, first_pos + 1 : last_pos + 2].copy()
            ).to(hidden.device)
            out[req_id] = compute_logprobs(torch.log_softmax(logits, -1), targets, k)
        return out


def _on(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device)
