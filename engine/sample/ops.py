"""Batched logits processing: penalties, logit bias, min-tokens masks and logprobs for the
whole batch in a fixed number of tensor operations (no per-row Python, no history lists)."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import Logprobs


def penalty_index(history: np.ndarray, lengths: np.ndarray, prompt_lens: np.ndarray, vocab: int):
    """Scatter columns of each history token for :func:`apply_penalties`: a prompt token
    ``t`` counts at ``t``, an output token at ``vocab + 1 + t``, positions past a row's
    length at ``vocab`` (a slot past the prompt's vocabulary, never read)."""
    pos = np.arange(history.shape[1])
    output = pos >= prompt_lens[:, None]
    return np.where(pos < lengths[:, None], history + output * (vocab + 1), vocab)


def apply_penalties(
    logits: torch.Tensor,
    index: np.ndarray,
    repetition: np.ndarray,
    frequency: np.ndarray,
    presence: np.ndarray,
) -> torch.Tensor:
    """vLLM/OpenAI semantics for ``logits [P, V]``: repetition over prompt+output (divide
    positive logits, multiply negative ones), frequency (per occurrence) and presence (once)
    over the output. ``index [P, L]``: :func:`penalty_index`. Token counts come from one
    scatter-add over the padded histories. Returns the penalised logits."""
    rows, vocab = logits.shape
    dev, dtype = logits.device, logits.dtype
    idx = torch.from_numpy(index).to(dev)
    counts = torch.zeros((rows, 2 * (vocab + 1)), dtype=dtype, device=dev)
    counts.scatter_add_(1, idx, torch.ones((), dtype=dtype, device=dev).expand(idx.shape))
    out = counts[:, vocab + 1 : 2 * vocab + 1]
    if (repetition != 1.0).any():
        seen = (counts[:, :vocab] > 0) | (out > 0)
        rp = torch.from_numpy(repetition).to(dev)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if frequency.any() or presence.any():
        freq = torch.from_numpy(frequency).to(dev)[:, None]
        pres = torch.from_numpy(presence).to(dev)[:, None]
        logits = logits - (freq * out + pres * (out > 0).to(dtype))
    return logits


def add_at(logits: torch.Tensor, i: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """``logits[i[n], ids[n]] += values[n]`` in one indexed add (pairs are distinct)."""
    where = torch.from_numpy(np.stack([i, ids])).to(logits.device)
    vals = torch.from_numpy(values).to(device=logits.device, dtype=logits.dtype)
    logits.index_put_((where[0], where[1]), vals, accumulate=True)


def mask_at(logits: torch.Tensor, i: np.ndarray, ids: np.ndarray) -> None:
    """``logits[i[n], ids[n]] = -inf`` in one indexed write."""
    where = torch.from_numpy(np.stack([i, ids])).to(logits.device)
    logits.index_put_((where[0], where[1]), torch.tensor(float("-inf"), device=logits.device))


def batch_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int):
    """For ``raw [N, V]`` log-probabilities and the chosen ``tokens [N]``: ids and logprobs
    ``[N, 1 + k]`` (the chosen token, then the top ``k``) and the chosen token's rank ``[N]``,
    on the device (one gather, one comparison, one top-k)."""
    chosen = raw.gather(1, tokens[:, None])
    ranks = (raw > chosen).sum(-1) + 1
    if k <= 0:
        return tokens[:, None], chosen, ranks
    top = raw.topk(k, dim=-1)
    return torch.cat([tokens[:, None], top.indices], 1), torch.cat([chosen, top.values], 1), ranks


def split_logprobs(ids: list, lps: list, ranks: list, ks) -> list[Logprobs]:
    """Host lists of :func:`batch_logprobs` cut per request to its own ``k``."""
    return [
        Logprobs([i[: k + 1]], [p[: k + 1]], [r])
        for i, p, r, k in zip(ids, lps, ranks, ks, strict=True)
    ]


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> Logprobs:
    """Top-``k`` of ``logprobs [R, V]`` after each row's chosen token, with its rank (the
    positions of one request: prompt logprobs)."""
    ids, lps, ranks = batch_logprobs(logprobs, token_ids, k)
    return Logprobs(ids.tolist(), lps.tolist(), ranks.tolist())
