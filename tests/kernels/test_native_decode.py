"""The C decode kernel: flash-kernel numerics, chunking, threads, and how it is built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from kernels_testlib import make_batch, naive_attention

from epdserve.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for the kernel")


def decode(batch, scale, window=None, cap=None, rows=None):
    lens = batch.seq_lens.tolist()
    return native.paged_decode(batch.query, batch.key_cache, batch.value_cache,
                               batch.block_table, rows, lens, scale, window, cap)  # fmt: skip


def sdpa_per_sequence(batch, scale):
    """What a model running SDPA on each unpadded cache computes (transformers' default)."""
    outs = []
    for i in range(len(batch.dense_k)):
        q = batch.query[i][None, :, None]
        k = batch.dense_k[i].transpose(0, 1)[None]
        v = batch.dense_v[i].transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"),
    reason="flash numerics are reproduced for torch's AVX2/AVX-512 kernels",
)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 32), (4, 64), (8, 128)])
def test_bf16_rows_equal_torch_flash_attention_bit_for_bit(kv_heads, head_dim):
    """Contexts up to 1,200 keys (three 512-key chunks), blocks shuffled, GQA 2."""
    gen = torch.Generator().manual_seed(head_dim)
    lens = torch.randint(1, 1200, (24,), generator=gen).tolist()
    batch = make_batch([(1, n) for n in lens], 2 * kv_heads, kv_heads, head_dim, 16,
                       dtype=torch.bfloat16, seed=head_dim)  # fmt: skip
    scale = head_dim**-0.5
    out, ref = decode(batch, scale), sdpa_per_sequence(batch, scale)
    rows_equal = (out == ref).all(dim=-1)
    # measured: 97-99% of rows equal; the rest differ in the last bit of a few elements,
    # where a logit's last fp32 bit (dot-product summation order) flips a bf16 rounding
    assert rows_equal.float().mean() >= 0.9, f"{int(rows_equal.sum())}/{rows_equal.numel()}"
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("window", "cap"), [(None, None), (600, None), (None, 2.0), (37, 3.0)])
def test_long_contexts_span_several_chunks(dtype, block_size, window, cap):
    lens = [1, 511, 512, 513, 1024, 1100, 1537, 700]
    batch = make_batch([(1, n) for n in lens], 4, 2, 64, block_size, dtype=dtype)
    out = decode(batch, 0.125, window, cap)
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), naive_attention(batch, 0.125, window, cap),
                               atol=atol, rtol=0)  # fmt: skip


@pytest.mark.parametrize("head_dim", [16, 40, 48, 96])
def test_bf16_head_sizes_read_in_place_or_converted_agree_with_naive(head_dim):
    """Multiples of 32 read bfloat16 in place (even/odd split); others convert rows first."""
    lens = [1, 15, 16, 17, 300, 513, 700]
    batch = make_batch([(1, n) for n in lens], 6, 2, head_dim, 16, dtype=torch.bfloat16)
    for window, cap in [(None, None), (40, 3.0)]:
        out = decode(batch, head_dim**-0.5, window, cap)
        torch.testing.assert_close(out.double(), naive_attention(batch, head_dim**-0.5, window, cap),
                                   atol=2e-2, rtol=0)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_larger_than_a_conversion_piece_are_walked_in_parts(dtype):
    """8 kv heads x 128 x 32 slots = 32k floats per block: converted 8 slots at a time."""
    lens = [5, 40, 300, 700]
    batch = make_batch([(1, n) for n in lens], 16, 8, 128, 32, dtype=dtype)
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for window, cap in [(None, None), (50, 4.0)]:
        out = decode(batch, 0.09, window, cap)
        torch.testing.assert_close(out.double(), naive_attention(batch, 0.09, window, cap),
                                   atol=atol, rtol=0)  # fmt: skip


