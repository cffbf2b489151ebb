"""The random sampler draws from the filtered distribution (no model: logits are given)."""

from __future__ import annotations

import torch

from epdserve.engine.sample.sampler import sample
from epdserve.engine.sample.state import StepParams
from epdserve.engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4, 0.0])


def rows(n, seed=None, **params):
    gen = (lambda: torch.Generator().manual_seed(seed)) if seed is not None else (lambda: None)
    return StepParams.of([SamplingParams(temperature=1.0, **params)] * n, [gen() for _ in range(n)])


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token():
    torch.manual_seed(0)
    n = 40_000
    tokens = sample(PROBS.log().repeat(n, 1), rows(n))
    freq = torch.bincount(tokens, minlength=len(PROBS)).double() / n
    assert freq[1] == 0 and freq[5] == 0
    assert torch.allclose(freq, PROBS.double(), atol=0.01), freq


def test_top_k_masked_tokens_are_never_drawn():
    torch.manual_seed(1)
    tokens = sample(PROBS.log().repeat(2000, 1), rows(2000, top_k=2))
    assert set(tokens.tolist()) == {3, 4}


def test_a_seeded_row_draws_the_same_token_whatever_its_neighbours():
    logits = torch.randn(1, 64)
    alone = sample(logits.clone(), rows(1, seed=7))
    torch.manual_seed(123)
    batch = torch.cat([torch.randn(3, 64), logits])
    params = [SamplingParams()] * 3 + [SamplingParams(seed=7)]
    mixed = sample(batch, StepParams.of(params, [None] * 3 + [torch.Generator().manual_seed(7)]))
    assert mixed[3] == alone[0]


def test_the_bucketed_search_picks_what_a_full_cumulative_sum_picks():
    from epdserve.engine.sample.sampler import _full_search, _two_level_search

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(512, 1000, generator=gen) * 4
    logits[:, 100:300] = float("-inf")  # whole buckets and bucket edges without mass
    probs = logits.softmax(-1)
    u = torch.rand(512, 1, dtype=torch.float64, generator=gen)
    assert torch.equal(_two_level_search(probs, u), _full_search(probs, u))


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    torch.manual_seed(4)
    logits = torch.randn(8, 50)
    mixed = StepParams.of([SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)])
    tokens = sample(logits.clone(), mixed)
    assert torch.equal(tokens[1::2], logits[1::2].argmax(-1))
