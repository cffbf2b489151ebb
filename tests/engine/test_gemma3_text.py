"""Gemma3 (text path): greedy outputs equal transformers', sliding windows shorter than prompts."""

from __future__ import annotations

import pytest
import torch
from conftest_helpers import MAX_NEW, assert_no_leak, make_prompts

from epdserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_reference(models, hf_reference):
    path = models.get("gemma3")
    prompts = make_prompts(8, seed=2)
    return path, prompts, hf_reference.greedy(path, prompts)


BLOCK_BYTES = 2 * 16 * 2 * 64 * 4  # one layer per hybrid group: K/V * block * kv heads * dim * fp32
REGIMES = {
    "prefix-caching": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 16},
    # 60 blocks over 4 groups: the 8 prompts cannot all run at once
    "preemption": {"kv_cache_memory": 60 * BLOCK_BYTES, "max_model_len": 192},
    "one-group": {"disable_hybrid_kv_cache_manager": True},
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_gemma3_text_greedy_matches_transformers(gemma3_reference, regime):
    path, prompts, ref = gemma3_reference
    assert max(len(p) for p in prompts) > 32  # longer than the sliding window
    llm = LLM(model=str(path), **{"max_model_len": 512, **REGIMES[regime]})
    assert llm.engine.kv.num_groups == (1 if regime == "one-group" else 4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_no_leak(llm)
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_vision_encoder_matches_transformers_image_features(models):
    from transformers import AutoModelForImageTextToText

    from epdserve.engine.models.loader import load_vision_encoder

    path = models.get("gemma3")
    hf = AutoModelForImageTextToText.from_pretrained(path)
    encoder = load_vision_encoder(path, torch.float32, torch.device("cpu"))
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf.model.get_image_features(pixel_values=pixels)
    ref = getattr(ref, "pooler_output", ref)
    ours = encoder.encode(pixels)
    assert ours.shape == (2, hf.config.mm_tokens_per_image, hf.config.text_config.hidden_size)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_text_model_has_no_vision_encoder(models):
    from epdserve.engine.models.loader import load_vision_encoder

    assert load_vision_encoder(models.get("llama"), torch.float32, torch.device("cpu")) is None


def test_image_prompt_logits_match_transformers_with_bidirectional_image_span(models):
    """Direct model forward (no scheduler): image features at the placeholder positions."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from epdserve.engine.models.decoder import AttentionMetadata
    from epdserve.engine.models.loader import load_model, load_vision_encoder

    path = models.get("gemma3")
    proc = AutoProcessor.from_pretrained(path)
    hf = AutoModelForImageTextToText.from_pretrained(path)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "what is it " * 12}],
        }
    ]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = proc(
        text=text, images=[Image.new("RGB", (80, 50), (200, 10, 30))], return_tensors="pt"
    )
    with torch.inference_mode():
        ref = hf(**inputs).logits[0]
    ids = inputs.input_ids[0]
    model = load_model(path, torch.float32, torch.device("cpu"), 4096)
    encoder = load_vision_encoder(path, torch.float32, torch.device("cpu"))
    cfg, bs, t = model.config, 16, len(ids)
    nblocks = -(-t // bs)
    kv = torch.zeros(nblocks + 1, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim)
    caches = [(kv[:, i, 0], kv[:, i, 1]) for i in range(cfg.num_layers)]
    table = torch.arange(1, nblocks + 1, dtype=torch.int32)[None]
    pos = torch.arange(t)
    image = (ids == hf.config.image_token_index).nonzero()[:, 0]
    start, end = int(image[0]), int(image[-1]) + 1
    meta = AttentionMetadata(
        pos,
        table[0, pos // bs].long() * bs + pos % bs,
        table,
        torch.tensor([t], dtype=torch.int32),
        torch.tensor([0, t], dtype=torch.int32),
        ((0, start, end),),
    )
    embeds = model.embed_tokens(ids)
    embeds[start:end] = encoder.encode(inputs.pixel_values)[0]
    logits = model.compute_logits(model.forward(ids, meta, caches, inputs_embeds=embeds))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
