"""CPU twin of the paged attention kernel: the engine's CPU attention path.

With the C kernels of ``native.py`` built (and ``native_decode``, which the ``torch``
backend turns off), decode sequences (one query token) run in one call of
``csrc/paged_decode.c`` (the cache read in place, bfloat16 softmax as torch's flash kernel
computes it) and every longer query span (plain prompt, chunked prefill, prompt after a
prefix-cache hit) in one call of ``csrc/paged_prefill.c`` (tiled, the cache read in place).
Otherwise the computation is torch: SDPA per prefill span, batched padded decode
(``decode_ref``): the reference twin.

Layout and semantics (shared with the Triton kernel):

- ``key_cache``/``value_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``; in the
  engine they are the strided per-layer views ``kv[:, layer, 0]`` / ``kv[:, layer, 1]`` of the
  cross-layer cache ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``. Only the
  blocks a batch needs are gathered (``index_select(out=)`` into a reused buffer); the whole
  cache is never copied.
- Sequence ``i`` owns queries ``query_start_loc[i]:query_start_loc[i+1]``; they are the LAST
  ``q_len`` positions of its ``seq_lens[i]``-token context, so decode (q_len 1), chunked
  prefill and prefill after a cached prefix share one call. Attention is causal.
- Query head ``h`` reads kv head ``h // (num_heads // kv_heads)`` (GQA).
- ``sliding_window=W``: a query at absolute position ``p`` sees keys in ``(p - W, p]``.
- ``soft_cap=c``: ``logits = c * tanh(logits / c)`` after scaling by ``scale``.
- ``block_table`` entries past a sequence's last block are ignored (negative ones included).
- Cache slots past a sequence's length may be read by the torch padded decode path and
  masked out; they must hold finite values (allocate the cache with ``torch.zeros``), since
  ``0 * nan`` is ``nan``. The Triton kernel never reads them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epdserve.kernels import native
from epdserve.kernels.checks import check_paged_attention
from epdserve.kernels.decode_ref import decode_attention, length_groups
from epdserve.kernels.gather import block_ids, gather_blocks


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    *,
    native_decode: bool = True,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """Causal paged attention over a mixed batch; returns ``out[T, H, D]`` in query's dtype.

    With the C kernels available and ``native_decode`` (the ``torch`` attention backend
    turns it off), all longer query spans run in one call of the prefill kernel and all
    decode sequences (q_len == 1) in one call of the decode kernel. Otherwise decodes run
    as padded, masked, batched computations (``decode_ref``), split into a few groups of
    similar length when padding everyone to the longest would waste a lot, and each longer
    query span runs one SDPA of its own.
    """
    check_paged_attention(
        query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        sliding_window, soft_cap,
    )  # fmt: skip
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    capacity = block_table.shape[1] * key_cache.shape[1]
    plan = step_cache.get(("ref", capacity)) if step_cache is not None else None
    if plan is None:
        plan = _Lengths(query_start_loc, seq_lens, capacity)
        if step_cache is not None:
            step_cache[("ref", capacity)] = plan
    starts, lens, q_lens = plan.starts, plan.lens, plan.q_lens
    args = (key_cache, value_cache, block_table, scale, sliding_window, soft_cap)
    prefill = plan.prefill
    if prefill and native_decode and native.prefill_supports(query, key_cache, value_cache):
        # fp32 plain prompts stay on SDPA's causal kernel, bit for bit what transformers
        # computes; in bf16 the C kernel (1.8-3x faster there) takes them too: it agrees with
        # SDPA in ~99.9% of bf16 outputs, and bf16 outputs only leave transformers' at
        # near-ties whichever kernel runs (tests/engine/test_token_exact.py)
        plain = sliding_window is None and soft_cap is None and query.dtype != torch.bfloat16
        prefill, spans = ([i for i in prefill if q_lens[i] == lens[i]] if plain else [],
                          [i for i in prefill if q_lens[i] < lens[i] or not plain])  # fmt: skip
        if spans:
            _prefill_native(out, query, spans, starts, q_lens, lens, args)  # before decode
    decode = plan.decode
    if decode and native_decode and native.supports(query, key_cache, value_cache):
        _decode_native(out, query, plan, args)
        decode = []
    bs = key_cache.shape[1]
    for group in length_groups(decode, [-(-lens[i] // bs) for i in decode]):
        if len(group) == len(q_lens):  # every sequence, in order: no index shuffling
            out.copy_(decode_attention(query, lens, *args))
            continue
        rows = torch.tensor([starts[i] for i in group], device=query.device)
        res = decode_attention(query.index_select(0, rows), [lens[i] for i in group], *args,
                               seqs=group)  # fmt: skip
        out.index_copy_(0, rows, res)
    masks: dict = {}  # one mask per (q_len, ctx) for every sequence alike
    for i in prefill:
        a, n = starts[i], q_lens[i]
        out[a : a + n] = _prefill_one(query[a : a + n], i, lens[i], args, masks)
    return out


def _prefill_native(out, query, prefill, starts, q_lens, lens, args) -> None:
    """All query spans longer than one token in one call of the C kernel; every other row
    of ``out`` gets 0, for the decode path to overwrite."""
    key_cache, value_cache, block_table, scale, window, soft_cap = args
    pick = [starts[i] for i in prefill], [q_lens[i] for i in prefill], [lens[i] for i in prefill]
    out.copy_(native.paged_prefill(query, key_cache, value_cache, block_table, prefill, *pick,
                                   scale, window, soft_cap))  # fmt: skip


def _decode_native(out, query, plan: _Lengths, args) -> None:
    """All decode sequences in one call of the C kernel, reading the cache in place."""
    key_cache, value_cache, block_table, scale, window, soft_cap = args
    rows, seqs, lens = plan.decode_args()
    if rows is None:  # every sequence decodes, in order
        out.copy_(native.paged_decode(query, key_cache, value_cache, block_table, None, lens,
                                      scale, window, soft_cap))  # fmt: skip
        return
    res = native.paged_decode(query.index_select(0, rows), key_cache, value_cache, block_table,
                              seqs, lens, scale, window, soft_cap)  # fmt: skip
    out.index_copy_(0, rows, res)


class _Lengths:
    """What a call derives from the batch geometry alone (host lists, the decode kernel's
    int32 arguments), checked once: every layer of a step shares it (``step_cache``)."""

    def __init__(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, capacity: int):
        self.starts = starts = query_start_loc.tolist()
        self.lens = lens = seq_lens.tolist()
        self.q_lens = q_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        _check_lengths(q_lens, lens, capacity)
        self.prefill = [i for i, n in enumerate(q_lens) if n > 1]
        self.decode = [i for i, n in enumerate(q_lens) if n == 1]
        self._seq_lens, self._decode_args = seq_lens, None

    def decode_args(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """The decode sequences' query rows and table rows (None: all, in order), and their
        lengths, as the C kernel takes them; built on first use."""
        if self._decode_args is None:
            d = self.decode
            if len(d) == len(self.lens):
                self._decode_args = (None, None, self._seq_lens.to(torch.int32).contiguous())
            else:
                rows = torch.tensor([self.starts[i] for i in d], device=self._seq_lens.device)
                lens = torch.tensor([self.lens[i] for i in d], dtype=torch.int32)
                self._decode_args = (rows, torch.tensor(d, dtype=torch.int32), lens)
        return self._decode_args


def _check_lengths(q_lens: list[int], lens: list[int], capacity: int) -> None:
    for i, (q_len, ctx) in enumerate(zip(q_lens, lens, strict=True)):
        if q_len < 0 or q_len > ctx:
            raise ValueError(f"query_start_loc/seq_lens: sequence {i} has {q_len} queries "
                             f"for a context of {ctx} tokens")  # fmt: skip
        if ctx > capacity:
            raise ValueError(f"seq_lens[{i}]={ctx} exceeds block_table capacity {capacity}")


def _prefill_one(query, seq: int, ctx: int, args, masks: dict):
    """The last ``q_len`` positions of one sequence attend causally to its ``ctx`` keys.

    ``masks`` caches the attention mask by ``(q_len, ctx)`` across sequences of one call."""
    key_cache, value_cache, block_table, scale, window, soft_cap = args
    q_len, num_heads, head_dim = query.shape
    bs, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // kv_heads
    ids = block_ids(block_table[seq : seq + 1], None, -(-ctx // bs))
    k = gather_blocks(key_cache, ids, "k")[:ctx].view(1, ctx, kv_heads, head_dim)
    v = gather_blocks(value_cache, ids, "v")[:ctx].view(1, ctx, kv_heads, head_dim)
    if q_len == ctx and window is None and soft_cap is None:  # plain prompt: causal kernel
        q = query.transpose(0, 1).unsqueeze(0)
        res = F.scaled_dot_product_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        )
        return res[0].transpose(0, 1)
    mask = masks.get((q_len, ctx))
    if mask is None:
        mask = masks[(q_len, ctx)] = _offset_causal_mask(q_len, ctx, window, group, query,
                                                         additive=soft_cap is None)  # fmt: skip
    # rows ordered (head-in-group, position): [1, KVH, G * q_len, D]
    q = query.transpose(0, 1).reshape(1, kv_heads, group * q_len, head_dim)
    res = _attend(q, k.transpose(1, 2), v.transpose(1, 2), mask, scale, soft_cap)
    # reshape, not view: CUDA's SDPA may return a non-contiguous layout (seen on an H200)
    return res.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def _offset_causal_mask(q_len: int, ctx: int, window, group: int, like, additive: bool):
    """``[1, 1, group * q_len, ctx]``: query ``i`` (position ``ctx - q_len + i``) sees keys up to
    its own position (and within ``window``), repeated for the heads of a kv group. Additive
    (0 / -inf in ``like``'s dtype: what SDPA makes of a boolean mask) or boolean."""
    qpos = torch.arange(ctx - q_len, ctx, device=like.device)
    kpos = torch.arange(ctx, device=like.device)
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    mask = mask.repeat(group, 1)[None, None]
    if not additive:
        return mask
    zeros = torch.zeros(mask.shape, dtype=like.dtype, device=like.device)
    return zeros.masked_fill_(~mask, float("-inf"))


def _attend(q, k, v, mask, scale, soft_cap):
    """``q [B,KVH,R,D]`` (R rows per kv head), ``k/v [B,KVH,L,D]``; ``mask [B,1,R|1,L]``:
    additive without ``soft_cap``, boolean with it."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    logits = torch.matmul(q.float(), k.float().contiguous().transpose(-1, -2)) * scale
    logits = torch.tanh(logits / soft_cap) * soft_cap
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, v.float().contiguous()).to(q.dtype)
