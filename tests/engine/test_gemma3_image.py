"""Gemma3 image+text through the engine: token-exact vs transformers, encoder cache, hashing."""

from __future__ import annotations

import pytest
import torch
from conftest_helpers import assert_no_leak
from PIL import Image

from epdserve.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
IMAGES = [Image.new("RGB", (80, 50), (200, 10, 30)), Image.new("RGB", (64, 64), (10, 200, 30))]
TEXTS = ["what is it " * 3, "describe the picture in detail " * 4]
CASES = [(0, 0), (1, 0), (0, 1), (1, 1)]


def conversation(image_idx: int, text_idx: int) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": IMAGES[image_idx]},
                {"type": "text", "text": TEXTS[text_idx]},
            ],
        }
    ]


@pytest.fixture(scope="module")
def reference(models):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = models.get("gemma3")
    proc = AutoProcessor.from_pretrained(path)
    hf = AutoModelForImageTextToText.from_pretrained(path)
    hf.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for i, t in CASES:
            msgs = [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXTS[t]}]}
            ]
            text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            inputs = proc(text=text, images=[IMAGES[i]], return_tensors="pt")
            gen = hf.generate(**inputs, max_new_tokens=12, do_sample=False)
            outs.append(gen[0, inputs.input_ids.shape[1] :].tolist())
    return path, outs


@pytest.mark.parametrize(
    "regime", [{}, {"enable_prefix_caching": False}, {"max_num_batched_tokens": 16}]
)
def test_image_prompts_match_transformers_and_each_image_is_encoded_once(reference, regime):
    path, expected = reference
    llm = LLM(model=str(path), max_model_len=512, **regime)
    outs = llm.chat([conversation(i, t) for i, t in CASES], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.stats().encoder_runs == 2  # two distinct images
    assert_no_leak(llm)


def test_a_repeated_image_is_served_from_the_caches_not_encoded_again(reference):
    path, expected = reference
    llm = LLM(model=str(path), max_model_len=512)
    first = llm.chat(conversation(0, 1), GREEDY)[0]
    assert llm.engine.stats().encoder_runs == 1
    again = llm.chat(conversation(0, 1), GREEDY)[0]  # identical: the prefix cache covers it
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == expected[2]
    assert again.num_cached_tokens >= 16
    other_text = llm.chat(conversation(0, 0), GREEDY)[0]  # same image, other text
    assert other_text.outputs[0].token_ids == expected[0]
    assert llm.engine.scheduler.encoder.cache.hits == 1  # the encoder cache served it
    assert llm.engine.stats().encoder_runs == 1
    assert_no_leak(llm)


def test_different_images_with_identical_text_never_share_blocks(reference):
    path, expected = reference
    llm = LLM(model=str(path), max_model_len=512)
    llm.chat(conversation(0, 1), GREEDY)
    other = llm.chat(conversation(1, 1), GREEDY)[0]
    assert other.num_cached_tokens == 0  # the first block already holds the image
    assert other.outputs[0].token_ids == expected[3]
    assert_no_leak(llm)


def wide_image() -> Image.Image:
    """Noise 3x wider than tall: pan-and-scan cuts it into crops (min crop size 256)."""
    gen = torch.Generator().manual_seed(5)
    pixels = torch.randint(0, 256, (300, 900, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_pan_and_scan_crops_match_transformers_and_are_encoded_as_items(models):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = models.get("gemma3")
    image, text = wide_image(), "what do the crops show"
    proc = AutoProcessor.from_pretrained(path)
    hf = AutoModelForImageTextToText.from_pretrained(path)
    hf.generation_config.eos_token_id = None
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    inputs = proc(text=prompt, images=[image], do_pan_and_scan=True, return_tensors="pt")
    crops = inputs.pixel_values.shape[0] - 1
    assert crops >= 2
    with torch.inference_mode():
        gen = hf.generate(**inputs, max_new_tokens=12, do_sample=False)
    expected = gen[0, inputs.input_ids.shape[1] :].tolist()

    llm = LLM(model=str(path), max_model_len=512, mm_processor_kwargs={"do_pan_and_scan": True})
    conv = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": text}],
        }
    ]
    out = llm.chat(conv, GREEDY)[0]
    assert out.prompt_token_ids == inputs.input_ids[0].tolist()
    assert out.outputs[0].token_ids == expected
    assert llm.engine.stats().encoder_runs == 1 + crops  # the original and each crop
    # turned off for one request: another identifier, just the original image encoded
    plain = llm.chat(conv, GREEDY, mm_processor_kwargs={"do_pan_and_scan": False})[0]
    assert len(plain.prompt_token_ids) < len(out.prompt_token_ids)
    assert llm.engine.stats().encoder_runs == 2 + crops
    with pytest.raises(ValueError, match="mm_processor_kwargs.pan_and_scan_max_num_crops"):
        llm.chat(conv, GREEDY, mm_processor_kwargs={"pan_and_scan_max_num_crops": "4"})
    assert_no_leak(llm)
