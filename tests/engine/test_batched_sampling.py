"""Batched sampling (issue #39) against straightforward per-row references: penalties, logit
bias, min-tokens masks, the filters and logprobs give what one row at a time gives."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from epdserve.engine.core.interfaces import Logprobs
from epdserve.engine.sample.host_copy import HostCopy
from epdserve.engine.sample.sampler import _filter, _random_sample
from epdserve.engine.sample.state import StepParams
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured.params import StructuredOutputsParams
from epdserve.engine.worker.input_batch import InputBatch
from epdserve.engine.worker.step_sampler import StepSampler

V, EOS = 96, 2
NO_GRAMMAR = SimpleNamespace(grammar_req_ids=[], grammar_bitmask=None)


def model():
    return SimpleNamespace(
        tp=SimpleNamespace(size=1), device=torch.device("cpu"), config=SimpleNamespace(
            eos_token_ids=(EOS,)))  # fmt: skip


def random_params(rng: np.random.Generator, i: int) -> SamplingParams:
    pen = rng.random() < 0.6
    bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.choice(V + 4, rng.integers(1, 6))}
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
        top_k=int(rng.choice([0, 1, 5, 40, V + 10])),
        top_p=float(rng.choice([1.0, 0.9, 0.5])),
        min_p=float(rng.choice([0.0, 0.05])),
        seed=i if rng.random() < 0.5 else None,
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])) if pen else 1.0,
        frequency_penalty=float(rng.uniform(-2, 2)) if pen and rng.random() < 0.7 else 0.0,
        presence_penalty=float(rng.uniform(-2, 2)) if pen and rng.random() < 0.7 else 0.0,
        logit_bias={t: v for t, v in bias.items() if t < V} if rng.random() < 0.5 else None,
        min_tokens=int(rng.choice([0, 3, 50])),
        max_tokens=60,
        stop_token_ids=[int(t) for t in rng.choice(V, rng.integers(0, 3))],
        ignore_eos=bool(rng.random() < 0.3),
        logprobs=int(rng.choice([0, 1, 5])) if rng.random() < 0.5 else None,
    )


def make_batch(seed: int, n: int = 12, max_len: int = 80):
    """A batch whose rows hold random histories of random lengths (and stale ids past them)."""
    rng = np.random.default_rng(seed)
    batch = InputBatch(2 * n, max_len, 16)
    batch.token_ids[:] = rng.integers(0, V, batch.token_ids.shape)  # stale entries
    sampler = StepSampler(model(), batch)
    req_ids = []
    for i in range(n):
        prompt = int(rng.integers(1, 30))
        out = int(rng.integers(0, 40))
        ids = rng.integers(0, V, prompt + out).tolist()
        batch.add(f"r{i}", ids, random_params(rng, i), [[]], prompt + out, prompt)
        sampler.add(f"r{i}")
        req_ids.append(f"r{i}")
    rng.shuffle(req_ids)  # logits rows need not follow batch rows
    logits = torch.from_numpy(rng.standard_normal((n, V)).astype(np.float32) * 3)
    return batch, sampler, req_ids, logits


def reference_logits(logits: torch.Tensor, batch: InputBatch, req_ids) -> torch.Tensor:
    """Today's per-row code (bias, then penalties), with vLLM's min-tokens mask."""
    logits = logits.clone()
    for i, r in enumerate(req_ids):
        s = batch.states[r]
        p, row = s.params, s.row
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values())))
        produced = batch.num_tokens[row] - s.num_prompt_tokens
        if produced < p.min_tokens and p.structured_outputs is None:
            stops = ([] if p.ignore_eos else [EOS]) + list(p.stop_token_ids)
            logits[i, stops] = float("-inf")
        if not p.needs_penalties:
            continue
        hist = batch.token_ids[row, : batch.num_tokens[row]].tolist()
        prompt, output = hist[: s.num_prompt_tokens], hist[s.num_prompt_tokens :]
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=V)[:V].float()
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(prompt, dtype=torch.int64)] = True
            rp = p.repetition_penalty
            logits[i] = torch.where(
                seen, torch.where(logits[i] > 0, logits[i] / rp, logits[i] * rp), logits[i]
            )
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def reference_filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Today's list-built filter."""
    temps = [p.temperature if not p.greedy else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps)[:, None]
    if any(p.top_k for p in params):
        k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params])
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(
            1, (k - 1).clamp(max=logits.shape[1] - 1)[:, None]
        )
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params])
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p[:, None])
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params])
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def rows_of(batch, req_ids):
    return np.array([batch.states[r].row for r in req_ids])


