"""LoRA adapters in the engine: each adapter's greedy output equals a PEFT-merged transformers
reference token for token (fp32), in one batch with the base model and other adapters, under
chunked prefill, slot eviction, preemption and prefix hits; adapters never share KV."""

from __future__ import annotations

import random

import pytest
import torch
from conftest_helpers import assert_no_leak

from epdserve.engine import LLM, LoRARequest, SamplingParams
from epdserve.engine.lora.random_adapters import write_random_adapters

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
BLOCK_BYTES_TINY = 4 * 2 * 16 * 2 * 32 * 4


@pytest.fixture(scope="module")
def llama(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def loras(llama, tmp_path_factory):
    paths = write_random_adapters(llama, 3, out=tmp_path_factory.mktemp("loras"))
    return [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]


@pytest.fixture(scope="module")
def prompts():
    """Lengths just short of a block boundary (16): decoding needs a new block, so a small
    cache preempts; two prompts share a 32-token prefix."""
    rng = random.Random(3)
    prefix = [rng.randrange(10, 4000) for _ in range(32)]
    bodies = [[rng.randrange(10, 4000) for _ in range(n)] for n in (13, 13, 30, 30)]
    return [bodies[0], prefix + bodies[1], bodies[2], prefix + bodies[3]]


def peft_greedy(model_dir, adapter_dir, prompts) -> list[list[int]]:
    """Greedy continuations of transformers with the adapter merged by peft (None: base)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, max_new_tokens=MAX_NEW, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def expected(llama, loras, prompts):
    """Per adapter (None first: the base model), the reference continuation of each prompt."""
    return {
        None: peft_greedy(llama, None, prompts),
        **{lora.lora_name: peft_greedy(llama, lora.lora_path, prompts) for lora in loras},
    }


def mixed_batch(prompts, loras):
    """Every prompt with the base model and with every adapter, interleaved."""
    pairs = [(p, lora) for p in prompts for lora in [None, *loras]]
    return [{"prompt_token_ids": p} for p, _ in pairs], [lora for _, lora in pairs]


def check(outs, lora_list, prompts, expected):
    n = 1 + len(set(lora_list) - {None})
    for i, (out, lora) in enumerate(zip(outs, lora_list, strict=True)):
        want = expected[lora.lora_name if lora else None][i // n]
        assert out.outputs[0].token_ids == want, f"request {i} ({lora and lora.lora_name})"


REGIMES = {
    "chunked-prefill": dict(max_num_batched_tokens=16, max_loras=3),
    "slot-eviction": dict(max_loras=1, max_cpu_loras=1),
    "preemption": dict(max_loras=2, kv_cache_memory=14 * BLOCK_BYTES_TINY, max_model_len=192),
}


@pytest.mark.parametrize("regime", REGIMES)
def test_mixed_batch_matches_peft_merged_reference(llama, loras, prompts, expected, regime):
    assert len({tuple(map(tuple, v)) for v in expected.values()}) == 4, "adapters change outputs"
    llm = LLM(model=str(llama), dtype="float32", block_size=16, enable_lora=True, **REGIMES[regime])
    batch, lora_list = mixed_batch(prompts, loras)
    check(llm.generate(batch, GREEDY, lora_request=lora_list), lora_list, prompts, expected)
    assert_no_leak(llm)
    manager = llm.engine.lora
    assert len(manager.slots) <= manager.max_loras
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if regime == "chunked-prefill":  # again: prefix hits, each within its own adapter
        outs = llm.generate(batch, GREEDY, lora_request=lora_list)
        check(outs, lora_list, prompts, expected)
        assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 16)
        assert_no_leak(llm)


def test_two_adapters_never_share_prefix_blocks(llama, loras):
    llm = LLM(model=str(llama), dtype="float32", block_size=16, enable_lora=True, max_loras=2)
    prompt = [{"prompt_token_ids": list(range(10, 74))}]  # four full blocks
    first = llm.generate(prompt, GREEDY, lora_request=loras[0])[0]
    other = llm.generate(prompt, GREEDY, lora_request=loras[1])[0]
    base = llm.generate(prompt, GREEDY)[0]
    again = llm.generate(prompt, GREEDY, lora_request=loras[0])[0]
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert len(llm.engine.kv.pool.cached) == 3 * 4  # one chain per adapter and the base
    assert_no_leak(llm)


def test_kv_events_carry_the_adapter_id_and_name(llama, loras, tmp_path):
    from epdserve.connectors.kv_events import to_wire_event

    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    events["endpoint"] = f"ipc://{tmp_path}/ev.ipc"
    llm = LLM(
        model=str(llama), dtype="float32", block_size=16, enable_lora=True, kv_events_config=events
    )
    prompt = [{"prompt_token_ids": list(range(10, 42))}]
    llm.generate(prompt, GREEDY, lora_request=loras[2])
    llm.generate(prompt, GREEDY)
    stored = [to_wire_event(e) for e in llm.engine.take_events()]
    stored = [e for e in stored if type(e).__name__ == "BlockStored"]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(3, "lora2"), (None, None)]
    assert stored[0].extra_keys[0] == ("lora2",)
    assert stored[1].extra_keys == [None, None]


def test_unreadable_adapter_fails_its_request_only(llama, loras, tmp_path):
    llm = LLM(model=str(llama), dtype="float32", block_size=16, enable_lora=True)
    missing = LoRARequest("gone", 9, str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, lora_request=missing)
    with pytest.raises(ValueError, match="LoRA is off"):
        LLM(model=str(llama), dtype="float32").generate("hi", GREEDY, lora_request=loras[0])
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, lora_request=loras[0])
    assert len(out[0].outputs[0].token_ids) == MAX_NEW
    assert_no_leak(llm)


def test_loading_many_adapters_in_turn_leaks_nothing(llama, loras):
    llm = LLM(
        model=str(llama),
        dtype="float32",
        block_size=16,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
    )
    prompt = [{"prompt_token_ids": list(range(20, 45))}] * 2
    short = SamplingParams(temperature=0.0, max_tokens=2)
    for i in range(8):  # a new id each time: as a pod loading and unloading adapters
        lora = LoRARequest(f"turn{i}", 100 + i, loras[i % 3].lora_path)
        llm.generate(prompt, short, lora_request=[lora, None])
    manager = llm.engine.lora
    assert len(manager.slots) == 2 and len(manager.host) <= 3 and not manager.loading
    assert_no_leak(llm)


def test_gemma3_adapters_match_peft_merged_reference(models, tmp_path):
    """Gemma3's decoder (q/k norms, GeGLU, sandwich norms) under the image+text model's key
    prefix (``...model.language_model.layers``): the tiny model's greedy tokens barely move,
    so its top log-probabilities are compared, with the adapter and without."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    path = models.get("gemma3")
    lora = LoRARequest("g0", 1, str(write_random_adapters(path, 1, out=tmp_path)[0]))
    prompt = list(range(40, 70))
    ids = torch.tensor([prompt])
    want = []
    for adapter in (lora.lora_path, None):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        with torch.inference_mode():
            want.append(model(ids).logits[0, -1].log_softmax(-1).topk(4))
    llm = LLM(model=str(path), dtype="float32", block_size=16, enable_lora=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=4)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, one, lora_request=[lora, None])
    for out, (values, indices) in zip(outs, want, strict=True):
        got = out.outputs[0].logprobs[0]
        assert list(got) == indices.tolist()
        assert [got[t].logprob for t in got] == pytest.approx(values.tolist(), abs=1e-4)
    assert not torch.equal(want[0].values, want[1].values)
    assert_no_leak(llm)
