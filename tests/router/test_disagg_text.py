"""P/D legs of text requests over in-process fake pods: the router sends its own processed
prompt only when it tokenized the request to route it, and routes every leg by the processed
prompt it knows, never by image blocks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from epdserve.connectors.kv_events import BlockStored, EventBatch
from epdserve.router.tokenize import PromptTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from fake_pods import PARAMS, FakePool, decode, prefill, refusing_url, serve  # noqa: E402

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TEXT_CHAT = {
    "model": "tiny",
    "max_tokens": 5,
    "messages": [{"role": "user", "content": "hi " * 40}],
}
COMPLETION = {"model": "tiny", "max_tokens": 5, "prompt": "def main():\n    return 1\n" * 4}


@pytest.fixture(scope="module")
def tokenizer(models):
    return PromptTokenizer(models.get("llama"))


@pytest.fixture
def pool(tokenizer):
    fakes = FakePool(tokenizer)

    def make(prefills=(prefill(),), decodes=(decode,), strategy="prefix+load"):
        return fakes.make((), prefills, decodes, strategy)

    yield make
    fakes.close()


def bodies(pods) -> list[dict]:
    return [body for pod in pods for _, body in pod.bodies]


def test_a_text_chat_carries_the_routers_ids_to_both_legs(pool, tokenizer):
    routers, (_, prefills, decodes) = pool()
    assert serve(routers, CHAT, TEXT_CHAT)[0] == 200
    mine = {"prompt_token_ids": tokenizer.chat_ids(TEXT_CHAT)}
    [pbody], [dbody] = bodies(prefills), bodies(decodes)
    assert pbody["processed_prompt"] == mine and pbody["messages"] == TEXT_CHAT["messages"]
    assert dbody == {**TEXT_CHAT, "processed_prompt": mine, "kv_transfer_params": PARAMS}


def test_the_prefill_pods_prompt_replaces_the_routers(pool):
    theirs = {"prompt_token_ids": [1, 2, 3], "mm_items": []}
    routers, (_, _, decodes) = pool(prefills=[prefill(theirs)])
    serve(routers, CHAT, TEXT_CHAT)
    assert bodies(decodes)[0]["processed_prompt"] == theirs


def test_a_router_that_does_not_route_by_prefix_sends_the_request_as_is(pool):
    routers, (_, prefills, decodes) = pool(strategy="least-load")
    serve(routers, CHAT, TEXT_CHAT)
    assert "processed_prompt" not in bodies(prefills)[0]
    assert bodies(decodes)[0] == {**TEXT_CHAT, "kv_transfer_params": PARAMS}


@pytest.mark.parametrize(
    ("body", "tokenized"),
    [
        (COMPLETION, True),
        ({**COMPLETION, "echo": True}, False),  # the pod echoes the prompt's own text
        ({**COMPLETION, "prompt": [COMPLETION["prompt"], "x = 2"]}, False),  # a batch
        ({**COMPLETION, "prompt": [5, 6, 7]}, False),  # ids already
    ],
    ids=["string", "echo", "batch", "ids"],
)
def test_completions_carry_the_routers_ids_only_for_one_prompt_string(
    pool, tokenizer, body, tokenized
):
    routers, (_, prefills, decodes) = pool()
    assert serve(routers, COMPLETIONS, body)[0] == 200
    want = {"prompt_token_ids": tokenizer.completion_ids(body)} if tokenized else None
    assert [b.get("processed_prompt") for b in bodies(prefills + decodes)] == [want, want]
    assert bodies(decodes)[0]["prompt"] == body["prompt"]


def test_without_a_prefill_pod_decode_gets_the_routers_prompt(pool, tokenizer):
    routers, (_, _, decodes) = pool(prefills=[refusing_url()])
    assert serve(routers, COMPLETIONS, COMPLETION)[0] == 200
    mine = {"prompt_token_ids": tokenizer.completion_ids(COMPLETION)}
    assert bodies(decodes) == [{**COMPLETION, "processed_prompt": mine}]


def test_every_prefill_pod_busy_is_a_503_with_retry_after(pool):
    busy = lambda path, body: (503, {"error": "busy"}, {"Retry-After": "3"})  # noqa: E731
    routers, (_, _, decodes) = pool(prefills=[busy])
    status, _ = serve(routers, COMPLETIONS, COMPLETION)
    assert status == 503 and bodies(decodes) == []


def test_a_prefill_error_answer_goes_to_the_client(pool):
    routers, (_, _, decodes) = pool(prefills=[lambda path, body: (500, {"error": "x"}, {})])
    assert serve(routers, COMPLETIONS, COMPLETION)[0] == 500 and bodies(decodes) == []


IDS = list(range(100, 164))  # 4 blocks of 16
IMAGE_AT_32 = {"id": "ab" * 32, "offset": 32, "length": 16}


def stored(tokens):
    hashes = list(range(1, len(tokens) // 16 + 1))
    return EventBatch(0.0, [BlockStored(hashes, None, tokens, 16, None, "GPU", None, None, 0)], 0)


def test_a_processed_prompt_routes_by_its_ids_before_the_first_image(pool):
    routers, _ = pool(prefills=[prefill(), prefill()])
    router = routers.prefill
    router.index.apply("prefill1", stored(IDS[:48]))  # its third block: image tokens
    body = {"processed_prompt": {"prompt_token_ids": IDS, "mm_items": [IMAGE_AT_32]}}
    routing = router.route(CHAT, body)
    assert routing.order[0].pod == "prefill1"
    assert routing.matched["prefill1"] == 2 and routing.total_blocks["prefill1"] == 2
    text_only = router.route(CHAT, {"processed_prompt": {"prompt_token_ids": IDS}})
    assert text_only.matched["prefill1"] == 3
    at_zero = {**IMAGE_AT_32, "offset": 0}
    image_first = {"processed_prompt": {"prompt_token_ids": IDS, "mm_items": [at_zero]}}
    assert router.route(CHAT, image_first).matched == {}


def test_the_router_tokenizes_once_and_routes_both_legs_by_those_ids(pool, tokenizer):
    routers, (_, prefills, _) = pool(prefills=[prefill(), prefill()])
    ids = tokenizer.completion_ids(COMPLETION)
    routers.prefill.index.apply("prefill1", stored(ids[: len(ids) // 16 * 16]))
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda *a: calls.append(a) or encode(*a)
    try:
        for _ in range(3):  # a tie would rotate between the pods
            serve(routers, COMPLETIONS, COMPLETION)
    finally:
        del tokenizer.encode
    assert [len(p.bodies) for p in prefills] == [0, 3]
    assert len(calls) == 3
