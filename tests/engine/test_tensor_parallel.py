"""Tensor parallelism (DESIGN.md §10): a worker process per rank, each holding its slice of the
model. At TP 2 greedy outputs equal transformers' (fp32) and TP 1's, token for token, under
chunked prefill, prefix hits and preemption; LoRA adapters, structured outputs, seeded
sampling, logprobs and images (encoded on the output rank) give what TP 1 gives."""

from __future__ import annotations

import random

import pytest
import torch
from conftest_helpers import MAX_NEW, assert_no_leak, make_prompts
from PIL import Image

from epdserve.engine import LLM, LoRARequest, SamplingParams
from epdserve.engine.lora.random_adapters import write_random_adapters
from epdserve.engine.structured import StructuredOutputsParams as SO

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# the tiny preset's block at TP 2: layers * K/V * block * (2 kv heads / 2) * head dim * fp32
RANK_BLOCK_BYTES = 4 * 2 * 16 * 1 * 32 * 4
# chunked prefill (16-token steps), prefix caching, and a cache too small for every prompt
TIGHT = dict(max_num_batched_tokens=16, kv_cache_memory=14 * RANK_BLOCK_BYTES, max_model_len=192)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


# qwen2 and qwen3 (bias, q/k norms) run in CI after make test: ~30 s each on 2 cores
@pytest.mark.parametrize(
    "arch", ["llama", *(pytest.param(a, marks=pytest.mark.slow) for a in ("qwen2", "qwen3"))]
)
def test_tp2_greedy_equals_transformers_chunked_preempted_and_cached(models, hf_reference, arch):
    path = models.get(arch)
    prompts = make_prompts(8)
    expected = hf_reference.greedy(path, prompts)
    llm = LLM(model=str(path), dtype="float32", tensor_parallel_size=2, **TIGHT)
    assert llm.engine.executor.size == 2
    inputs = [{"prompt_token_ids": p} for p in prompts]
    assert tokens(llm.generate(inputs, GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(inputs, GREEDY)  # now from the prefix cache
    assert tokens(again) == expected
    assert any(o.num_cached_tokens > 0 for o in again)
    assert_no_leak(llm)
    llm.engine.close()


def test_tp2_gemma3_text_and_images_equal_tp1(models):
    path = models.get("gemma3")
    prompts = make_prompts(4, seed=2)  # longer than the sliding window (32)
    image = Image.new("RGB", (80, 50), (200, 10, 30))
    chat = [
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": t}],
            }
        ]
        for t in ("what is it " * 3, "describe the picture " * 4)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(
            model=str(path), max_model_len=512, max_num_batched_tokens=16, tensor_parallel_size=tp
        )
        text = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
        results.append((text, tokens(llm.chat(chat, params)), llm.engine.stats().encoder_runs))
        assert_no_leak(llm)
        llm.engine.close()
    assert results[1] == results[0]
    assert results[1][2] == 1  # one image, encoded once, by the output rank


def test_tp2_lora_structured_sampling_and_logprobs_equal_tp1(models, tmp_path):
    path = models.get("llama")
    adapters = write_random_adapters(path, 2, out=tmp_path)
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(adapters)]
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 4000) for _ in range(n)] for n in (13, 30, 45)]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    runs = []
    for tp in (1, 2):
        llm = LLM(
            model=str(path), dtype="float32", max_model_len=256, enable_lora=True, max_loras=2,
            max_num_batched_tokens=32, tensor_parallel_size=tp,
        )  # fmt: skip
        inputs = [{"prompt_token_ids": p} for p in prompts]
        with_lora = [tokens(llm.generate(inputs, GREEDY, lora_request=lr)) for lr in loras]
        seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=MAX_NEW, logprobs=3)
        sampled = llm.generate(inputs, seeded)
        logprobs = [
            [{t: round(lp.logprob, 3) for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in sampled
        ]
        json_out = (
            llm.generate(
                ["Give me a"],
                SamplingParams(max_tokens=40, structured_outputs=SO(json=schema), temperature=0),
            )[0]
            .outputs[0]
            .text
        )
        runs.append((with_lora, tokens(sampled), logprobs, json_out))
        assert_no_leak(llm)
        llm.engine.close()
    assert runs[1][0] == runs[0][0], "LoRA outputs differ at TP 2"
    assert runs[1][1] == runs[0][1], "seeded samples differ at TP 2"
    assert runs[1][2] == runs[0][2], "logprobs differ at TP 2"
    assert runs[1][3] == runs[0][3], "structured output differs at TP 2"
    assert runs[0][0][0] != runs[0][0][1]  # the adapters change the output


def test_tp4_replicates_kv_heads_and_equals_transformers(models, hf_reference):
    """The tiny preset has 2 KV heads: at TP 4 each is kept by two ranks."""
    path = models.get("llama")
    prompts = make_prompts(3)
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, tensor_parallel_size=4)
    assert tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == (
        hf_reference.greedy(path, prompts)
    )
    llm.engine.close()


def test_a_tp_that_does_not_divide_the_heads_is_refused_naming_the_flag(models):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        LLM(model=str(models.get("llama")), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="distributed_executor_backend: uni runs one rank"):
        LLM(
            model=str(models.get("llama")),
            tensor_parallel_size=2,
            distributed_executor_backend="uni",
        )


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_tp2_on_two_gpus_equals_transformers(models, hf_reference):
    """NCCL ranks, a GPU each: the same tokens as transformers (fp32)."""
    path = models.get("llama")
    prompts = make_prompts(4)
    llm = LLM(model=str(path), dtype="float32", device="cuda", tensor_parallel_size=2)
    assert tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)) == (
        hf_reference.greedy(path, prompts)
    )
    llm.engine.close()
