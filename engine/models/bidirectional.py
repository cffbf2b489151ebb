"""Bidirectional attention inside image spans (Gemma3), on top of causal paged attention.

Query rows of an image span are recomputed with ``mask = causal(+window) OR same-span``.
The whole span's K/V must already be in the cache, so a span is never split across
scheduler chunks (the scheduler guarantees it).

The spans of a step are computed once, on the host, from the host-side step inputs
(``ImageSpans.build``): each carries the plain ints the layers need, so no layer reads a
scalar back from the device. Masks (one per span and sliding window) and K/V block indices
(one per span and block table) are built on the device the first time a layer asks, then
reused by the step's other layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class ImageSpan(NamedTuple):
    seq: int  # the sequence's index in the batch
    start: int  # the span's first position
    end: int  # its end position (exclusive)
    first: int  # the first position of the span among this step's queries
    last: int  # the end of those
    row: int  # the flat query row of position ``first``


class ImageSpans:
    """A step's image spans, with their masks and K/V block indices built once per step."""

    def __init__(self, spans=()):
        self.spans: tuple[ImageSpan, ...] = tuple(spans)
        self._masks: dict = {}  # (window, device) -> [mask per span]
        self._blocks: dict = {}  # (id(block_table), block size) -> (table, [index per span])
        self.mask_builds = self.index_builds = 0  # per span, for the tests

    @classmethod
    def build(cls, triples, starts, counts, qsl) -> ImageSpans:
        """From ``(sequence index, span start, span end)`` triples and each sequence's first
        position, query count and first flat row this step (host ints or host tensors)."""
        starts, counts, qsl = (
            x.tolist() if torch.is_tensor(x) else x for x in (starts, counts, qsl)
        )
        spans = []
        for seq, start, end in triples:
            chunk, n = starts[seq], counts[seq]
            first, last = max(start, chunk), min(end, chunk + n)
            if first >= last:
                continue
            assert end <= chunk + n, f"image span [{start}, {end}) split across chunks"
            spans.append(ImageSpan(seq, start, end, first, last, qsl[seq] + first - chunk))
        return cls(spans)

    @classmethod
    def from_metadata(cls, triples, meta) -> ImageSpans:
        """Raw triples on hand-built metadata whose tensors are on the host (direct model
        tests); the runner passes ``ImageSpans`` and the layers read nothing back."""
        qsl, seq_lens = meta.query_start_loc, meta.seq_lens
        if qsl.device.type != "cpu" or seq_lens.device.type != "cpu":
            raise TypeError("bidirectional_spans on the device must be ImageSpans")
        counts = qsl[1:] - qsl[:-1]
        return cls.build(triples, seq_lens - counts, counts, qsl)

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self):
        return iter(self.spans)

    def masks(self, window: int | None, device: torch.device) -> list[torch.Tensor]:
        key = (window, device)
        masks = self._masks.get(key)
        if masks is None:
            masks = self._masks[key] = [span_mask(s, window, device) for s in self.spans]
            self.mask_builds += len(self.spans)
        return masks

    def blocks(self, block_table: torch.Tensor, block_size: int) -> list[torch.Tensor]:
        key = (id(block_table), block_size)
        hit = self._blocks.get(key)
        if hit is None:  # the table is kept alive with its indices: its id is not reused
            index = [block_table[s.seq, : -(-s.end // block_size)].long() for s in self.spans]
            hit = self._blocks[key] = (block_table, index)
            self.index_builds += len(self.spans)
        return hit[1]


def span_mask(span: ImageSpan, window: int | None, device: torch.device) -> torch.Tensor:
    """``[last - first, end]`` bool: causal (within the window) or inside the span."""
    qpos = torch.arange(span.first, span.last, device=device)[:, None]
    kpos = torch.arange(span.end, device=device)[None, :]
    causal = kpos <= qpos
    if window is not None:
        causal &= kpos > qpos - window
    return causal | ((kpos >= span.start) & (kpos < span.end))


def attend_spans(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta,
    scale: float,
    window: int | None,
) -> None:
    """Overwrite ``out`` rows of every span in ``meta.bidirectional_spans``."""
    spans = meta.bidirectional_spans
    if not isinstance(spans, ImageSpans):
        spans = ImageSpans.from_metadata(spans, meta)
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    masks = spans.masks(window, q.device)
    blocks = spans.blocks(meta.block_table, block_size)
    for span, mask, index in zip(spans, masks, blocks, strict=True):
        end, r0, r1 = span.end, span.row, span.row + span.last - span.first
        # a cache stored in fp8 (--kv-cache-dtype) is read back in the queries' dtype
        k = k_cache.index_select(0, index).reshape(-1, kv_heads, head_dim)[:end].to(q.dtype)
        v = v_cache.index_select(0, index).reshape(-1, kv_heads, head_dim)[:end].to(q.dtype)
        qh = q[r0:r1].transpose(0, 1)  # [H, R, D]
        kh = k.transpose(0, 1).repeat_interleave(group, 0)
        vh = v.transpose(0, 1).repeat_interleave(group, 0)
        res = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        out[r0:r1] = res.transpose(0, 1)
