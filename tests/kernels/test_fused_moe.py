"""fused_moe: the twin against a per-token loop, and the grouped CPU path and the Triton kernel
(interpreted) against the twin, with experts that get no token and top-k above 1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.kernels.backends import get_backend
from epdserve.kernels.linear import pack, packing_enabled
from epdserve.kernels.moe_ref import fused_moe_grouped, fused_moe_ref

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def moe_case(tokens, hidden, inter, experts, top_k, dtype=torch.float32, idle=(), seed=0):
    """Inputs of one call; the experts in ``idle`` are picked by no token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, list(idle)] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return x, w13, w2, weights, ids


def per_token_loop(x, w13, w2, weights, ids):
    """The definition, one (token, expert) pair at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


def test_twin_is_the_per_token_definition():
    case = moe_case(9, 32, 24, 5, 2, idle=(3,))
    torch.testing.assert_close(
        fused_moe_ref(*case).double(), per_token_loop(*case), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (7, 2), (33, 3)])
def test_grouped_path_equals_the_twin(dtype, tokens, top_k):
    case = moe_case(tokens, 48, 40, 6, top_k, dtype, idle=(1, 4))
    torch.testing.assert_close(fused_moe_grouped(*case), fused_moe_ref(*case), atol=0, rtol=0)


def test_grouped_path_takes_prepacked_bf16_experts():
    x, w13, w2, weights, ids = moe_case(20, 64, 32, 4, 2, torch.bfloat16, idle=(2,))
    if not packing_enabled(w13[0]):
        pytest.skip("no oneDNN bf16 on this CPU: nothing is packed")
    packed13, packed2 = [pack(w) for w in w13.unbind(0)], [pack(w) for w in w2.unbind(0)]
    assert packed13[0].is_mkldnn
    got = fused_moe_grouped(x, packed13, packed2, weights, ids)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "top_k", "idle"), [(1, 2, ()), (21, 2, (0, 3)), (5, 4, (5,))])
def test_triton_equals_the_twin(dtype, tokens, top_k, idle):
    from epdserve.kernels.moe_triton import fused_moe_triton

    case = moe_case(tokens, 40, 24, 6, top_k, dtype, idle=idle)  # neither a power of two
    got = fused_moe_triton(*case)
    assert got.dtype == dtype and got.shape == case[0].shape
    tol = TOL[dtype]
    torch.testing.assert_close(got, fused_moe_ref(*case), atol=tol, rtol=tol)


@pytest.mark.usefixtures("interpreted")
def test_triton_tiles_hold_one_expert_each_padded_to_the_block():
    from epdserve.kernels.moe_triton import sort_pairs_by_expert

    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5; expert 1 gets none
    pairs, tile_expert = sort_pairs_by_expert(ids, 4, block_m=4)
    pad = 6
    assert pairs.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert tile_expert.tolist() == [0, 2, 3, -1, -1, -1]  # ceil(6 / 4) + 4 tiles at most
    assert set(pairs.tolist()[12:]) == {pad}


@pytest.mark.parametrize("name", ["torch", "native"])
def test_backends_dispatch_fused_moe(name):
    case = moe_case(6, 32, 16, 3, 2)
    torch.testing.assert_close(get_backend(name).fused_moe(*case), fused_moe_ref(*case))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: (c[0][:, :-1], *c[1:]), "do not fit"),
        (lambda c: (c[0], c[1], c[2][:2], *c[3:]), "3 gate/up experts but 2 down"),
        (lambda c: (*c[:3], c[3][:, :1], c[4]), "both be \\[T, k\\]"),
        (lambda c: (*c[:4], c[4].float()), "int32 or int64"),
        (lambda c: (c[0].double(), *c[1:]), "weights are"),
    ],
)
def test_bad_arguments_are_refused_naming_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        fused_moe_ref(*change(moe_case(4, 16, 8, 3, 2)))
