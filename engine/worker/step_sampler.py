"""The sampling half of a step (DESIGN.md §10): the forward's logits become tokens, appended
to the ``InputBatch``'s histories, with the log-probabilities requests asked for. Under tensor
parallelism the output rank samples and the other ranks follow its tokens."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import SchedulerOutput
from epdserve.engine.sample.sampler import SamplingRow, argmax_rows, compute_logprobs, sample
from epdserve.engine.structured.mask import apply_bitmask
from epdserve.engine.worker.input_batch import InputBatch


class StepSampler:
    def __init__(self, model, batch: InputBatch):
        self.model = model
        self.batch = batch

    def sample(self, logits: torch.Tensor, req_ids: list[str], sched: SchedulerOutput):
        states = [self.batch.states[r] for r in req_ids]
        tokens = raw_logprobs = None
        try:
            tokens, raw_logprobs = self._choose(logits, req_ids, states, sched)
        finally:  # the other ranks wait for the tokens: -1s when sampling raised
            if self.model.tp.size > 1:
                sent = torch.full((len(req_ids),), -1, dtype=torch.int64, device=logits.device)
                tokens = self.model.tp.broadcast(sent if tokens is None else tokens.to(torch.int64))
        want_lp = [s.params.logprobs for s in states]
        batch_rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        token_np = tokens.cpu().numpy()  # the step's one host sync on a device
        self.batch.append_token(batch_rows, token_np)
        token_list = token_np.tolist()
        sampled = {r: [t] for r, t in zip(req_ids, token_list, strict=True)}
        logprobs = {}
        if raw_logprobs is not None:
            for i, (req_id, k) in enumerate(zip(req_ids, want_lp, strict=True)):
                if k is not None:
                    logprobs[req_id] = compute_logprobs(
                        raw_logprobs[i : i + 1], tokens[i : i + 1], k
                    )
        return sampled, logprobs

    def _choose(self, logits: torch.Tensor, req_ids, states, sched: SchedulerOutput):
        """The step's tokens, and the model's log-probabilities if a request wants them."""
        params = [s.params for s in states]
        all_greedy = all(p.greedy for p in params)
        want_lp = [p.logprobs for p in params]
        raw_logprobs = None
        if want_lp.count(None) != len(want_lp):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # of the model, before any bias
        if any(p.logit_bias for p in params):
            for i, p in enumerate(params):
                if p.logit_bias:
                    ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=logits.device)
                    bias = torch.tensor(
                        list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device
                    )
                    logits[i].index_add_(0, ids, bias)
        if sched.grammar_req_ids:  # structured outputs: only the grammar's tokens remain
            row = {r: i for i, r in enumerate(req_ids)}
            rows = [row[r] for r in sched.grammar_req_ids]
            apply_bitmask(logits, rows, sched.grammar_bitmask, len(rows))
        if all_greedy and not any(p.needs_penalties for p in params):
            tokens = argmax_rows(logits)  # no per-row sampling state to build
        else:
            tokens = sample(logits, [self._sampling_row(s) for s in states], all_greedy)
        return tokens, raw_logprobs

    def follow(self, req_ids: list[str]) -> None:
        """Append the tokens the output rank sampled (tensor parallelism, other ranks)."""
        tokens = torch.empty(len(req_ids), dtype=torch.int64, device=self.model.device)
        token_np = self.model.tp.broadcast(tokens).cpu().numpy()
        if (token_np < 0).any():  # its sampling raised: this step fails on every rank
            raise RuntimeError("the output rank could not sample this step")
        rows = [self.batch.states[r].row for r in req_ids]
        self.batch.append_token(np.asarray(rows, dtype=np.int64), token_np)

    def _sampling_row(self, state) -> SamplingRow:
        row = SamplingRow(state.params, state.generator)
        if state.params.needs_penalties:
            n = int(self.batch.num_tokens[state.row])
            ids = self.batch.token_ids[state.row, :n].tolist()
            row.prompt_ids = ids[: state.num_prompt_tokens]
            row.output_ids = ids[state.num_prompt_tokens :]
        return row

    def prompt_logprobs(self, hidden: torch.Tensor, inputs) -> dict:
        out = {}
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
