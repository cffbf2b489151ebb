"""``--kv-cache-dtype fp8``: the cache stores e4m3 (scale 1.0), half of bf16's bytes per block;
greedy outputs leave the full-precision run's only at near-ties; stored blocks carry the dtype,
so a pod with another KV dtype misses them (never refuses or misreads them); a bad value is
refused naming the setting."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest_helpers import MAX_NEW, assert_no_leak, make_prompts

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.kernels.backends import get_backend
from epdserve.kernels.fp8_kv import StoredKVDtype

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
# An fp8 run may take either of two tokens whose full-precision logits are this close, as a
# fraction of the logits' spread. Measured here (tiny presets, fp32, this test's prompts):
# 9 of 10 llama prompts fork, at gaps up to 0.063 of the spread, gemma2 1 of 10 at 0.021
# (qwen3, 20 other prompts: up to 0.17); fp8 rounding is the same on every CPU.
NEAR_TIE = 0.3
# nats between the runs' top-5 logprobs of the first token (measured: 0.031 and 0.064)
FIRST_STEP_LOGPROBS = 0.3


def cache_of(llm: LLM) -> torch.Tensor:
    return llm.engine.executor.worker.runner.kv_cache


def test_a_bad_kv_cache_dtype_is_refused_naming_the_setting(models, capsys):
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, fp8, fp8_e4m3"):
        EngineConfig(model=str(models.get("llama")), kv_cache_dtype="int8")
    from epdserve.engine.entrypoints import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_fp8_blocks_take_half_the_bytes_of_bf16_ones(models):
    path, memory = str(models.get("llama")), 64 * 4 * 2 * 16 * 2 * 32 * 2  # 64 bf16 blocks
    auto = LLM(model=path, dtype="bfloat16", kv_cache_memory=memory, max_model_len=256)
    fp8 = LLM(model=path, dtype="bfloat16", kv_cache_memory=memory, max_model_len=256,
              kv_cache_dtype="fp8")  # fmt: skip
    assert (auto.engine.num_blocks, fp8.engine.num_blocks) == (64, 128)
    assert (cache_of(auto).dtype, cache_of(fp8).dtype) == (torch.bfloat16, FP8)
    per_block = [c.nbytes // c.shape[0] for c in (cache_of(auto), cache_of(fp8))]
    assert per_block[1] * 2 == per_block[0]


@pytest.mark.parametrize(("arch", "backend"), [("llama", "native"), ("llama", "torch"),
                                               ("gemma2", None)])  # fmt: skip
def test_fp8_greedy_outputs_leave_fp32_only_at_near_ties(models, hf_reference, arch, backend):
    """fp32 weights, fp8 cache, against transformers' fp32 (the auto run's exact twin), with
    chunks and (gemma2) sliding windows over hybrid groups."""
    from epdserve.kernels import native

    if backend == "native" and not native.available():
        pytest.skip("no C compiler")
    path = models.get(arch)
    prompts = make_prompts(10, seed=3)
    expected = hf_reference.greedy(path, prompts)
    kw = dict(max_model_len=512, max_num_batched_tokens=64, attention_backend=backend)
    fp8 = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp8", **kw)
    assert cache_of(fp8).dtype == FP8
    outs = fp8.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [list(o.outputs[0].token_ids) for o in outs]
    forks = [(p, ours, theirs) for p, ours, theirs in zip(prompts, got, expected, strict=True)]
    forks = [(p, ours, theirs, at) for p, ours, theirs in forks if (at := fork(ours, theirs)) < 16]
    exact = hf_reference.next_logits(path, [p + ours[:at] for p, ours, _, at in forks])
    for (_, ours, theirs, at), logits in zip(forks, exact, strict=True):
        gap = (logits[ours[at]] - logits[theirs[at]]).abs().item()
        assert gap <= NEAR_TIE * logits.std().item(), f"step {at}: fp32 gap {gap:.4f}"
    auto = LLM(model=str(path), dtype="float32", **kw)
    firsts = auto.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for a, b in zip(firsts, outs, strict=True):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()) <= (
            FIRST_STEP_LOGPROBS
        )
    assert_no_leak(fp8)


def fork(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_the_fp8_cache_write_rounds_saturates_and_attention_reads_it_back():
    inner = get_backend("torch", "cpu")
    kernels = StoredKVDtype(inner)
    k_cache, v_cache = (torch.zeros(4, 4, 1, 8, dtype=FP8) for _ in range(2))
    key = torch.randn(5, 1, 8)
    key[0, 0, 0], key[1, 0, 0] = 1000.0, -1000.0  # past e4m3's +-448
    value = torch.randn(5, 1, 8)
    kernels.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([4, 5, 6, -1, 7]))
    stored = k_cache.float().reshape(-1, 1, 8)[4:8]
    assert stored[0, 0, 0] == 448.0 and stored[1, 0, 0] == -448.0
    assert torch.equal(stored[3], key[4].to(FP8).float()) and not stored.isnan().any()
    assert k_cache.float()[0].abs().sum() == 0  # slot -1: nothing written
    query = torch.randn(3, 2, 8)
    args = (torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
            torch.tensor([0, 3], dtype=torch.int32), 0.3)  # fmt: skip
    ours = kernels.paged_attention(query, k_cache, v_cache, *args)
    want = inner.paged_attention(query, k_cache.float(), v_cache.float(), *args)
    torch.testing.assert_close(ours, want, rtol=0, atol=0)


PROMPT = list(range(200, 250))  # 3 full 16-token blocks + 2 tokens
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def redis_pod(path, url: str, role: str, kv_cache_dtype: str) -> LLM:
    kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
    transfer = {"kv_connector": "RedisConnector", "kv_role": kv_role,
                "kv_connector_extra_config": {"url": url}}  # fmt: skip
    return LLM(path, max_model_len=256, hash_seed="7", role=role, kv_cache_dtype=kv_cache_dtype,
               kv_transfer_config=json.dumps(transfer))  # fmt: skip


@pytest.mark.parametrize(("stored", "other"), [("fp8", "auto"), ("auto", "fp8")])
def test_blocks_stored_in_one_kv_dtype_are_a_miss_for_a_pod_of_another(
    models, redis_url, stored, other
):
    """Through a real Redis: a pod of the other dtype loads nothing, refuses nothing, and
    computes the prompt itself; a pod of the same dtype loads the blocks and answers as the
    pod that stored them."""
    path = str(models.get("llama"))
    producer = redis_pod(path, redis_url, "prefill", stored)
    first = producer.generate({"prompt_token_ids": PROMPT}, ONE)[0].outputs[0].token_ids
    for kv_dtype, loads in ((other, 0), (stored, 49)):  # 3 blocks and the tail, all but one
        decoder = redis_pod(path, redis_url, "decode", kv_dtype)
        state = decoder.engine.scheduler.kv_transfer
        out = decoder.generate({"prompt_token_ids": PROMPT}, ONE)[0].outputs[0].token_ids
        assert (state.hits, state.load_failures) == (loads, 0), kv_dtype
        assert not decoder.engine.stats().store_rejections
        if loads:
            assert out == first  # the stored fp8 (or full-precision) KV, read as written
        assert_no_leak(decoder)
        decoder.engine.close()
    producer.engine.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_read_back_is_torchs_cast_bit_for_bit(dtype):
    """Every fp8 byte value, from one layer's strided view of a cross-layer cache."""
    from epdserve.kernels import native

    if not native.available():
        pytest.skip("no C compiler")
    raw = torch.arange(6 * 2 * 2 * 256) % 256  # each block: every byte value once
    cache = raw.to(torch.uint8).view(torch.float8_e4m3fn).view(6, 2, 2, 4, 4, 16)[:, 1, 0]
    ids = torch.tensor([5, 0, 2, 2, 4])
    assert native.fp8_blocks_supports(cache, dtype)
    ours, torchs = native.fp8_blocks(cache, ids, dtype), cache.index_select(0, ids).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(ours.view(bits), torchs.view(bits))
    with pytest.raises(IndexError, match="ids: a block is outside 0..5"):
        native.fp8_blocks(cache, torch.tensor([6]), dtype)


@pytest.mark.slow  # two worker processes
def test_fp8_at_tp2_equals_fp8_at_tp1(models):
    path, prompts = str(models.get("llama")), make_prompts(6)
    got = []
    for tp in (1, 2):
        llm = LLM(model=path, dtype="float32", max_model_len=512, kv_cache_dtype="fp8",
                  tensor_parallel_size=tp, max_num_batched_tokens=32)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        got.append([list(o.outputs[0].token_ids) for o in outs])
        assert_no_leak(llm)
        llm.engine.close()
    assert got[1] == got[0]
