"""kernels.linear: bf16 weights prepacked for oneDNN give F.linear's products, within bf16
rounding on every CPU (bit-equality with F.linear holds on the AVX512_BF16 machines measured,
but depends on which oneDNN kernel each path takes, so it is not asserted)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epdserve.engine.models.loader import load_model
from epdserve.kernels.linear import is_packed, linear, pack, packing_enabled

needs_packing = pytest.mark.skipif(
    not packing_enabled(torch.zeros(1, 1, dtype=torch.bfloat16)),
    reason="torch's oneDNN has no bf16 on this CPU",
)


def close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b=None) -> None:
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    if want.numel() == 0:
        return
    # bf16 output rounding (2^-8 relative) plus bf16-vs-fp32 accumulation order
    tol = 2**-7 * want.abs() + 1e-2 * want.abs().max()
    assert (got.float() - want).abs().le(tol).all()


@needs_packing
@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_a_packed_bf16_weight_gives_the_products_of_the_plain_one(rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(384, 256, generator=g) / 16).bfloat16()
    b = torch.randn(384, generator=g).bfloat16()
    x = torch.randn(rows, 512, generator=g).bfloat16()[:, ::2]  # a strided view, as slices are
    packed = pack(w)
    assert is_packed(packed) and packed.shape == w.shape
    out = linear(x, packed, b)
    assert out.shape == (rows, 384) and out.dtype == torch.bfloat16
    close_to_fp32(out, x, w, b)
    close_to_fp32(linear(x, packed), x, w)


def test_what_is_not_bf16_on_the_cpu_stays_plain(monkeypatch):
    w32 = torch.randn(8, 4)
    assert pack(w32) is w32 and not is_packed(w32)
    assert torch.equal(linear(torch.ones(2, 4), w32), F.linear(torch.ones(2, 4), w32))
    assert pack(None) is None
    monkeypatch.setenv("EPDSERVE_PACKED_LINEAR", "0")
    w16 = w32.bfloat16()
    assert pack(w16) is w16


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_bf16_model_loads_packed_and_a_tied_head_stays_the_plain_embedding(
    arch, models, monkeypatch
):
    path = str(models.get(arch))
    model = load_model(path, torch.bfloat16, torch.device("cpu"), 256)
    layer = model.layers[0]
    assert all(is_packed(w) for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w))
    if model.config.tie_word_embeddings:
        assert model.lm_head is model.embed and not is_packed(model.lm_head)
    else:
        assert is_packed(model.lm_head)
    monkeypatch.setenv("EPDSERVE_PACKED_LINEAR", "0")
    plain = load_model(path, torch.bfloat16, torch.device("cpu"), 256)
    assert not is_packed(plain.layers[0].qkv_w)
    x = torch.randn(5, model.config.hidden_size).bfloat16()
    close_to_fp32(linear(x, layer.gate_up_w), x, plain.layers[0].gate_up_w)
