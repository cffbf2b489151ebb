"""Torch twin of ``reshape_and_cache``: scatter new keys/values into the paged cache."""

from __future__ import annotations

import torch

from epdserve.kernels.checks import check_reshape_and_cache


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t`` of ``key``/``value [T, KVH, D]`` to slot ``slot_mapping[t]``.

    Slot ``s`` is block ``s // block_size``, offset ``s % block_size`` of
    ``key_cache``/``value_cache [N, block_size, KVH, D]`` (strided views of the cross-layer
    cache are written in place). Slot ``-1`` (padding) is skipped.
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    if slot_mapping.numel() == 0:
        return
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = (slots >= 0).nonzero().squeeze(1)
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache.index_put_((blocks, offsets), key)
    value_cache.index_put_((blocks, offsets), value)
