"""Image spans on the device (issue #39 part 5): the spans are computed once per step on the
host, the layers read no scalar back from a tensor, masks and K/V block indices are built once
per step, and the outputs are bit-for-bit those of the per-layer host computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from epdserve.engine.core.interfaces import MMFeature
from epdserve.engine.models import decoder
from epdserve.engine.models.bidirectional import ImageSpan, ImageSpans, attend_spans
from epdserve.engine.models.decoder import AttentionMetadata
from epdserve.engine.worker.mm_inputs import EncoderOutputs, place_image_embeddings

# what reads a tensor's value back into Python (on a GPU: a wait for the device)
HOST_READS = {"item", "tolist", "numpy", "cpu", "__int__", "__index__", "__float__", "__bool__"}


class HostReads(TorchDispatchMode):
    """Records scalar reads at the dispatcher (``int(t)``, ``t.item()``)..."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


class HostCalls(TorchFunctionMode):
    """...and the Python-level reads the dispatcher never sees on the host (``tolist``)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def host_reads(fn, *args) -> list[str]:
    with HostReads() as low, HostCalls() as high:
        fn(*args)
    return low.reads + high.reads


def per_layer_reference(out, q, k_cache, v_cache, meta, scale, window) -> None:
    """The computation before part 5: device scalars read per span per layer, the mask on
    the host."""
    block_size, kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    for seq, start, end in meta.bidirectional_spans:
        q0, q1 = int(meta.query_start_loc[seq]), int(meta.query_start_loc[seq + 1])
        seq_len = int(meta.seq_lens[seq])
        chunk_start = seq_len - (q1 - q0)
        first, last = max(start, chunk_start), min(end, seq_len)
        if first >= last:
            continue
        blocks = meta.block_table[seq, : -(-end // block_size)].long()
        k = k_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:end].to(q.dtype)
        v = v_cache.index_select(0, blocks).reshape(-1, kv_heads, head_dim)[:end].to(q.dtype)
        qpos = torch.arange(first, last)[:, None]
        kpos = torch.arange(end)[None, :]
        causal = kpos <= qpos
        if window is not None:
            causal &= kpos > qpos - window
        mask = causal | ((kpos >= start) & (kpos < end))
        rows = q[q0 + first - chunk_start : q0 + last - chunk_start]
        kh = k.transpose(0, 1).repeat_interleave(group, 0)
        vh = v.transpose(0, 1).repeat_interleave(group, 0)
        res = F.scaled_dot_product_attention(
            rows.transpose(0, 1), kh, vh, attn_mask=mask, scale=scale
        )
        out[q0 + first - chunk_start : q0 + last - chunk_start] = res.transpose(0, 1)


# (first position, query count) per sequence; image spans as (sequence, start, end)
CHUNKS = [(0, 20), (9, 14), (30, 1), (5, 12)]
TRIPLES = [
    (0, 2, 6),
    (0, 10, 17),  # two spans in one sequence
    (1, 4, 12),  # the step starts inside the span (its head is in the cache)
    (2, 3, 8),  # a decode step after the image: no query of the span this step
    (3, 6, 16),
]
BS, KV, GROUP, D = 4, 2, 2, 8


def batch(seed: int = 0, q_dtype=torch.float32, cache_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([s for s, _ in CHUNKS], dtype=torch.int32)
    counts = torch.tensor([n for _, n in CHUNKS], dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0, dtype=torch.int32)])
    seq_lens = starts + counts
    per_seq = -(-int(seq_lens.max()) // BS)
    blocks = torch.randperm(len(CHUNKS) * per_seq, generator=gen) + 1  # scattered, 0 unused
    table = blocks.reshape(len(CHUNKS), per_seq).to(torch.int32)
    shape = (len(CHUNKS) * per_seq + 1, BS, KV, D)
    k = torch.randn(shape, generator=gen).to(cache_dtype)
    v = torch.randn(shape, generator=gen).to(cache_dtype)
    q = torch.randn(int(qsl[-1]), KV * GROUP, D, generator=gen).to(q_dtype)
    meta = AttentionMetadata(q, q, table, seq_lens, qsl)  # positions/slots unused here
    return meta, (starts, counts, qsl), q, k, v


def run(fn, meta, q, k, v, window):
    out = torch.zeros_like(q)
    fn(out, q, k, v, meta, D**-0.5, window)
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize(
    "q_dtype,cache_dtype",
    [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)],
)
def test_spans_equal_the_per_layer_host_computation_bit_for_bit(window, q_dtype, cache_dtype):
    meta, step, q, k, v = batch(1, q_dtype, cache_dtype)
    meta.bidirectional_spans = TRIPLES
    expected = run(per_layer_reference, meta, q, k, v, window)
    assert expected.flatten(1).ne(0).any(1).sum() == 4 + 7 + 3 + 10  # the rows of 4 spans
    meta.bidirectional_spans = ImageSpans.build(TRIPLES, *step)
    assert torch.equal(run(attend_spans, meta, q, k, v, window), expected)
    meta.bidirectional_spans = TRIPLES  # raw triples on host metadata (direct model tests)
    assert torch.equal(run(attend_spans, meta, q, k, v, window), expected)


def test_the_fp8_cache_is_read_back_as_before():
    meta, step, q, k, v = batch(2)
    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    meta.bidirectional_spans = TRIPLES
    expected = run(per_layer_reference, meta, q, k, v, None)
    meta.bidirectional_spans = ImageSpans.build(TRIPLES, *step)
    assert torch.equal(run(attend_spans, meta, q, k, v, None), expected)


def test_spans_carry_the_host_ints_of_the_step():
    spans = ImageSpans.build(TRIPLES, *batch()[1])
    assert list(spans) == [
        ImageSpan(0, 2, 6, 2, 6, 2),
        ImageSpan(0, 10, 17, 10, 17, 10),
        ImageSpan(1, 4, 12, 9, 12, 20),  # rows 20.. hold positions 9..
        ImageSpan(3, 6, 16, 6, 16, 36),
    ]
    assert all(type(x) is int for s in spans for x in s)
    with pytest.raises(AssertionError, match=r"image span \[6, 20\) split across chunks"):
        ImageSpans.build([(3, 6, 20)], *batch()[1])


def test_attending_spans_reads_no_scalar_back_and_builds_masks_once_per_window():
    meta, step, q, k, v = batch(3)
    # the detector works: the old computation reads 3 scalars per span per layer
    meta.bidirectional_spans = TRIPLES
    assert host_reads(run, per_layer_reference, meta, q, k, v, None).count(
        "aten._local_scalar_dense.default"
    ) == 3 * len(TRIPLES)
    spans = meta.bidirectional_spans = ImageSpans.build(TRIPLES, *step)
    for layer in range(6):  # sliding, global, sliding, ... as Gemma3's layers
        window = 3 if layer % 2 == 0 else None
        assert host_reads(run, attend_spans, meta, q, k, v, window) == []
    assert spans.mask_builds == 2 * len(spans) == 8  # one per span and window
    assert spans.index_builds == len(spans)  # one block table
    other = AttentionMetadata(q, q, meta.block_table.clone(), meta.seq_lens, meta.query_start_loc)
    other.bidirectional_spans = spans  # a second KV-cache group's table
    assert host_reads(run, attend_spans, other, q, k, v, 3) == []
    assert (spans.mask_builds, spans.index_builds) == (8, 2 * len(spans))


def test_device_metadata_must_carry_image_spans_not_triples():
    meta, _, q, k, v = batch()
    meta.bidirectional_spans = TRIPLES
    meta.query_start_loc = meta.query_start_loc.to("meta")
    with pytest.raises(TypeError, match="must be ImageSpans"):
        run(attend_spans, meta, q, k, v, None)


def feature(ident: str, offset: int, length: int, data=b"", shape=()) -> MMFeature:
    return MMFeature(ident, offset, length, data, list(shape))


def test_placing_embeddings_returns_the_spans_and_writes_the_rows():
    _, step, *_ = batch()
    hidden = 3
    feats = {
        "a": [feature("x", 2, 4), feature("y", 10, 7)],
        "b": [feature("z", 4, 8)],
        "c": [feature("w", 3, 5)],
        "d": [feature("u", 6, 10)],
    }
    outputs = EncoderOutputs(encoder=None)
    for f in sum(feats.values(), []):
        outputs.put(f.identifier, torch.full((f.length, hidden), float(ord(f.identifier))))
    embeds = torch.zeros(int(step[2][-1]), hidden)
    spans = place_image_embeddings(embeds, list(feats), *step, feats.get, outputs)
    assert spans.spans == ImageSpans.build(TRIPLES, *step).spans
    filled = {s.row: embeds[s.row : s.row + s.last - s.first, 0].unique().tolist() for s in spans}
    assert filled == {2: [ord("x")], 10: [ord("y")], 20: [ord("z")], 36: [ord("u")]}
    assert int(embeds[:, 0].ne(0).sum()) == 4 + 7 + 3 + 10  # nothing else written
    only = place_image_embeddings(embeds, list(feats), *step, feats.get, None)  # a TP rank
    assert only.spans == spans.spans


class FakeTower:
    proj = torch.zeros(1)  # the weights' device: the host

    def __init__(self):
        self.seen = []

    def encode(self, pixels):
        self.seen.append(pixels)
        return torch.zeros(pixels.shape[0], 4, 2)


def test_encoding_hands_the_tower_the_pixel_buffers_on_its_device():
    pixels = [np.arange(12, dtype=np.float32).reshape(3, 2, 2) + i for i in range(2)]
    feats = [feature(f"i{i}", 0, 4, p.tobytes(), p.shape) for i, p in enumerate(pixels)]
    outputs = EncoderOutputs(FakeTower())
    outputs.encode(feats)
    (seen,) = outputs.encoder.seen
    assert seen.device == FakeTower.proj.device and seen.dtype == torch.float32
    assert torch.equal(seen, torch.from_numpy(np.stack(pixels)))
    assert sorted(outputs.outputs) == ["i0", "i1"] and outputs.num_runs == 2


def test_a_gemma3_forward_with_image_spans_reads_no_scalar_in_span_attention(models, monkeypatch):
    from epdserve.engine.models.loader import load_model

    model = load_model(models.get("gemma3"), torch.float32, torch.device("cpu"), 4096)
    cfg, bs = model.config, 16
    lens = [40, 30]  # two prompts past the sliding window, one image span each
    ids = torch.randint(3, 200, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    nb = -(-max(lens) // bs)
    table = torch.arange(1, 2 * nb + 1, dtype=torch.int32).reshape(2, nb)
    seq = torch.repeat_interleave(torch.arange(2), torch.tensor(lens))
    slots = table[seq, pos // bs].long() * bs + pos % bs
    qsl = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    triples = [(0, 5, 9), (1, 20, 24)]

    def forward(spans, attend):
        monkeypatch.setattr(decoder, "attend_spans", attend)
        meta = AttentionMetadata(pos, slots, table, torch.tensor(lens, dtype=torch.int32), qsl)
        meta.bidirectional_spans = spans
        kv = torch.zeros(2 * nb + 1, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim)
        caches = [(kv[:, i, 0], kv[:, i, 1]) for i in range(cfg.num_layers)]
        return model.compute_logits(model.forward(ids, meta, caches))

    reads = []

    def watched(*args):
        reads.extend(host_reads(attend_spans, *args))

    spans = ImageSpans.build(triples, torch.zeros(2, dtype=torch.int32), torch.tensor(lens), qsl)
    logits = forward(spans, watched)
    assert reads == []
    windows = {layer.window for layer in model.layers}
    assert windows == {None, 32} and cfg.num_layers > len(windows)
    assert spans.mask_builds == len(windows) * 2 and spans.index_builds == 2
    assert torch.equal(logits, forward(triples, per_layer_reference))
    assert not torch.equal(logits, forward((), attend_spans))  # the spans changed something
