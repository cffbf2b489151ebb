"""Quantized checkpoints (GPTQ, AWQ, block FP8, compressed-tensors FP8), written by the test in
each format's on-disk layout from a tiny random checkpoint: the engine (fp32) generates, token for token, what transformers generates from a plain fp32
checkpoint of the dequantized weights, under chunked prefill and a prefix-cache hit; at TP 2
too. In fp32 the int4 products dequantize per product, bit for bit the reference's weights
(bf16 models run torch's packed int4 kernel: tests/kernels/test_quant_kernels.py); fp8 weights are dequantized at load on the CPU, or kept in fp8 and
upcast per product (``EPDSERVE_FP8_CPU_WEIGHTS=fp8``, the ``-kept`` cases)."""

from __future__ import annotations

import pytest
import torch
from conftest_helpers import MAX_NEW, assert_no_leak, make_prompts

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.models.loader import load_model
from epdserve.engine.models.quant.write import write_quantized
from epdserve.kernels.linear import linear
from epdserve.kernels.quant_linear import FP8Weight, Int4Weight

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
CPU = torch.device("cpu")

# (architecture, format, writer options, the weight kind it loads as: fp8 stays fp8 on the
# CPU with EPDSERVE_FP8_CPU_WEIGHTS=fp8, else it is dequantized to the model dtype at load)
FORMATS = {
    "gptq-sym": ("llama", "gptq", {}, Int4Weight),
    "gptq-asym": ("qwen3", "gptq", {"sym": False}, Int4Weight),
    "awq": ("qwen2", "awq", {}, Int4Weight),
    "fp8-block-kept": ("qwen3", "fp8", {}, FP8Weight),
    "ct-fp8-channel": ("llama", "compressed-tensors", {"strategy": "channel"}, torch.Tensor),
    "ct-fp8-tensor-static-kept": (
        "qwen2",
        "compressed-tensors",
        {"strategy": "tensor", "static": True},
        FP8Weight,
    ),
}
SLOW = {
    "gptq-asym",
    "ct-fp8-tensor-static-kept",
}  # the same code paths as the others, in CI's slow run


def written(models, tmp_path, key: str):
    """``(quantized dir, dequantized fp32 dir)`` of ``FORMATS[key]``."""
    arch, method, opts, _ = FORMATS[key]
    src = models.get(arch)
    dst, deq = tmp_path / key, tmp_path / f"{key}-dequantized"
    write_quantized(src, dst, method, dequantized=deq, **opts)
    return dst, deq


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(
    "key", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in FORMATS]
)
def test_a_quantized_checkpoint_generates_what_transformers_does_with_its_dequantized_weights(
    models, hf_reference, tmp_path, key, monkeypatch
):
    if key.endswith("-kept"):
        monkeypatch.setenv("EPDSERVE_FP8_CPU_WEIGHTS", "fp8")
    path, dequantized = written(models, tmp_path, key)
    prompts = make_prompts(6, seed=3)
    expected = hf_reference.greedy(dequantized, prompts)
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, max_num_batched_tokens=16)
    layer = llm.engine.executor.worker.model.layers[0]
    assert all(isinstance(w, FORMATS[key][3]) for w in (layer.qkv_w, layer.gate_up_w, layer.o_w))
    inputs = [{"prompt_token_ids": p} for p in prompts]
    assert tokens(llm.generate(inputs, GREEDY)) == expected  # chunked prefill (16-token steps)
    again = llm.generate(inputs, GREEDY)
    assert tokens(again) == expected
    assert any(o.num_cached_tokens > 0 for o in again)  # served from the prefix cache
    assert_no_leak(llm)


def test_a_gptq_checkpoint_at_tp2_generates_what_transformers_does(models, hf_reference, tmp_path):
    src = models.get("llama")
    path, deq = tmp_path / "g64", tmp_path / "g64-deq"
    write_quantized(src, path, "gptq", dequantized=deq, group=64, sym=False)  # 64: whole groups
    prompts = make_prompts(4, seed=4)
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, max_model_len=256)
    assert tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == (
        hf_reference.greedy(deq, prompts)
    )
    llm.engine.close()


