"""The router's side of processed-prompt trust, over in-process fake pods: a leg whose pod
asks for the images (503 + X-Epdserve-Resend, the encoder outputs were evicted since the
encoder leg) is sent once more with the client's images; the prompts the router tokenizes
itself are signed with the pool's key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from epdserve.common.prompt_signing import PromptSigner
from epdserve.router.tokenize import PromptTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from fake_pods import PARAMS, FakePool, decode, serve  # noqa: E402
from test_disagg_flow import IMAGE_CHAT  # noqa: E402

CHAT = "/v1/chat/completions"
ITEM = {"id": "ab" * 32, "offset": 2, "length": 4}
ENCODED = {"prompt_token_ids": [1, 9, 7, 7, 7, 7, 9, 5], "mm_items": [ITEM], "signature": "e"}
PREFILLED = {**ENCODED, "signature": "p"}
RESEND_HEADERS = {"Retry-After": "1", "X-Epdserve-Resend": "images"}
RESEND = (503, {"error": {"message": "send it again", "code": 503}}, RESEND_HEADERS)
KEY = "r" * 64


def encoder(path, body):
    return 200, {"processed_prompt": ENCODED}, {}


def resending_once(answer):
    """A pod that asks for the images when sent a processed prompt, else answers ``answer``."""

    def respond(path, body):
        return RESEND if "processed_prompt" in body else answer(path, body)

    return respond


def prefilled(path, body):
    return 200, {"kv_transfer_params": PARAMS, "processed_prompt": PREFILLED}, {}


@pytest.fixture
def pool(models):
    fakes = FakePool(PromptTokenizer(models.get("llama")))
    yield lambda **roles: fakes.make(**roles)
    fakes.close()


def test_a_prefill_pod_that_lost_the_images_gets_the_leg_again_with_them(pool):
    routers, (_, prefills, decodes) = pool(
        encoders=[encoder], prefills=[resending_once(prefilled)], decodes=[decode]
    )
    status, body = serve(routers, CHAT, IMAGE_CHAT)
    assert status == 200 and b"decoded" in body
    [(_, first), (_, again)] = prefills[0].bodies
    assert first["processed_prompt"] == ENCODED
    assert "processed_prompt" not in again and again["messages"] == IMAGE_CHAT["messages"]
    assert again["max_tokens"] == 1 and again["kv_transfer_params"] == {"do_remote_decode": True}
    [(_, dbody)] = decodes[0].bodies  # the prompt the prefill pod made from the images
    assert dbody["processed_prompt"] == PREFILLED and dbody["kv_transfer_params"] == PARAMS
    metrics = routers.prefill.metrics
    assert metrics.upstream_retries.labels("resend_images")._value.get() == 1


def test_a_decode_pod_that_lost_the_images_gets_the_leg_again_with_them(pool):
    routers, (_, _, decodes) = pool(
        encoders=[encoder], prefills=[prefilled], decodes=[resending_once(decode)]
    )
    status, body = serve(routers, CHAT, IMAGE_CHAT)
    assert status == 200 and b"decoded" in body
    [(_, first), (_, again)] = decodes[0].bodies
    assert first["processed_prompt"] == PREFILLED
    assert "processed_prompt" not in again and again["messages"] == IMAGE_CHAT["messages"]
    assert again["kv_transfer_params"] == PARAMS


def test_the_images_are_sent_again_once_only(pool):
    always = lambda path, body: RESEND  # noqa: E731
    routers, (_, prefills, decodes) = pool(encoders=[encoder], prefills=[always], decodes=[decode])
    status, body = serve(routers, CHAT, IMAGE_CHAT)
    assert status == 503 and json.loads(body)["error"]["message"] == "send it again"
    assert len(prefills[0].bodies) == 2 and not decodes[0].bodies


def test_a_text_prompt_the_router_tokenized_is_signed_with_the_pools_key(pool):
    routers, (_, prefills, _) = pool(encoders=[], prefills=[prefilled], decodes=[decode])
    routers.signer = PromptSigner(KEY)
    text = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi " * 40}]}
    serve(routers, CHAT, {**text, "cache_salt": "tenant-a"})
    [(_, pbody)] = prefills[0].bodies
    prompt = pbody["processed_prompt"]
    unsigned = {k: v for k, v in prompt.items() if k != "signature"}
    assert prompt["signature"] == PromptSigner(KEY).signature(unsigned, "tenant-a")
    assert prompt["signature"] != PromptSigner(KEY).signature(unsigned, None)
