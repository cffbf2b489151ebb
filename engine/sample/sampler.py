"""Turns logits into tokens: penalties, greedy / temperature / top-k / top-p / min-p, logprobs.

Rows without special needs take the vectorized path; per-row work (seeded generators,
penalties) runs only for the rows that ask for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from epdserve.engine.core.interfaces import Logprobs
from epdserve.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] | None = None  # only filled when penalties are needed
    output_ids: list[int] | None = None


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM/OpenAI semantics: repetition over prompt+output, presence/frequency over output."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        out = torch.tensor(row.output_ids or [], dtype=torch.int64, device=logits.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(row.prompt_ids or [], dtype=torch.int64, device=logits.device)] = True
            rp = p.repetition_penalty
            logits[i] = torch.where(
                seen, torch.where(logits[i] > 0, logits[i] / rp, logits[i] * rp), logits[i]
            )
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
            logits.dtype
        )


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (masked logits become -inf).
    Each stage runs only when some row asks for it (the checks are on plain values)."""
    dev = logits.device
    temps = [r.params.temperature if not r.params.greedy else 1.0 for r in rows]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, device=dev)[:, None]
    top_k = [r.params.top_k for r in rows]
    if any(top_k):
        k = torch.tensor([t if t > 0 else logits.shape[1] for t in top_k], device=dev)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(
            1, (k - 1).clamp(max=logits.shape[1] - 1)[:, None]
        )
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(r.params.top_p < 1.0 for r in rows):
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    if any(r.params.min_p > 0 for r in rows):
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


CHUNK = 64  # tokens per first-level bucket of the inverse-CDF draw


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Inverse-CDF draw: one uniform number per row (from the row's generator when seeded)
    against the row's cumulative probabilities. The same distribution as an exponential race
    (argmax of p / Exp(1)) at one random number per row instead of one per vocabulary entry:
    [64, 4096] on one CPU thread ~0.5 ms instead of ~4 ms."""
    probs = logits.softmax(-1)
    u = torch.empty((len(rows), 1), dtype=torch.float64, device=logits.device)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        u.uniform_()
    for i in seeded:
        u[i].uniform_(generator=rows[i].generator)
    tokens = _two_level_search(probs, u)
    chosen = probs.gather(1, tokens.clamp(max=probs.shape[1] - 1)[:, None])
    if bool((tokens >= probs.shape[1]).any() or (chosen == 0).any()):
        return _full_search(probs, u)  # a rounding edge between the two levels: exact path
    return tokens


def _two_level_search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Bucket totals (float64) find the bucket of ``u``; a cumulative sum of that one bucket
    finds the token, so no full-vocabulary cumulative sum is built."""
    r, v = probs.shape
    pad = -v % CHUNK
    chunks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(r, -1, CHUNK)
    outer = chunks.sum(-1, dtype=torch.float64).cumsum_(-1)
    target = _below_total(u, outer[:, -1:])
    k = torch.searchsorted(outer, target, right=True)
    below = torch.where(k > 0, outer.gather(1, (k - 1).clamp(min=0)), 0.0)
    inner = chunks[torch.arange(r, device=probs.device), k.view(-1)]
    j = torch.searchsorted(inner.cumsum(-1, dtype=torch.float64), target - below, right=True)
    return (k * CHUNK + j.clamp(max=CHUNK - 1)).view(-1)


def _full_search(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(-1, dtype=torch.float64)
    return torch.searchsorted(cdf, _below_total(u, cdf[:, -1:]), right=True).view(-1)


def _below_total(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``u * total`` kept strictly below ``total``: the first entry above it has non-zero
    probability."""
    return torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))


def sample(logits: torch.Tensor, rows: list[SamplingRow], all_greedy: bool) -> torch.Tensor:
    """``logits [R, V]`` fp32 -> token ids ``[R]``; ``logits`` may be modified in place."""
    if any(r.params.needs_penalties for r in rows):
        apply_penalties(logits, rows)
    greedy = [r.params.greedy for r in rows]
    if all_greedy or all(greedy):
        return argmax_rows(logits)
    greedy_tokens = argmax_rows(logits) if any(greedy) else None
    sampled = _random_sample(_filter(logits, rows), rows)
    if greedy_tokens is None:
        return sampled
    return torch.where(torch.tensor(greedy, device=logits.device), greedy_tokens, sampled)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first maximum), int64. On CPU numpy's vectorized argmax: ~10x
    faster than torch's for ``[64, 4096]`` fp32 logits (24 vs 220 us)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(np.argmax(logits.numpy(), axis=1))
    return logits.argmax(-1)


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """Top-``k`` of ``logprobs [R, V]`` after each row's chosen token, with its rank."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    ids, lps = [token_ids[:, None]], [chosen]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        ids.append(top.indices)
        lps.append(top.values)
    return Logprobs(torch.cat(ids, 1).tolist(), torch.cat(lps, 1).tolist(), ranks.tolist())
