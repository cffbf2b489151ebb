"""Turns logits into tokens: greedy / temperature / top-k / top-p / min-p, for the whole
batch at once from its rows' gathered parameters (``StepParams``); the only per-row work is
one uniform draw per seeded row, from that row's generator."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.sample.state import StepParams


def _filter(logits: torch.Tensor, sp: StepParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (masked logits become -inf).
    Each stage runs only when some row asks for it (the checks are on host arrays)."""
    dev = logits.device
    if (sp.temperature != 1.0).any():
        logits = logits / _on(sp.temperature, dev)[:, None]
    if sp.top_k.any():
        logits = _top_k(logits, sp.top_k)
    if (sp.top_p < 1.0).any():
        top_p = _on(sp.top_p, dev)
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    if (sp.min_p > 0).any():
        min_p = _on(sp.min_p, dev)
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k(logits: torch.Tensor, top_k: np.ndarray) -> torch.Tensor:
    """Logits below each row's k-th largest become -inf (rows with k 0: none). The k-th value
    comes from one top-k at the largest k, the same value a full sort gives."""
    vocab = logits.shape[1]
    k = np.minimum(top_k, vocab)
    k_max = int(k.max())
    if k_max * 4 > vocab:
        values = torch.sort(logits, dim=-1, descending=True).values
    else:
        values = logits.topk(k_max, dim=-1).values
    kth = values.gather(1, _on(np.maximum(k, 1) - 1, logits.device)[:, None])
    if not top_k.all():  # rows without top-k keep everything
        kth = kth.masked_fill(_on(top_k == 0, logits.device)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _on(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(dev)


CHUNK = 64  # tokens per first-level bucket of the inverse-CDF draw


def _random_sample(logits: torch.Tensor, sp: StepParams) -> torch.Tensor:
    """Inverse-CDF draw: one uniform number per row (from the row's generator when seeded)
    against the row's cumulative probabilities. The same distribution as an exponential race
    (argmax of p / Exp(1)) at one random number per row instead of one per vocabulary entry:
    [64, 4096] on one CPU thread ~0.5 ms instead of ~4 ms."""
    probs = logits.softmax(-1)
    u = torch.empty((logits.shape[0], 1), dtype=torch.float64, device=logits.device)
    if len(sp.seeded) < logits.shape[0]:
        u.uniform_()
    for i, generator in sp.seeded:
        u[i].uniform_(generator=generator)
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


def sample(logits: torch.Tensor, sp: StepParams) -> torch.Tensor:
    """``logits [R, V]`` fp32 (penalties, bias and masks applied) -> token ids ``[R]``."""
    if sp.all_greedy:
        return argmax_rows(logits)
    greedy_tokens = argmax_rows(logits) if sp.greedy.any() else None
    sampled = _random_sample(_filter(logits, sp), sp)
    if greedy_tokens is None:
        return sampled
    return torch.where(_on(sp.greedy, logits.device), greedy_tokens, sampled)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first maximum), int64. On CPU numpy's vectorized argmax: ~10x
    faster than torch's for ``[64, 4096]`` fp32 logits (24 vs 220 us)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.argmax(-1)