def test_rows_pick_table_rows_for_a_subset_of_sequences():
    batch = make_batch([(1, n) for n in (30, 90, 7, 300)], 8, 2, 64, 16)
    full = decode(batch, 0.125)
    sub = make_batch([(1, n) for n in (30, 90, 7, 300)], 8, 2, 64, 16)
    pick = [3, 1]
    got = native.paged_decode(sub.query[pick], sub.key_cache, sub.value_cache,
                              sub.block_table, pick, [300, 90], 0.125, None, None)  # fmt: skip
    assert torch.equal(got, full[pick])


def on_1_and_2_threads(batch, *args):
    """The kernel's result with torch on one thread, then on two."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(batch, 0.125, *args)
        torch.set_num_threads(2)
        return one, decode(batch, 0.125, *args)
    finally:
        torch.set_num_threads(before)


def test_threads_do_not_change_the_result():
    batch = make_batch([(1, n) for n in range(40, 800, 37)], 8, 2, 64, 16, dtype=torch.bfloat16)
    one, two = on_1_and_2_threads(batch)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lone_sequence_is_split_by_kv_heads_across_threads(dtype):
    batch = make_batch([(1, 900)], 16, 4, 64, 16, dtype=dtype)
    one, two = on_1_and_2_threads(batch, 300, None)  # on two: 2 parts of 2 kv heads each
    assert torch.equal(one, two)
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(two.double(), naive_attention(batch, 0.125, 300), atol=atol, rtol=0)


def test_unsupported_layouts_are_declined_or_refused():
    batch = make_batch([(1, 9)], 4, 2, 64, 16)
    assert not native.supports(batch.query.half(), batch.key_cache.half(), batch.value_cache.half())
    assert not native.supports(batch.query, batch.key_cache, batch.value_cache.contiguous())
    with pytest.raises(ValueError, match="heads 3, kv heads 2"):
        native.paged_decode(batch.query[:, :3], batch.key_cache, batch.value_cache,
                            batch.block_table, None, [9], 0.125, None, None)  # fmt: skip


def test_a_block_id_outside_the_cache_is_refused_before_any_read():
    batch = make_batch([(1, 40), (1, 9)], 4, 2, 64, 16)
    table = batch.block_table.clone()
    table[0, 1] = batch.key_cache.shape[0] + 7
    with pytest.raises(ValueError, match="block_table: a block id"):
        native.paged_decode(batch.query, batch.key_cache, batch.value_cache, table, None,
                            [40, 9], 0.125, None, None)  # fmt: skip
    table[0, 1] = -1
    with pytest.raises(ValueError, match="block_table"):
        native.paged_decode(batch.query, batch.key_cache, batch.value_cache, table, None,
                            [40, 9], 0.125, None, None)  # fmt: skip
    table[0, 3] = -1  # past the sequence's 3 blocks: never read
    table[0, 1] = batch.block_table[0, 1]
    torch.testing.assert_close(
        decode(batch, 0.125),
        native.paged_decode(
            batch.query, batch.key_cache, batch.value_cache, table, None, [40, 9], 0.125, None, None
        ),
    )


def _probe(env: dict) -> str:
    code = "from epdserve.kernels import native; print(native.available())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_build_is_cached_in_a_private_directory(tmp_path):
    cache = tmp_path / "kernels"
    assert _probe({"EPDSERVE_KERNEL_CACHE": str(cache)}) == "True"
    (built,) = cache.glob("paged_decode-*.so")
    assert cache.stat().st_mode & 0o077 == 0
    mtime = built.stat().st_mtime_ns
    assert _probe({"EPDSERVE_KERNEL_CACHE": str(cache)}) == "True"
    assert built.stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_a_cache_directory_others_can_write_is_not_used(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    assert _probe({"EPDSERVE_KERNEL_CACHE": str(shared)}) == "True"
    assert not list(shared.glob("*.so"))  # built in the next candidate instead


def test_without_a_compiler_or_when_disabled_the_torch_decode_is_used(tmp_path):
    missing = {"CC": str(tmp_path / "no-such-cc"), "EPDSERVE_KERNEL_CACHE": str(tmp_path / "c")}
    assert _probe(missing) == "False"
    assert _probe({"EPDSERVE_NATIVE_KERNELS": "0"}) == "False"
