"""Batched logits processing: penalties, logit bias, min-tokens masks and logprobs for the
whole batch in a fixed number of tensor operations (no per-row Python, no history lists)."""

from __future__ import annotations

import numpy as np
import torch

from epdserve.engine.core.interfaces import Logprobs


def penalty_entries(
    history: np.ndarray, lengths: np.ndarray, prompt_lens: np.ndarray, vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct tokens of each row's history (``history [P, L]``, entries past a row's
    length ignored): flat ``(row, token, output count)``. One sort of ``token * 2 +
    is_output`` keys per row and one segmented sum, whatever the rows and their lengths."""
    rows, width = history.shape
    pos = np.arange(width)
    key = np.where(pos < lengths[:, None], history * 2 + (pos >= prompt_lens[:, None]), 2 * vocab)
    if 2 * vocab < np.iinfo(np.int32).max:
        key = key.astype(np.int32)  # sorts faster
    key.sort(axis=1)
    token = key >> 1
    first = np.empty(key.shape, dtype=bool)
    first[:, 0] = True
    np.not_equal(token[:, 1:], token[:, :-1], out=first[:, 1:])
    starts = np.flatnonzero(first)
    counts = np.add.reduceat(key.ravel() & 1, starts)
    token = token.ravel()[starts]
    keep = token < vocab  # past-the-end positions (and ids outside the vocabulary)
    return starts[keep] // width, token[keep].astype(np.int64), counts[keep]


def apply_penalties(
    logits: torch.Tensor,
    where: tuple[np.ndarray, np.ndarray, np.ndarray],
    repetition: np.ndarray,
    frequency: np.ndarray,
    presence: np.ndarray,
) -> None:
    """vLLM/OpenAI semantics, in place: repetition over prompt+output (divide positive
    logits, multiply negative ones), frequency (per occurrence) and presence (once) over the
    output. ``where``: ``(logits row, token, output count)`` of every distinct history token
    (:func:`penalty_entries`); the parameters are per entry. Only those logits change, so
    the work follows the histories' lengths, not the vocabulary."""
    dev, dtype = logits.device, logits.dtype
    row, token, count = torch.from_numpy(np.stack(where)).to(dev)
    x = logits[row, token]
    if (repetition != 1.0).any():
        rp = torch.from_numpy(repetition).to(dev)
        x = torch.where(x > 0, x / rp, x * rp)
    if frequency.any() or presence.any():
        fp = torch.from_numpy(np.stack([frequency, presence])).to(dev)
        out = count.to(dtype)
        x = x - (fp[0] * out + fp[1] * (out > 0).to(dtype))
    logits[row, token] = x


def add_at(logits: torch.Tensor, i: np.ndarray, ids: np.ndarray, values: np.ndarray) -> None:
    """``logits[i[n], ids[n]] += values[n]`` in one indexed add (pairs are distinct)."""
    where = torch.from_numpy(np.stack([i, ids])).to(logits.device)
    vals = torch.from_numpy(values).to(device=logits.device, dtype=logits.dtype)
    logits.index_put_((where[0], where[1]), vals, accumulate=True)


def mask_at(logits: torch.Tensor, i: np.ndarray, ids: np.ndarray) -> None:
    """``logits[i[n], ids[n]] = -inf`` in one indexed write."""
    where = torch.from_numpy(np.stack([i, ids])).to(logits.device)
    logits[where[0], where[1]] = float("-inf")


def batch_logprobs(raw: torch.Tensor, tokens: torch.Tensor, k: int):
    """For ``raw [N, V]`` log-probabilities and the chosen ``tokens [N]``: ids and logprobs
    ``[N, 1 + k]`` (the chosen token, then the top ``k``) and the chosen token's rank ``[N]``,
    on the device (one gather, one comparison, one top-k)."""
    chosen = raw.gather(1, tokens[:, None])
    if raw.device.type == "cpu":  # numpy counts a comparison's trues ~8x faster than torch
        ranks = torch.from_numpy(np.count_nonzero(raw.numpy() > chosen.numpy(), axis=1) + 1)
    else:
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