def test_a_rank_slice_of_a_quantized_weight_is_the_slice_of_its_dequantized_weight(
    models, tmp_path
):
    from epdserve.engine.models.config import load_model_config
    from epdserve.engine.models.layers import Shard, ShardedWeights
    from epdserve.engine.models.loader import CheckpointReader
    from epdserve.engine.models.quant import resolve

    path, deq = tmp_path / "g64", tmp_path / "g64-deq"
    write_quantized(models.get("llama"), path, "gptq", dequantized=deq, group=64)
    cfg = load_model_config(path)
    quant, reader, plain = resolve(cfg.quantization), CheckpointReader(path), CheckpointReader(deq)
    p = "model.layers.1."
    for rank in (0, 1):
        w = ShardedWeights(reader, "model.", cfg, Shard(rank, 2), torch.float32, CPU, quant)
        ref = ShardedWeights(plain, "model.", cfg, Shard(rank, 2), torch.float32, CPU)
        down = w.row("layers.1.mlp.down_proj.weight", cfg.intermediate_size)
        assert isinstance(down, Int4Weight) and down.shape == (128, 192)
        torch.testing.assert_close(
            down.dequantize(), ref.row("layers.1.mlp.down_proj.weight", 384), rtol=0, atol=1e-6
        )
        qkv = w.qkv(p[len("model.") :] + "self_attn.")
        torch.testing.assert_close(
            qkv.dequantize(), ref.qkv("layers.1.self_attn."), rtol=0, atol=1e-6
        )


def test_fused_row_spans_of_a_quantized_weight_are_the_dequantized_spans(models, tmp_path):
    from epdserve.engine.models.config import load_model_config
    from epdserve.engine.models.layers import Shard, ShardedWeights
    from epdserve.engine.models.loader import CheckpointReader
    from epdserve.engine.models.quant import resolve

    path, deq = tmp_path / "fp8", tmp_path / "fp8-deq"
    write_quantized(models.get("llama"), path, "fp8", dequantized=deq)
    cfg = load_model_config(path)
    w = ShardedWeights(CheckpointReader(path), "model.", cfg, Shard(), torch.float32, CPU,
                       resolve(cfg.quantization))  # fmt: skip
    plain = ShardedWeights(CheckpointReader(deq), "model.", cfg, Shard(), torch.float32, CPU)
    name, spans = "layers.0.mlp.up_proj.weight", [(0, 32), (300, 384)]
    got = w.fused_rows(name, spans)
    assert isinstance(got, FP8Weight) and isinstance(w.full(name), FP8Weight)
    assert torch.equal(got.dequantize(), plain.fused_rows(name, spans))
    assert torch.equal(w.full(name).dequantize(), plain.full(name))
    with pytest.raises(ValueError, match="is stored quantized .fp8. but was read as a plain"):
        w.reader.get_slice("model." + name)  # what an architecture reading it directly gets


def test_a_rank_slice_that_splits_a_quantization_group_is_refused(models, tmp_path):
    path = write_quantized(models.get("llama"), tmp_path / "g128", "gptq")  # o: 128 = one group
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide .*groups of 128"):
        LLM(model=str(path), dtype="float32", tensor_parallel_size=2)


def weight_bytes(model) -> int:
    """Bytes of the decoder layers' matrix-product weights."""
    total = 0
    for layer in model.layers:
        for w in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w):
            total += w.nbytes if hasattr(w, "tensors") else w.numel() * w.element_size()
    return total


def test_int4_weights_take_about_a_quarter_of_the_bf16_weights_memory(
    models, tmp_path, monkeypatch
):
    monkeypatch.setenv("EPDSERVE_PACKED_LINEAR", "0")  # plain bf16 tensors: numel * 2 bytes
    src = models.get("qwen3")
    deq = tmp_path / "dequantized"
    path = write_quantized(src, tmp_path / "gptq", "gptq", dequantized=deq, dtype=torch.bfloat16)
    bf16 = weight_bytes(load_model(src, torch.bfloat16, CPU, 256))
    int4_model = load_model(path, torch.bfloat16, CPU, 256)
    gate_up = int4_model.layers[0].gate_up_w
    assert isinstance(gate_up, Int4Weight) and gate_up.packed is not None  # the CPU kernel's
    x = torch.randn(4, 128)
    want = x @ load_model(deq, torch.float32, CPU, 256).layers[0].gate_up_w.T
    got = linear(x.bfloat16(), gate_up).float()
    assert ((got - want).abs() <= 2**-7 * want.abs() + 0.02 * want.abs().max()).all()
    ratio = weight_bytes(int4_model) / bf16
    # 4 bits a weight plus a bf16 scale and offset per 128: (64 + 4) / 256 bytes
    assert 0.25 <= ratio <= 0.27, ratio


def test_a_lora_adapter_over_an_int4_base_generates_what_it_does_over_the_dequantized_base(
    models, tmp_path
):
    from epdserve.engine import LoRARequest
    from epdserve.engine.lora.random_adapters import write_random_adapters

    path, deq = tmp_path / "gptq", tmp_path / "gptq-deq"
    write_quantized(models.get("llama"), path, "gptq", dequantized=deq)
    [adapter] = write_random_adapters(deq, 1, out=tmp_path / "loras")
    prompts = [{"prompt_token_ids": p} for p in make_prompts(3, seed=5)]
    got = {}
    for name, model in (("int4", path), ("dequantized", deq)):
        llm = LLM(model=str(model), dtype="float32", enable_lora=True, max_model_len=256)
        outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))
        got[name] = tokens(outs)
    assert got["int4"] == got["dequantized"]
