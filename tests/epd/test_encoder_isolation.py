"""An encoder pod's core: one request that fails to encode fails alone; a pixel buffer that
does not match its shape, or an id already pending, is refused at the door."""

from __future__ import annotations

import json

import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.encoder_core import EncoderCore
from epdserve.engine.core.engine_core import EngineCoreRequest
from epdserve.engine.core.pixel_cache import PixelSender
from epdserve.engine.inputs.images import LoadedImage
from epdserve.engine.inputs.processor import InputProcessor
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.tokenizer import TokenizerInfo


@pytest.fixture(scope="module")
def encoder(models, tmp_path_factory):
    model = str(models.get("gemma3"))
    extra = {"path": str(tmp_path_factory.mktemp("ec"))}
    ec = {"ec_connector": "SharedStorageECConnector", "ec_role": "ec_producer"}
    config = EngineConfig(
        model=model,
        role="encoder",
        ec_transfer_config=json.dumps({**ec, "ec_connector_extra_config": extra}),
    )
    frontend = InputProcessor(model, "tiny", TokenizerInfo(model))
    return EncoderCore(config), frontend


def request(frontend, req_id: str, color) -> EngineCoreRequest:
    from PIL import Image

    image = Image.new("RGB", (40, 30), color)
    text = f"look {frontend.images.boi_token} here"
    prompt = frontend.prompt_with_images(text, [LoadedImage(image, image.tobytes())], False)
    features = PixelSender().features(prompt.items)
    return EngineCoreRequest(
        req_id, prompt.token_ids, SamplingParams(max_tokens=1), mm_features=features
    )


def test_a_failing_request_on_an_encoder_pod_fails_alone(encoder, monkeypatch):
    core, frontend = encoder
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:poison")
    for i, color in enumerate([(200, 0, 0), (0, 200, 0), (0, 0, 200)]):
        core.add_request(request(frontend, "poison-1" if i == 1 else f"ok-{i}", color))
    outputs = {o.request_id: o for o in core.step()}
    assert "injected fault" in outputs["poison-1"].error
    for req_id in ("ok-0", "ok-2"):
        assert outputs[req_id].error is None and outputs[req_id].ec_transfer_params["mm_ids"]
    assert core.stats().failed_steps == 1 and not core.has_unfinished_requests()


def test_a_pixel_buffer_that_does_not_match_its_shape_is_refused(encoder):
    core, frontend = encoder
    req = request(frontend, "short", (5, 5, 5))
    req.mm_features[0].data = req.mm_features[0].data[:-4]
    with pytest.raises(ValueError, match="mm_features\\[0\\]"):
        core.add_request(req)


def test_a_second_request_with_a_pending_id_is_refused_and_the_first_kept(encoder):
    core, frontend = encoder
    first = request(frontend, "dup", (1, 2, 3))
    core.add_request(first)
    with pytest.raises(ValueError, match="request_id"):
        core.add_request(request(frontend, "dup", (9, 9, 9)))
    assert core.pending["dup"] is first
    outputs = core.step()
    assert [o.request_id for o in outputs] == ["dup"] and outputs[0].error is None
