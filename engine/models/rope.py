"""Rotary embedding tables (cos | sin halves, vLLM's layout), computed as HF does in fp32."""

from __future__ import annotations

import math

import torch


def inv_frequencies(rope: dict, rot_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for a rope config."""
    base = float(rope.get("rope_theta", 10000.0))
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64).to(torch.float32) / rot_dim
    inv_freq = 1.0 / (base**exponent)
    kind = rope.get("rope_type", "default")
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


def cos_sin_cache(rope: dict, rot_dim: int, max_positions: int, dtype: torch.dtype) -> torch.Tensor:
    """``[max_positions, rot_dim]``: cos of each frequency, then sin."""
    inv_freq, scaling = inv_frequencies(rope, rot_dim)
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    cache = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
    return cache.to(dtype)
