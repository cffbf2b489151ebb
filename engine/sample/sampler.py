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
    """Temperature, then top-k, top-p and min-p masks (masked logits become -inf)."""
    dev = logits.device
    temps = torch.tensor(
        [r.params.temperature if not r.params.greedy else 1.0 for r in rows], device=dev
    )
    logits = logits / temps[:, None]
    top_k = [r.params.top_k for r in rows]
    if any(top_k):
        k = torch.tensor([t if t > 0 else logits.shape[1] for t in top_k], device=dev)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(
            1, (k - 1).clamp(max=logits.shape[1] - 1)[:, None]
        )
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    if bool((top_p < 1.0).any()):
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _random_sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Inverse-CDF draw: one uniform number per row against the row's cumulative
    probabilities (float64), one generator per seeded row. The same distribution as an
    exponential race (argmax of p / Exp(1)) at one random number per row instead of one per
    vocabulary entry: [64, 4096] on one CPU thread ~0.4 ms instead of ~4 ms."""
    cdf = logits.softmax(-1).cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.empty_like(total)
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < len(rows):
        u.uniform_()
    for i in seeded:
        u[i].uniform_(generator=rows[i].generator)
    # strictly below the total: the first entry above u has non-zero probability
    u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, u, right=True).view(-1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], all_greedy: bool) -> torch.Tensor:
    """``logits [R, V]`` fp32 -> token ids ``[R]``; ``logits`` may be modified in place."""
    if any(r.params.needs_penalties for r in rows):
        apply_penalties(logits, rows)
    greedy_tokens = argmax_rows(logits)
    if all_greedy:
        return greedy_tokens
    sampled = _random_sample(_filter(logits, rows), rows)
    is_greedy = torch.tensor([r.params.greedy for r in rows], device=logits.device)
    return torch.where(is_greedy, greedy_tokens, sampled)


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
