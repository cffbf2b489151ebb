"""Quantized weights (kernels/quant_linear, quant_triton): the layouts' words as the formats
write them, joins and slices, and each product against the dequantized weight's.

torch's packed int4 CPU kernel (bf16 and fp16 models) computes ``(q - 8) * scale + offset`` in
the activations' dtype: in fp32 within a few ulps of the dequantized product; in bf16 its
dequantized weight and its output are rounded to bf16 (measured here: ~1e-2 on outputs of ~4,
i.e. bf16 rounding). fp32 models dequantize per product instead: bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.engine.models.quant.int4 import awq_unpack, unpack_words
from epdserve.engine.models.quant.write import awq_tensors, fp8_tensors, gptq_tensors
from epdserve.kernels.linear import linear, pack
from epdserve.kernels.quant_linear import (
    FP8,
    FP8Weight,
    Int4Weight,
    int4_cpu_pack,
    slice_cols,
    slice_rows,
)


def random_int4(n=64, k=256, group=128, dtype=torch.float32, seed=0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) / 50 + 1e-3
    zeros = torch.randint(0, 16, (n, k // group), generator=g)
    return Int4Weight.from_ints(q, scales, zeros, group, dtype)


def test_gptq_words_hold_eight_input_rows_and_v1_stores_zero_minus_one():
    w = torch.zeros(8, 128)
    w[0, :8] = torch.arange(1, 9) * 0.1  # output 0, inputs 0..7 rise
    tensors, _ = gptq_tensors(w, group=128, sym=True)
    assert tensors["qweight"].shape == (16, 8) and tensors["qzeros"].shape == (1, 1)
    assert tensors["qzeros"].item() == 0x77777777  # zero 8, stored as 7 in every nibble
    nibbles = unpack_words(tensors["qweight"][:1, :1])[0, 0].tolist()
    assert nibbles == sorted(nibbles) and nibbles[0] > 8  # row 8i + j in nibble j


def test_awq_words_hold_eight_outputs_in_awqs_nibble_order():
    words = torch.tensor([[0x75316420]], dtype=torch.int64).to(torch.int32)
    assert awq_unpack(words).tolist() == [list(range(8))]
    w = torch.randn(16, 128)
    tensors, deq = awq_tensors(w, group=128)
    assert tensors["qweight"].shape == (128, 2) and tensors["scales"].shape == (1, 16)
    assert (deq - w).abs().max() <= tensors["scales"].float().max() / 2 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_the_packed_int4_cpu_kernel_gives_the_dequantized_weights_product(dtype, rows):
    w = random_int4(dtype=dtype)
    dense = w.dequantize(torch.float32)
    x = torch.randn(rows, 256)
    packed = int4_cpu_pack(w)  # what pack() does for bf16 and fp16 models
    assert packed.packed is not None and packed.qdata is None
    got = linear(x.to(dtype), packed).float()
    want = x.to(dtype).float() @ dense.T
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16 weights and outputs: 2^-8 relative, on sums of 256 products
        assert ((got - want).abs() <= 2**-7 * want.abs() + 0.02 * want.abs().max()).all()


def test_an_int4_shape_the_cpu_kernel_cannot_take_runs_dequantized():
    w = pack(random_int4(n=24, dtype=torch.bfloat16))  # N % 16 != 0
    assert w.packed is None
    x = torch.randn(3, 256).bfloat16()
    torch.testing.assert_close(linear(x, w), x @ w.dequantize().T)


def test_an_fp32_int4_product_is_the_dequantized_weights_product_bit_for_bit():
    w = pack(random_int4(dtype=torch.float32))
    assert w.packed is None  # torch's kernel in fp32 is slower than dequantizing
    x, b = torch.randn(9, 256), torch.randn(64)
    q, z = w.ints().float(), w.zeros.float().repeat_interleave(128, 1)
    dense = (q - z) * w.scales.repeat_interleave(128, 1)  # the formats' definition
    assert torch.equal(linear(x, w, b), F.linear(x, dense, b))


def test_torch_cat_joins_quantized_weights_along_the_output_dim():
    a, b = random_int4(n=32, seed=1), random_int4(n=16, seed=2)
    joined = torch.cat([a, b])
    assert isinstance(joined, Int4Weight) and joined.shape == (48, 256)
    assert torch.equal(joined.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    data = torch.randn(8, 256).to(FP8)
    f1 = FP8Weight(data, torch.rand(8, 2), 128, torch.float32, torch.tensor(0.5))
    f2 = FP8Weight(data, torch.rand(8, 2), 128, torch.float32, torch.tensor(2.0))
    fj = torch.cat([f1, f2])
    assert fj.shape == (16, 256) and fj.input_scale.item() == 2.0  # one input: the larger scale
    assert torch.equal(fj.dequantize(), torch.cat([f1.dequantize(), f2.dequantize()]))
    with pytest.raises(TypeError, match="only torch.cat dim 0"):
        torch.cat([a, b], dim=1)


def test_slices_are_the_dequantized_slices_and_split_groups_are_refused():
    w = random_int4(n=32, k=512)
    torch.testing.assert_close(slice_rows(w, 8, 24).dequantize(), w.dequantize()[8:24])
    torch.testing.assert_close(
        slice_cols(w, 128, 384, "o").dequantize(), w.dequantize()[:, 128:384]
    )
    with pytest.raises(ValueError, match="tensor_parallel_size: o's input columns 64..320"):
        slice_cols(w, 64, 320, "o")
    tensors, deq = fp8_tensors(torch.randn(40, 256), "block")
    fw = FP8Weight(tensors["weight"], tensors["weight_scale"].repeat_interleave(128, 0)[:40], 128,
                   torch.float32)  # fmt: skip
    assert torch.equal(fw.dequantize(), deq)
    assert torch.equal(slice_cols(fw, 128, 256, "down").dequantize(), deq[:, 128:])


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_a_kept_fp8_product_on_the_cpu_is_the_dequantized_weights_product(strategy, monkeypatch):
    monkeypatch.setenv("EPDSERVE_FP8_CPU_WEIGHTS", "fp8")
    tensors, deq = fp8_tensors(torch.randn(48, 256), strategy)
    scale = tensors["weight_scale"]
    if strategy == "block":
        scale, group = scale.repeat_interleave(128, 0)[:48], 128
    else:
        scale, group = scale.reshape(-1, 1).expand(48, 1), None
    w = pack(FP8Weight(tensors["weight"], scale, group, torch.float32))
    assert w.data.dtype == FP8 and w.nbytes < 48 * 256 * 2  # 1 byte a weight, plus scales
    x, b = torch.randn(6, 256), torch.randn(48)
    assert torch.equal(linear(x, w, b), F.linear(x, deq, b))


def test_an_fp8_weight_on_the_cpu_is_dequantized_at_pack_by_default(monkeypatch):
    monkeypatch.delenv("EPDSERVE_FP8_CPU_WEIGHTS", raising=False)
    tensors, deq = fp8_tensors(torch.randn(48, 256), "channel")
    w = pack(FP8Weight(tensors["weight"], tensors["weight_scale"], None, torch.float32))
    assert isinstance(w, torch.Tensor) and torch.equal(w, deq)
    monkeypatch.setenv("EPDSERVE_FP8_CPU_WEIGHTS", "sometimes")
    with pytest.raises(ValueError, match="^EPDSERVE_FP8_CPU_WEIGHTS: fp8 or dequantize"):
        pack(FP8Weight(tensors["weight"], tensors["weight_scale"], None, torch.float32))


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    ("rows", "group", "dtype"),
    [(3, 128, torch.float32), (20, 64, torch.float32), (5, 128, torch.float16)],
)
def test_the_triton_int4_kernel_gives_the_dequantized_weights_product(rows, group, dtype):
    from epdserve.kernels.quant_triton import int4_matmul

    w = random_int4(n=80, k=256, group=group)
    x = torch.randn(rows, 256)
    got = int4_matmul(x.to(dtype), w.qdata, w.scales, w.zeros, group)
    assert got.dtype == dtype
    want = x.to(dtype).float() @ w.dequantize().T
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # fp16 weight tile and output
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs a CUDA GPU")
def test_scaled_mm_fp8_products_are_close_to_the_dequantized_weights_product():
    tensors, deq = fp8_tensors(torch.randn(256, 512), "channel")
    w = FP8Weight(tensors["weight"].cuda(), tensors["weight_scale"].cuda(), None, torch.bfloat16)
    w = pack(w)
    assert w.scale_row is not None
    x = torch.randn(9, 512, device="cuda").bfloat16()
    got = linear(x, w).float()
    want = x.float() @ deq.cuda().T
    # fp8 activations (per token): 2^-4 relative per product, averaged over 512 of them
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    xi = torch.randn(9, 512, device="cuda")
    q = Int4Weight.from_ints(torch.randint(0, 16, (64, 512)), torch.rand(64, 4) / 50,
                             torch.full((64, 4), 8), 128, torch.float32)  # fmt: skip
    from epdserve.engine.models.quant import on_device

    qc = pack(on_device(q, torch.device("cuda")))
    torch.testing.assert_close(linear(xi, qc), xi @ q.dequantize().cuda().T, rtol=1e-3, atol=1e-3)
