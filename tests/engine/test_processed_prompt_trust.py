"""A pod with the pool's key takes only processed prompts signed with it, for the request's
own cache_salt; a salted request's images get identifiers of their own (encoder cache, store
keys, block-hash extra keys)."""

from __future__ import annotations

import pytest

from epdserve.common.prompt_signing import PromptSigner
from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
from epdserve.engine.core.interfaces import MMFeature
from epdserve.engine.core.request import Request
from epdserve.engine.inputs.hashing import salted_id
from epdserve.engine.inputs.images import LoadedImage
from epdserve.engine.inputs.processor import InputProcessor
from epdserve.engine.inputs.prompt import _MM_ID
from epdserve.engine.sampling_params import SamplingParams

KEY = "k" * 64


@pytest.fixture(scope="module")
def inputs(models):
    return InputProcessor(str(models.get("gemma3")), "tiny")


def image_prompt(inputs: InputProcessor, color=(200, 10, 30)):
    from PIL import Image

    image = Image.new("RGB", (40, 30), color)
    text = f"look {inputs.images.boi_token} here"
    return inputs.prompt_with_images(text, [LoadedImage(image, image.tobytes())], False)


def flip_last(hex_text: str) -> str:
    return hex_text[:-1] + ("1" if hex_text[-1] == "0" else "0")


@pytest.fixture
def keyed(inputs):
    inputs.signer = PromptSigner(KEY)
    yield inputs
    inputs.signer = None


def test_a_keyed_pod_takes_a_processed_prompt_signed_with_its_key(keyed):
    prompt = image_prompt(keyed)
    wire = keyed.to_wire(prompt, "tenant-a")
    taken = keyed.accept(wire, "tenant-a")
    assert taken.token_ids == prompt.token_ids
    assert [i.identifier for i in taken.items] == [i.identifier for i in prompt.items]


def test_a_keyed_pod_refuses_an_unsigned_processed_prompt(keyed):
    wire = image_prompt(keyed).to_wire()
    with pytest.raises(ValueError, match=r"^processed_prompt\.signature: required"):
        keyed.accept(wire)


@pytest.mark.parametrize(
    "change",
    [
        lambda w: w["mm_items"][0].update(id="f" * 64),  # an image it never sent
        lambda w: w["prompt_token_ids"].__setitem__(0, 7),
        lambda w: w.update(signature=flip_last(w["signature"])),
        lambda w: w.update(signature=12),
    ],
    ids=["other image", "other token", "other signature", "not a string"],
)
def test_a_keyed_pod_refuses_a_changed_processed_prompt(keyed, change):
    wire = keyed.to_wire(image_prompt(keyed), None)
    change(wire)
    with pytest.raises(ValueError, match=r"^processed_prompt\.signature: does not match"):
        keyed.accept(wire)


@pytest.mark.parametrize(("signed", "sent"), [("a", "b"), ("a", None), (None, "a")])
def test_a_processed_prompt_is_taken_only_with_the_cache_salt_it_was_signed_for(
    keyed, signed, sent
):
    wire = keyed.to_wire(image_prompt(keyed), signed)
    with pytest.raises(ValueError, match="does not match"):
        keyed.accept(wire, sent)


def test_another_pools_key_does_not_sign_for_this_pool(keyed):
    wire = PromptSigner("o" * 64).sign(image_prompt(keyed).to_wire(), None)
    with pytest.raises(ValueError, match="does not match"):
        keyed.accept(wire)


def test_a_pod_without_a_key_signs_nothing_and_takes_unsigned_prompts(inputs):
    wire = inputs.to_wire(image_prompt(inputs), None)
    assert "signature" not in wire
    assert inputs.accept(wire).token_ids == wire["prompt_token_ids"]


def test_salted_identifiers_differ_per_salt_and_keep_a_crops_suffix():
    plain = "ab" * 32
    a, b = salted_id(plain, "a"), salted_id(plain, "b")
    assert len({plain, a, b}) == 3 and a == salted_id(plain, "a")
    crop = salted_id(plain + ".2", "a")
    assert crop == a + ".2" and _MM_ID.fullmatch(crop)


def test_a_salted_request_names_its_images_apart_in_the_block_hash_extra_keys(inputs):
    plain = image_prompt(inputs)
    salted = image_prompt(inputs)
    salted.salt_items("tenant-a")
    other = image_prompt(inputs)
    other.salt_items("tenant-b")
    ids = [p.items[0].identifier for p in (plain, salted, other)]
    assert len(set(ids)) == 3 and ids[1] == salted_id(ids[0], "tenant-a")
    fn = get_hash_fn("sha256_cbor")
    keys = []
    for prompt in (plain, salted):
        features = [MMFeature(i.identifier, i.offset, i.length, b"", []) for i in prompt.items]
        hasher = BlockHasher(4, fn, none_hash(fn, "s"))
        req = Request("r", prompt.token_ids, SamplingParams(), 1, hasher, mm_features=features)
        span = prompt.items[0]
        block = span.end // 4 - 1  # a block the image's placeholder covers, past block 0
        assert block > 0
        keys.append(req.block_extra_keys(block, block + 1)[0])
    assert keys == [(ids[0],), (ids[1],)]


def test_serve_refuses_a_key_too_short_to_be_random():
    from epdserve.engine.entrypoints.serve_cli import ServeOptions

    with pytest.raises(ValueError, match="^processed_prompt_key must be at least 32"):
        ServeOptions(processed_prompt_key="hunter2")
    assert ServeOptions(processed_prompt_key=KEY).processed_prompt_key == KEY


def test_offline_a_salted_image_is_encoded_apart_and_shared_within_its_salt(models):
    from PIL import Image

    from epdserve.engine import LLM

    llm = LLM(model=str(models.get("gemma3")), max_model_len=512)
    image = Image.new("RGB", (40, 30), (30, 60, 90))
    boi = llm.inputs.images.boi_token
    params = SamplingParams(temperature=0, max_tokens=1)

    def run(text: str, salt: str | None) -> None:
        prompt = {"prompt": f"{text} {boi}", "multi_modal_data": {"image": image}}
        llm.generate([{**prompt, **({"cache_salt": salt} if salt else {})}], params)

    run("look", None)
    run("see", "tenant-a")  # other text: only the encoder cache could serve the image
    assert llm.engine.stats().encoder_runs == 2
    run("view", "tenant-a")
    assert llm.engine.stats().encoder_runs == 2
    assert llm.engine.scheduler.encoder.cache.hits == 1
