"""The official ``openai`` client against the router of each pool shape: colocated, P/D
and E/P/D, over real gemma3 pods and a real redis-server.

Four pods serve the three shapes: one colocated pod, and one encoder, prefill and decode
pod (the P/D router uses the prefill and decode pods without the encoder). Every shape
must answer like the colocated pod does when asked directly: same models, same greedy
text streamed or not, same tokenizer routes."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving_support import ServerProcess
from test_router_disagg import RouterProcess, endpoint, role_pod

SHAPES = ("colocated", "pd", "epd")
PROMPT = "def fibonacci(n):\n    " * 4
CHAT = [{"role": "user", "content": "tell me about caches " * 3}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def pool(models, redis_server):
    """``(pods by role, routers by shape)``; pods start together, then the routers."""
    model = str(models.get("gemma3"))
    starters = {
        "both": lambda: ServerProcess(model, api_key=None),
        **{
            role: (lambda role=role: role_pod(model, role, redis_server.url, images=True))
            for role in ("encoder", "prefill", "decode")
        },
    }
    pods, routers = {}, {}
    try:
        with ThreadPoolExecutor(len(starters)) as workers:
            futures = {role: workers.submit(start) for role, start in starters.items()}
            for role, future in futures.items():
                pods[role] = future.result()
        pd = ["--prefill-endpoint", endpoint(pods["prefill"])]
        pd += ["--decode-endpoint", endpoint(pods["decode"])]
        flags = {
            "colocated": ["--endpoint", endpoint(pods["both"])],
            "pd": pd,
            "epd": ["--encoder-endpoint", endpoint(pods["encoder"]), *pd],
        }
        for shape in SHAPES:
            routers[shape] = RouterProcess(model, *flags[shape])
        yield pods, routers
    finally:
        for router in routers.values():
            router.stop()
        for pod in pods.values():
            pod.stop()


@pytest.fixture(params=SHAPES)
def router(request, pool):
    return pool[1][request.param]


@pytest.fixture
def client(router):
    with openai.OpenAI(
        base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def direct(pool):
    """The colocated pod's own answers, asked without a router."""
    pod = pool[0]["both"]
    with openai.OpenAI(base_url=pod.url + "/v1", api_key="unused", max_retries=0) as c:
        completion = c.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        chat = c.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
        )
    return {
        "completion": completion.choices[0].text,
        "chat": chat.choices[0].message.content,
        "url": pod.url,
    }


def test_models_list_names_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.object == "model"


def test_a_completion_is_the_colocated_pods_greedy_text(client, direct):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].text == direct["completion"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == MAX_TOKENS


def test_a_streamed_completion_joins_to_the_same_text_and_ends_with_usage(client, direct):
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == direct["completion"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_a_chat_completion_is_the_colocated_pods_greedy_answer(client, direct):
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == direct["chat"]
    assert out.usage.completion_tokens == MAX_TOKENS


def test_a_streamed_chat_joins_to_the_same_answer_and_ends_with_usage(client, direct):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == direct["chat"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": "tiny", "prompt": "hello caches"}),
        ("/tokenize", {"model": "tiny", "messages": CHAT, "add_generation_prompt": True}),
        ("/detokenize", {"model": "tiny", "tokens": [5, 6, 7, 8]}),
    ],
)
def test_tokenizer_routes_answer_as_the_pod_does(router, direct, path, body):
    through = httpx.post(router.url + path, json=body, timeout=30)
    assert through.status_code == 200, through.text
    assert through.json() == httpx.post(direct["url"] + path, json=body, timeout=30).json()


def test_version_is_the_pods_version(router, direct):
    pod = httpx.get(direct["url"] + "/version", timeout=10).json()
    assert httpx.get(router.url + "/version", timeout=10).json() == pod


def test_health_is_an_empty_200_and_ready_counts_the_pods(router):
    health = httpx.get(router.url + "/health", timeout=10)
    assert health.status_code == 200 and health.content == b""
    ready = httpx.get(router.url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_metrics_are_the_routers_own(router):
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert "epdserve_router:requests_total" in text and "vllm:" not in text


def png_data_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (48, 40), (30, 160, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_chat_through_epd_is_encoded_by_the_encoder_pod(pool):
    pods, routers = pool
    before = pods["encoder"].metric("epdserve:encoder_runs_total")
    with openai.OpenAI(
        base_url=routers["epd"].url + "/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        content = [
            {"type": "image_url", "image_url": {"url": png_data_url()}},
            {"type": "text", "text": "what colour is this?"},
        ]
        out = c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
    assert out.usage.completion_tokens == MAX_TOKENS
    assert pods["encoder"].metric("epdserve:encoder_runs_total") == before + 1
    assert pods["decode"].metric("epdserve:encoder_runs_total") == 0


@pytest.mark.parametrize("shape", ["pd", "epd"])
def test_a_split_completion_decodes_from_the_prefill_pods_blocks(pool, shape):
    pods, routers = pool
    before = pods["decode"].metric("vllm:external_prefix_cache_hits_total")
    with openai.OpenAI(base_url=routers[shape].url + "/v1", api_key="unused", max_retries=0) as c:
        c.completions.create(
            model="tiny", prompt=f"class {shape}Cache:\n    " * 8, max_tokens=2, temperature=0
        )
    assert pods["decode"].metric("vllm:external_prefix_cache_hits_total") > before
