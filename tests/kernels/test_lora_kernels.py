"""lora_apply: the torch twin against a float64 oracle; the C kernel, the Triton kernel
(interpreted) and the chooser against the twin.

Tolerances: float32 paths agree with the twin to 1e-5 (sums in another order); bfloat16
paths may round the delta, then the sum, one bfloat16 ulp apart where the twin's float32
delta sits on a rounding boundary: within 2**-7 relative (1 ulp) and equal almost
everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess

import pytest
import torch

from epdserve.kernels import native, native_build
from epdserve.kernels.lora import lora_apply, lora_apply_native
from epdserve.kernels.lora_ref import lora_apply_ref

MIXED = [2, -1, 0, 2, 2, 1, -1, 0, 0, 1, 2]
BF16, F32 = torch.bfloat16, torch.float32  # several slots, not contiguous, with -1 rows


def case(slots, in_dim, out_dim, dtype, *, num_slots=3, r_max=8, ranks=(8, 4, 6), wdtype=None,
         y_cols=None, seed=0):  # fmt: skip
    """x, a column slice y of a wider tensor (y_cols = (left, right) extra columns), slots,
    stacks whose adapters have rank ``ranks[s]`` zero-padded to ``r_max``, scaling."""
    g = torch.Generator().manual_seed(seed)
    tokens = len(slots)
    left, right = y_cols or (0, 0)
    x = torch.randn(tokens, in_dim, generator=g).to(dtype)
    wide = torch.randn(tokens, left + out_dim + right, generator=g).to(dtype)
    a = torch.zeros(num_slots, r_max, in_dim)
    b = torch.zeros(num_slots, out_dim, r_max)
    for s in range(num_slots):
        r = ranks[s % len(ranks)]
        a[s, :r] = torch.randn(r, in_dim, generator=g) / in_dim**0.5
        b[s, :, :r] = torch.randn(out_dim, r, generator=g)
    scaling = torch.rand(num_slots, generator=g) + 0.5
    wdtype = wdtype or dtype
    slots_t = torch.tensor(slots, dtype=torch.int32)
    return wide, wide[:, left : left + out_dim], x, slots_t, a.to(wdtype), b.to(wdtype), scaling


def oracle(y, x, slots, a, b, scaling):
    """The definition, one row at a time in float64."""
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            h = (a[s].double() @ x[t].double()) * scaling[s].double()
            out[t] += b[s].double() @ h
    return out


def assert_matches_twin(out, ref):
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=2**-7)
        assert (out == ref).float().mean() >= 0.95


def run_against_twin(path, slots, in_dim, out_dim, dtype, **kw):
    wide, y, x, sl, a, b, sc = case(slots, in_dim, out_dim, dtype, y_cols=(3, 5), **kw)
    before, wide_ref = wide.clone(), wide.clone()
    y_ref = wide_ref[:, 3 : 3 + out_dim]
    lora_apply_ref(y_ref, x, sl, a, b, sc)
    path(y, x, sl, a, b, sc)
    assert_matches_twin(y, y_ref)
    # the columns around the slice, and the rows without an adapter, are untouched
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, -5:], before[:, -5:])
    assert torch.equal(wide[sl < 0], before[sl < 0])


# ---- the twin --------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [MIXED, [1], [-1, -1], [0] * 7])
def test_twin_matches_the_definition_in_float32(slots):
    wide, y, x, sl, a, b, sc = case(slots, 24, 20, torch.float32, y_cols=(2, 1))
    expected = oracle(y, x, sl, a, b, sc)
    lora_apply_ref(y, x, sl, a, b, sc)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def test_twin_ignores_the_zero_padding_of_a_smaller_rank():
    _, y, x, sl, a, b, sc = case([0, 0, 1], 16, 12, torch.float32, r_max=8, ranks=(3, 8))
    y_small = y.clone()
    lora_apply_ref(y, x, sl, a, b, sc)
    lora_apply_ref(y_small, x, sl, a[:, :3].clone(), b[:, :, :3].clone(), sc)
    torch.testing.assert_close(y[:2], y_small[:2], atol=1e-6, rtol=1e-6)


def test_twin_adds_the_delta_rounded_to_bfloat16():
    _, y, x, sl, a, b, sc = case([1, -1, 0], 16, 12, torch.bfloat16)
    y0 = y.clone()
    lora_apply_ref(y, x, sl, a, b, sc)
    delta = oracle(torch.zeros_like(y0, dtype=torch.float32), x, sl, a, b, sc)
    expected = y0.float() + delta.to(torch.bfloat16).float()
    torch.testing.assert_close(y.float(), expected.to(torch.bfloat16).float(), atol=0.02, rtol=0)


# ---- the C kernel and the chooser ------------------------------------------------------

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler")
SHAPES = [(40, 50), (64, 128)]  # (in, out): with and without a tail beyond 16 lanes
SLOTS = [MIXED, [1], [-1], [0] * 5 + [1] * 4, [-1, 2, -1, 2]]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("slots", SLOTS)
def test_c_kernel_matches_twin(dtype, shape, slots):
    run_against_twin(lora_apply_native, slots, *shape, dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r_max", [16, 32])
def test_c_kernel_matches_twin_when_slots_have_few_rows(dtype, r_max):
    # slots 0 and 1 (<= 4 rows) read B by rows, slot 2 (5 rows) transposes it; 40 = 16+16+8
    slots = [0, 1, -1, 1, 2, 2, 2, 2, 2]
    run_against_twin(lora_apply_native, slots, 48, 40, dtype, r_max=r_max, ranks=(r_max, 5))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_takes_an_odd_rank(dtype):
    run_against_twin(lora_apply_native, MIXED, 40, 50, dtype, r_max=5, ranks=(5, 3))


def stored_transposed(b):
    """b [S, out, r] as a view of [S, r, out] memory (the expand's natural layout)."""
    return b.transpose(1, 2).contiguous().transpose(1, 2)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_reads_b_stored_transposed_in_place(dtype):
    def path(y, x, sl, a, b, sc):
        lora_apply_native(y, x, sl, a, stored_transposed(b), sc)

    run_against_twin(path, MIXED, 48, 40, dtype)


@needs_native
def test_c_kernel_takes_float32_weights_with_bfloat16_activations():
    run_against_twin(lora_apply_native, MIXED, 48, 32, torch.bfloat16, wdtype=torch.float32)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_matches_twin_on_a_threaded_batch(dtype):
    # runs, plus stragglers; > 2**20 multiply-adds, so the kernel splits the tokens
    slots = [(t // 9) % 4 - 1 for t in range(200)] + [3, 0, 3, 1]
    run_against_twin(lora_apply_native, slots, 256, 256, dtype, num_slots=4, r_max=16,
                     ranks=(16, 8))  # fmt: skip


@needs_native
@pytest.mark.parametrize(("dtype", "wdtype"), [(BF16, BF16), (BF16, F32), (F32, F32)])
def test_c_kernel_built_without_avx512_matches_twin(tmp_path, dtype, wdtype):
    """The portable build (no AVX-512, no AVX512-BF16 dot products, no OpenMP)."""
    target = tmp_path / "lora_portable.so"
    cmd = [shutil.which("cc") or "gcc", *native_build.BASE_FLAGS, "-mno-avx512f", "-o",
           str(target), str(native_build.CSRC / "lora.c"), "-lm"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    lib = ctypes.CDLL(str(target))
    lib.epd_lora_apply.argtypes = native_build.ARGTYPES["epd_lora_apply"]
    lib.epd_lora_apply.restype = ctypes.c_int
    path = functools.partial(lora_apply_native, lib=lib)
    run_against_twin(path, MIXED + [0] * 6, 40, 50, dtype, wdtype=wdtype, r_max=16, ranks=(16, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chooser_matches_twin(dtype):
    run_against_twin(lora_apply, MIXED, 40, 50, dtype)


@pytest.mark.parametrize("tokens", [0, 1])
def test_chooser_handles_zero_and_one_token(tokens):
    run_against_twin(lora_apply, [1] * tokens, 32, 16, torch.float32)


def test_chooser_takes_int64_slots_and_a_non_contiguous_x():
    _, y, x, sl, a, b, sc = case(MIXED, 32, 24, torch.float32)
    x_wide = torch.stack([x, -x], dim=2).flatten(1)[:, ::2]  # x, with stride 2 in the last dim
    assert torch.equal(x_wide, x) and x_wide.stride(1) == 2
    y_ref = y.clone()
    lora_apply_ref(y_ref, x, sl, a, b, sc)
    lora_apply(y, x_wide, sl.long(), a, b, sc)
    assert_matches_twin(y, y_ref)


# ---- bad arguments ---------------------------------------------------------------------


def bad(**change):
    _, y, x, sl, a, b, sc = case(MIXED, 16, 12, torch.float32)
    args = dict(y=y, x=x, slots=sl, a_stack=a, b_stack=b, scaling=sc)
    args.update(change)
    return args


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(slots=torch.tensor(MIXED[:-1], dtype=torch.int32)), "same number of tokens"),
        (dict(slots=torch.tensor([3] + MIXED[1:], dtype=torch.int32)), r"in 0\.\.2"),
        (dict(slots=torch.tensor([-2] + MIXED[1:], dtype=torch.int32)), r"-1 \(no adapter\)"),
        (dict(slots=torch.zeros(len(MIXED))), "int32 or int64"),
        (dict(x=torch.randn(len(MIXED), 17)), "a_stack must have shape"),
        (dict(y=torch.randn(len(MIXED), 13)), "b_stack must have shape"),
        (dict(y=torch.randn(len(MIXED), 12, dtype=torch.float64)), "y has unsupported dtype"),
        (dict(y=torch.randn(len(MIXED), 12).bfloat16()), "y dtype"),
        (dict(a_stack=torch.zeros(3, 8, 16).bfloat16()), "b_stack dtype"),
        (dict(scaling=torch.ones(3, dtype=torch.float64)), "scaling must be a float32"),
        (dict(scaling=torch.ones(2)), "scaling must have shape"),
        (dict(y=torch.randn(12, len(MIXED)).T), "contiguous last dimension"),
        (dict(y=torch.randn(len(MIXED), 12, 1)), "y must have 2 dims"),
        (dict(x=torch.randn(len(MIXED), 16, 1)), "x must have 2 dims"),
        (dict(a_stack=torch.randn(3, 8, 16)[None]), "a_stack must have 3 dims"),
        (dict(scaling=[1.0, 1.0, 1.0]), "scaling must be a float32"),
    ],
)
def test_chooser_rejects_bad_arguments_and_writes_nothing(change, message):
    args = bad(**change)
    y0 = args["y"].clone()
    with pytest.raises(ValueError, match=message):
        lora_apply(**args)
    assert torch.equal(args["y"], y0)


# ---- Triton (interpreted: tiny shapes) -------------------------------------------------


# the interpreter's bfloat16 casts are not the GPU's (FACTS.md): a looser check there (it still
# catches a wrong slot, row or column); bench/lora_kernels.py --gpu checks bfloat16 on CUDA
TRITON_TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (0.05, 2**-6),  # about an ulp of the delta
}


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", list(TRITON_TOL))
@pytest.mark.parametrize("slots", [MIXED, [-1], [1] * 18 + [0]])
def test_triton_matches_twin(dtype, slots):
    from epdserve.kernels.lora_triton import lora_apply_triton

    wide, y, x, sl, a, b, sc = case(slots, 40, 24, dtype, y_cols=(3, 5))
    before = wide.clone()
    ref = y.clone()
    lora_apply_ref(ref, x, sl, a, b, sc)
    lora_apply_triton(y, x, sl, a, b, sc)
    atol, rtol = TRITON_TOL[dtype]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol)
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(wide[:, -5:], before[:, -5:])
    assert torch.equal(wide[sl < 0], before[sl < 0])
    y2 = case(slots, 40, 24, dtype, y_cols=(3, 5))[1]
    lora_apply_triton(y2, x, sl, a, stored_transposed(b), sc)  # the same sums, other strides
    assert torch.equal(y2, y)


@pytest.mark.usefixtures("interpreted")
def test_triton_leaves_rows_of_a_slot_outside_the_stack_untouched():
    from epdserve.kernels.lora_triton import lora_apply_triton

    _, y, x, sl, a, b, sc = case([9, -1, 0], 32, 24, torch.float32)
    ref = y.clone()
    lora_apply_triton(y, x, sl, a, b, sc)
    lora_apply_ref(ref, x, torch.tensor([-1, -1, 0], dtype=torch.int32), a, b, sc)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