@pytest.mark.parametrize("seed", range(6))
def test_penalties_bias_and_min_tokens_match_the_per_row_reference(seed):
    batch, sampler, req_ids, logits = make_batch(seed)
    want = reference_logits(logits, batch, req_ids)
    got, _ = sampler.process(logits.clone(), rows_of(batch, req_ids), req_ids, NO_GRAMMAR)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(6))
def test_the_filters_match_the_list_built_reference(seed):
    rng = np.random.default_rng(100 + seed)
    params = [random_params(rng, i) for i in range(16)]
    logits = torch.from_numpy(rng.standard_normal((16, V)).astype(np.float32) * 3)
    logits[0, :10] = float("-inf")
    got = _filter(logits.clone(), StepParams.of(params))
    assert torch.equal(got, reference_filter(logits.clone(), params))


def test_seeded_rows_draw_what_the_per_row_path_draws():
    batch, sampler, req_ids, logits = make_batch(7, n=16)
    states = [batch.states[r] for r in req_ids]
    params = [s.params for s in states]
    expected = reference_filter(reference_logits(logits, batch, req_ids), params)
    gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
    drawn = _random_sample(expected, StepParams.of(params, gens))
    sampled, _ = sampler.sample(logits.clone(), req_ids, NO_GRAMMAR)
    greedy = reference_logits(logits, batch, req_ids).argmax(-1)
    for i, p in enumerate(params):
        want = greedy[i] if p.greedy else drawn[i]
        if p.greedy or p.seed is not None:
            assert sampled[i] == [int(want)], (i, p)


def test_logprobs_of_the_whole_batch_match_one_request_at_a_time():
    batch, sampler, req_ids, logits = make_batch(8, n=16)
    raw = torch.log_softmax(logits, -1)  # of the model: before bias and penalties
    sampled, logprobs = sampler.sample(logits.clone(), req_ids, NO_GRAMMAR)
    wanted = {r for r in req_ids if batch.states[r].params.logprobs is not None}
    assert set(logprobs) == wanted and wanted
    for i, r in enumerate(req_ids):
        if r not in wanted:
            continue
        k, token = batch.states[r].params.logprobs, sampled[i][0]
        chosen = raw[i, token]
        top = raw[i].topk(k)
        want = Logprobs(
            [[token, *top.indices.tolist()]],
            [[float(chosen), *top.values.tolist()]],
            [int((raw[i] > chosen).sum()) + 1],
        )
        assert logprobs[r] == want


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    batch = InputBatch(4, 32, 16)
    sampler = StepSampler(model(), batch)
    params = {
        "young": SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=9),
        "grown": SamplingParams(min_tokens=2, stop_token_ids=[7], max_tokens=9),
        "ignore": SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[7], max_tokens=9),
        "grammar": SamplingParams(
            min_tokens=3, max_tokens=9, structured_outputs=StructuredOutputsParams(regex="a+")
        ),
    }
    for r, p in params.items():  # two tokens out: the third may not stop under min_tokens=3
        batch.add(r, [5, 6, 8, 9, 9], p, [[]], 5, 3)
        sampler.add(r)
    req_ids = list(params)
    logits = torch.zeros(4, V)
    got, _ = sampler.process(logits, rows_of(batch, req_ids), req_ids, NO_GRAMMAR)
    masked = {r: torch.isinf(got[i]).nonzero().view(-1).tolist() for i, r in enumerate(req_ids)}
    assert masked == {"young": [EOS, 7], "grown": [], "ignore": [7], "grammar": []}


def test_a_row_the_runner_did_not_announce_joins_when_it_samples():
    batch = InputBatch(2, 16, 16)
    sampler = StepSampler(model(), batch)
    batch.add("a", [1, 3], SamplingParams(logit_bias={4: 100.0}), [[]], 2, 2)
    sampled, _ = sampler.sample(torch.zeros(1, V), ["a"], NO_GRAMMAR)
    assert sampled == [[4]]
    batch.remove("a")  # not announced either: the row goes to a request without bias
    batch.add("b", [1, 3], SamplingParams(temperature=0.0), [[]], 2, 2)
    logits = torch.zeros(1, V)
    logits[0, 9] = 1.0
    assert sampler.sample(logits, ["b"], NO_GRAMMAR)[0] == [[9]]


def test_host_copy_on_the_cpu_is_the_tensor_itself():
    t = torch.arange(5)
    (out,) = HostCopy("cpu").start(t).wait()
    assert out.tolist() == [0, 1, 2, 3, 4] and np.shares_memory(out, t.numpy())
