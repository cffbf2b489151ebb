"""Rotary embedding tables (cos | sin halves, vLLM's layout), computed as HF does in fp32.

``longrope`` (Phi-3) divides each frequency by a per-dimension factor, ``short_factor`` or
``long_factor``, and multiplies cos and sin by one attention factor. transformers uses the
short factors while a sequence fits in ``original_max_position_embeddings`` and, once it grows
past that, computes the whole sequence again with the long ones. A paged cache keeps keys as
they were rotated and shares blocks between sequences, so here one set serves every position
of every sequence: the long set when the table reaches past the original context (the model's
``max_position_embeddings``, or ``--max-model-len`` above it), else the short set. That equals
transformers for a sequence longer than the original context from its prompt on (and for every
sequence of a model whose context is not extended); a shorter sequence of an extended model is
rotated with the long factors where transformers would use the short ones (vLLM's choice too,
at its default ``max_model_len``).
"""

from __future__ import annotations

import math

import torch


def _base_powers(rope: dict, rot_dim: int) -> torch.Tensor:
    """``theta ** (2i / rot_dim)``: the inverse of each pair's base frequency."""
    base = float(rope.get("rope_theta", 10000.0))
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim
    return base**exponent


def inv_frequencies(rope: dict, rot_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for a rope config (``longrope``:
    the short factors unless ``use_long_factors``)."""
    kind = rope.get("rope_type", "default")
    if kind == "longrope":
        key = "long_factor" if rope.get("use_long_factors") else "short_factor"
        return _longrope_inv_freq(rope, key, rot_dim), longrope_attention_factor(rope)
    inv_freq = 1.0 / _base_powers(rope, rot_dim)
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    raise ValueError(f"rope_parameters.rope_type: unsupported {kind!r}")


def _llama3(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    factor = rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_inv_freq(rope: dict, key: str, rot_dim: int) -> torch.Tensor:
    factors = rope.get(key)
    if not isinstance(factors, list) or len(factors) != rot_dim // 2:
        raise ValueError(f"rope_parameters.{key}: must be a list of {rot_dim // 2} numbers")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * _base_powers(rope, rot_dim))


def longrope_attention_factor(rope: dict) -> float:
    """What cos and sin are multiplied by: the config's ``attention_factor``, else
    ``sqrt(1 + ln(factor) / ln(original length))`` (1 for a factor up to 1), ``factor`` being
    the config's, else ``max_position_embeddings / original_max_position_embeddings``."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or rope["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def cos_sin_cache(rope: dict, rot_dim: int, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """``[max_positions, rot_dim]``: cos of each frequency, then sin."""
    if rope.get("rope_type") == "longrope":  # one set of factors for the whole table
        rope = {
            **rope,
            "use_long_factors": max_positions > rope["original_max_position_embeddings"],
        }
    inv_freq, scaling = inv_frequencies(rope, rot_dim)
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
    return cache.to(dtype)
