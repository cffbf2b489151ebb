"""An image named without pixels whose encoder output no store can give (evicted between the
legs of a disaggregated pool) fails its own request with 503, and only that one: the step's
other requests run on, struck by nothing."""

from __future__ import annotations

import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.core.interfaces import MMFeature
from epdserve.engine.core.pixel_cache import PixelSender
from epdserve.engine.inputs.images import LoadedImage
from epdserve.engine.inputs.processor import InputProcessor
from epdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def pod(models):
    model = str(models.get("gemma3"))
    core = EngineCore(EngineConfig(model=model, dtype="float32", max_model_len=512))
    return core, InputProcessor(model, "tiny")


def request(inputs: InputProcessor, req_id: str, color, named_only: bool) -> EngineCoreRequest:
    from PIL import Image

    image = Image.new("RGB", (40, 30), color)
    text = f"look {inputs.images.boi_token} here"
    prompt = inputs.prompt_with_images(text, [LoadedImage(image, image.tobytes())], False)
    if named_only:  # as a processed prompt names it: the pod never got the pixels
        features = [MMFeature(i.identifier, i.offset, i.length, b"", []) for i in prompt.items]
    else:
        features = PixelSender().features(prompt.items)
    return EngineCoreRequest(req_id, prompt.token_ids, GREEDY, mm_features=features)


def test_an_image_no_store_has_fails_its_request_alone_with_503(pod):
    core, inputs = pod
    core.add_request(request(inputs, "with-pixels", (200, 0, 0), named_only=False))
    core.add_request(request(inputs, "evicted", (0, 0, 200), named_only=True))
    outputs, tokens = {}, []
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            if out.error is not None:
                outputs[out.request_id] = out
            if out.request_id == "with-pixels":
                tokens += out.new_token_ids
    assert list(outputs) == ["evicted"]
    assert outputs["evicted"].error_status == 503
    assert "send the request again with its images" in outputs["evicted"].error
    assert len(tokens) == 4  # the other request was rolled back and ran on, not failed
    assert not core.guard.suspects and not core.guard.strikes
    assert core.stats().failed_steps == 0  # an eviction, not a fault to alert on
    assert core.kv.num_free_blocks() == core.num_blocks - 1
