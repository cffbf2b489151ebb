"""What each leg of the router's E/P/D orchestration sends, over in-process fake pods: the
processed prompt travels from the pod that made it to the next legs, images do not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from epdserve.router.processed import image_affinity
from epdserve.router.tokenize import PromptTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from fake_pods import PARAMS, FakePool, decode, prefill, refusing_url, serve  # noqa: E402

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TEXT = {"type": "text", "text": "what is this?"}
IMAGE_CHAT = {
    "model": "tiny",
    "max_tokens": 5,
    "messages": [{"role": "user", "content": [IMAGE, TEXT]}],
}
STRIPPED = [{"role": "user", "content": [TEXT]}]
TEXT_CHAT = {
    "model": "tiny",
    "max_tokens": 5,
    "messages": [{"role": "user", "content": "hi " * 40}],
}
COMPLETION = {"model": "tiny", "max_tokens": 5, "prompt": "def main():\n    return 1\n" * 4}
ITEM = {"id": "ab" * 32, "offset": 2, "length": 4}
ENCODED = {"prompt_token_ids": [1, 9, 7, 7, 7, 7, 9, 5], "mm_items": [ITEM]}
PREFILLED = {"prompt_token_ids": [1, 9, 7, 7, 7, 7, 9, 6], "mm_items": [ITEM]}


def encoder(prompt=ENCODED):
    return lambda path, body: (200, {"processed_prompt": prompt} if prompt else {"ok": 1}, {})


def failing(status, headers=None):
    return lambda path, body: (status, {"error": f"told to fail {status}"}, headers or {})


@pytest.fixture
def pool(models):
    fakes = FakePool(PromptTokenizer(models.get("llama")))

    def make(encoders=(), prefills=(prefill(),), decodes=(decode,), strategy="prefix+load"):
        return fakes.make(encoders, prefills, decodes, strategy)

    yield make
    fakes.close()


CHAT = "/v1/chat/completions"


def test_images_go_to_the_encoder_only_and_its_prompt_to_prefill_and_decode(pool):
    routers, (encoders, prefills, decodes) = pool(encoders=[encoder()])
    status, body = serve(routers, CHAT, IMAGE_CHAT)
    assert status == 200 and b"decoded" in body
    assert encoders[0].bodies == [(CHAT, {**IMAGE_CHAT, "stream": False})]
    [(_, pbody)] = prefills[0].bodies
    assert pbody["messages"] == STRIPPED and pbody["processed_prompt"] == ENCODED
    assert pbody["max_tokens"] == 1 and pbody["kv_transfer_params"] == {"do_remote_decode": True}
    [(_, dbody)] = decodes[0].bodies
    assert dbody == {
        **IMAGE_CHAT,
        "messages": STRIPPED,
        "processed_prompt": ENCODED,
        "kv_transfer_params": PARAMS,
    }


def test_the_prefill_pods_processed_prompt_is_the_one_decode_gets(pool):
    routers, (_, _, decodes) = pool(encoders=[encoder()], prefills=[prefill(PREFILLED)])
    serve(routers, CHAT, IMAGE_CHAT)
    assert decodes[0].bodies[0][1]["processed_prompt"] == PREFILLED


@pytest.mark.parametrize(
    "answer",
    [encoder(prompt=None), refusing_url(), failing(503)],
    ids=["older pod", "refused", "503"],
)
def test_without_an_encoder_prompt_the_legs_get_the_images(pool, answer):
    routers, (_, prefills, decodes) = pool(encoders=[answer])
    status, _ = serve(routers, CHAT, IMAGE_CHAT)
    assert status == 200
    pbody, dbody = prefills[0].bodies[0][1], decodes[0].bodies[0][1]
    assert pbody["messages"] == IMAGE_CHAT["messages"] and "processed_prompt" not in pbody
    assert dbody == {**IMAGE_CHAT, "kv_transfer_params": PARAMS}


def test_an_encoder_error_answer_goes_to_the_client_and_no_further(pool):
    routers, (_, prefills, decodes) = pool(encoders=[failing(400)])
    status, body = serve(routers, CHAT, IMAGE_CHAT)
    assert status == 400 and b"told to fail 400" in body
    assert prefills[0].bodies == [] and decodes[0].bodies == []


def image_chat(i: int) -> dict:
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i:04d}"}}
    return {**IMAGE_CHAT, "messages": [{"role": "user", "content": [image, TEXT]}]}


def sent_image(body: dict) -> str:
    return body["messages"][0]["content"][0]["image_url"]["url"]


def test_encoders_are_ranked_by_rendezvous_over_the_images(pool):
    routers, (encoders, _, _) = pool(encoders=[encoder(), encoder(), encoder()])
    for i in [*range(12), *range(12)]:
        serve(routers, CHAT, image_chat(i))
    names = [p.name for p in encoders]
    for i in range(12):
        weights = image_affinity(image_chat(i), names)
        got = [
            p.name
            for p in encoders
            for _, b in p.bodies
            if sent_image(b) == sent_image(image_chat(i))
        ]
        assert got == [max(names, key=weights.get)] * 2  # the same pod, the top-ranked one
    assert sum(1 for p in encoders if p.bodies) > 1  # different images spread
    assert 'reason="encoder_affinity"' in routers.encoder.metrics.render().decode()


def test_a_refusing_encoder_passes_the_images_to_the_next_ranked_one(pool):
    routers, (encoders, prefills, _) = pool(encoders=[failing(503), encoder()])
    names = [p.name for p in encoders]
    i = next(
        i
        for i in range(100)
        if max(names, key=image_affinity(image_chat(i), names).get) == "encoder0"
    )
    assert serve(routers, CHAT, image_chat(i))[0] == 200
    assert len(encoders[0].bodies) == len(encoders[1].bodies) == 1
    assert prefills[0].bodies[0][1]["processed_prompt"] == ENCODED


def test_with_prompt_logprobs_the_prefill_is_skipped_and_decode_gets_the_encoders_prompt(pool):
    routers, (_, prefills, decodes) = pool(encoders=[encoder()])
    serve(routers, CHAT, {**IMAGE_CHAT, "prompt_logprobs": 1})
    assert prefills[0].bodies == []
    dbody = decodes[0].bodies[0][1]
    assert dbody["processed_prompt"] == ENCODED and dbody["messages"] == STRIPPED
    assert "kv_transfer_params" not in dbody


def test_with_no_prefill_pod_decode_gets_the_known_prompt(pool):
    routers, (_, _, decodes) = pool(encoders=[encoder()], prefills=[refusing_url()])
    assert serve(routers, CHAT, IMAGE_CHAT)[0] == 200
    assert decodes[0].bodies[0][1] == {
        **IMAGE_CHAT,
        "messages": STRIPPED,
        "processed_prompt": ENCODED,
    }


def test_the_prefill_leg_asks_one_token_without_min_tokens_and_decode_keeps_them():
    from epdserve.router.disagg import decode_body, prefill_body

    body = {**COMPLETION, "min_tokens": 4, "max_completion_tokens": 8, "stream": True}
    leg = prefill_body(body)
    assert leg["max_tokens"] == leg["max_completion_tokens"] == 1 and "min_tokens" not in leg
    assert decode_body(body, None, None)["min_tokens"] == 4
