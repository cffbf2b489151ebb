"""The hostile-input table: requests a pod (and a router in front of it) must refuse with a
4xx in OpenAI's error shape, without harming anything else. Shared by the pod and router
tests; ``docs/operations.md`` lists what each gets."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from serving_support import API_KEY

from epdserve.common import metrics_text

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BIG = 60 << 20  # over every default body limit (32 MiB)


@dataclass(frozen=True)
class Hostile:
    name: str
    body: dict | None = None  # sent as JSON
    raw: bytes | None = None  # sent as is (application/json)
    path: str = "/v1/completions"
    headers: dict = field(default_factory=dict)
    status: int = 400
    param: str | None = None  # the field the error must name (None: not checked)
    message: str | None = None  # a fragment the error message must hold (None: not checked)


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "def main():", "max_tokens": 4, **fields}


def chat(content="hello", **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **fields}


TABLE = [
    Hostile("malformed JSON", raw=b'{"prompt": "x",', param="body"),
    Hostile("a JSON array instead of an object", raw=b"[1, 2, 3]"),
    Hostile("an empty body", raw=b""),
    Hostile("a prompt of the wrong type", completion(prompt={"a": 1}), param="prompt"),
    Hostile("a temperature that is a string", completion(temperature="hot"), param="temperature"),
    Hostile("NaN temperature", raw=b'{"prompt": "x", "temperature": NaN}', param="temperature"),
    Hostile("infinite top_p", raw=b'{"prompt": "x", "top_p": Infinity}', param="top_p"),
    Hostile("max_tokens 10**30", completion(max_tokens=10**30), param="max_tokens"),
    Hostile("max_tokens 0", completion(max_tokens=0), param="max_tokens"),
    Hostile("min_tokens above max_tokens", completion(min_tokens=9), param="min_tokens"),
    Hostile("n of a million", completion(n=10**6), param="n"),
    Hostile("best_of above n", completion(best_of=5), param="best_of"),
    Hostile("logprobs 100000", completion(logprobs=100000), param="logprobs"),
    Hostile("prompt_logprobs 100000", completion(prompt_logprobs=100000), param="prompt_logprobs"),
    Hostile(
        "top_logprobs 100000",
        chat(logprobs=True, top_logprobs=100000),
        path="/v1/chat/completions",
        param="top_logprobs",
    ),
    Hostile("a token id past the vocabulary", completion(prompt=[5, 5_000_000]), param="prompt"),
    Hostile("a negative token id", completion(prompt=[5, -1]), param="prompt"),
    Hostile("a 70-bit token id", completion(prompt=[2**70]), param="prompt"),
    Hostile("an empty prompt", completion(prompt=[])),
    Hostile("a lone surrogate in the prompt", raw=b'{"prompt": "a\\ud800b"}', param="prompt"),
    Hostile(
        "a lone surrogate in a chat message",
        raw=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        path="/v1/chat/completions",
        param="messages[0].content",
    ),
    Hostile("ten thousand stop strings", completion(stop=["x"] * 10_000), param="stop"),
    Hostile("a stop token past the vocabulary", completion(stop_token_ids=[10**9])),
    Hostile("a 70-bit seed", completion(seed=2**70), param="seed"),
    Hostile("an unknown field", completion(frobnicate=True), param="frobnicate"),
    Hostile(
        "a logit_bias key that is no token", completion(logit_bias={"ab": 1}), param="logit_bias"
    ),
    Hostile("a logit_bias of 1e9", completion(logit_bias={"5": 1e9}), param="logit_bias"),
    Hostile("a 100 KB bad word", completion(bad_words=["a" * 100_000]), param="bad_words"),
    Hostile("a thousand bad words", completion(bad_words=["ab"] * 1000), param="bad_words"),
    Hostile(  # within the characters, past the tokens a word may have
        "a bad word of 250 tokens", completion(bad_words=["qzxj" * 62]), param="bad_words"
    ),
    Hostile(
        "a json_schema response_format",
        completion(response_format={"type": "json_schema"}),
        param="response_format",
    ),
    Hostile("an empty cache_salt", completion(cache_salt=""), param="cache_salt"),
    Hostile(
        "chat_template_kwargs reaching the renderer's own arguments",
        chat(chat_template_kwargs={"tokenize": True}),
        path="/v1/chat/completions",
        param="chat_template_kwargs",
    ),
    Hostile(
        "kv_transfer_params of the wrong shape",
        completion(kv_transfer_params={"do_remote_prefill": "yes"}),
    ),
    Hostile("an unknown model", completion(model="gpt-5"), status=404, param="model"),
    Hostile(
        "chat without messages", {"model": "tiny", "messages": []}, path="/v1/chat/completions"
    ),
    Hostile(
        "a chat role that does not exist",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        path="/v1/chat/completions",
    ),
    Hostile(
        "an image part for a text-only model",
        chat([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        path="/v1/chat/completions",
        param="messages[0].content[0]",
    ),
    Hostile("a 60 MB body", raw=b'{"prompt": "' + b"a" * BIG + b'"}', status=413),
    Hostile(
        "an X-Request-Id with spaces",
        completion(),
        headers={"X-Request-Id": "a b"},
        param="X-Request-Id",
    ),
    Hostile(
        "an X-Request-Id of 129 characters",
        completion(),
        headers={"X-Request-Id": "r" * 129},
        param="X-Request-Id",
    ),
    Hostile("detokenizing ids past the vocabulary", {"tokens": [10**12]}, path="/detokenize"),
    Hostile("tokenizing a lone surrogate", raw=b'{"prompt": "\\ud800"}', path="/tokenize"),
]


def send(url: str, case: Hostile) -> httpx.Response:
    headers = {**AUTH, **case.headers}
    if case.raw is not None:
        headers["content-type"] = "application/json"
        return httpx.post(url + case.path, content=case.raw, headers=headers, timeout=60)
    return httpx.post(url + case.path, json=case.body, headers=headers, timeout=60)


def check(resp: httpx.Response, case: Hostile) -> None:
    assert resp.status_code == case.status, f"{case.name}: {resp.status_code} {resp.text[:300]}"
    error = resp.json()["error"]
    assert error["message"] and error["type"] and error["code"] == case.status, case.name
    if case.param is not None:
        assert error["param"] == case.param, f"{case.name}: {error}"
    if case.message is not None:
        assert case.message in error["message"], f"{case.name}: {error}"


# Image bombs (the pixel budget): for the pods of an image+text model. Not in TABLE, whose
# text-only pods refuse any image part before looking at it. Each is refused from the
# image's header, or (the truncated ones) when its decoding fails, naming the part.
def _image_bombs() -> list[Hostile]:
    import image_bombs as b

    image, request, broken = "allowed per image", "allowed per request", "not a decodable image"
    gif, webp, jpeg = "image/gif", "image/webp", "image/jpeg"
    header = b.png_header_only
    rows = [  # (name, message fragment, mime type, images)
        ("a 6.5 KB 1-bit PNG of 6300x6300", image, None, [b.png_1bit(6300, 6300)]),
        ("a PNG header of 50000x50000 (PIL's bomb error)", image, None, [header(50_000, 50_000)]),
        ("a PNG header of 10000x10000 (PIL's bomb warning)", image, None, [header(10_000, 10_000)]),
        ("a JPEG patched to 65000x65000", image, jpeg, [b.jpeg_claiming(65_000, 65_000)]),
        ("a JPEG patched to 6000x6000", image, jpeg, [b.jpeg_claiming(6000, 6000)]),
        ("a GIF of 1000 frames on a 9000x9000 screen", image, gif, [b.gif(9000, 9000, 1000)]),
        ("a GIF frame larger than its screen", image, gif, [b.gif(1, 1, 3, (0, 0, 6000, 6000))]),
        ("an animated WebP on a 16000x16000 canvas", image, webp, [b.webp_canvas(16_000, 16_000)]),
        ("an animated WebP on a 6000x6000 canvas", image, webp, [b.webp_canvas(6000, 6000)]),
        ("a 2000x2000 PNG header over 64 bytes", broken, None, [header(2000, 2000)]),
        ("a truncated PNG", broken, None, [b.truncated(b.small("PNG", (400, 300)))]),
        ("a truncated JPEG", broken, jpeg, [b.truncated(b.small("JPEG", (400, 300)))]),
        ("five 20 M-pixel PNGs (101 M in all)", request, None, [b.png_1bit(4500, 4500)] * 5),
        ("a PNG of 100,000 empty chunks", broken, None, [b.png_chunks(100_000)]),
        ("a JPEG of 500,000 fill bytes", broken, jpeg, [b.jpeg_fill(500_000)]),
        ("a GIF of 100,000 comment blocks", broken, gif, [b.gif_comments(100_000)]),
    ]  # fmt: skip
    cases = []
    for name, message, mime, raws in rows:
        urls = [b.data_url(raw, mime or "image/png") for raw in raws]
        parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
        body = chat([*parts, {"type": "text", "text": "what is it?"}], max_tokens=4)
        where = f"messages[0].content[{len(raws) - 1}]"  # the last image: it breaks the bound
        cases.append(Hostile(name, body, path="/v1/chat/completions", param=where, message=message))
    return cases


IMAGE_BOMBS = _image_bombs()


# Cases only a pod (or router) that checks an API key can answer.
KEYED = [
    Hostile("a wrong API key", completion(), headers={"Authorization": "Bearer wrong"}, status=401),
    Hostile("no API key", completion(), headers={"Authorization": ""}, status=401),
    Hostile(
        "a wrong API key on a body past the size limit",
        raw=b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
        headers={"Authorization": "Bearer wrong"},
        status=401,
    ),
]


def colliding_request_ids(url: str, path: str, body: dict) -> None:
    """The request that used to stop an engine core: ``X-Request-Id: abc`` with ``n: 2``
    while ``abc-0`` (the id its first child would get) and ``abc`` again run. All are
    served; the header is echoed as a label."""
    labels = ["abc", "abc-0", "abc", "abc-1"]

    def one(label: str) -> httpx.Response:
        headers = {**AUTH, "X-Request-Id": label}
        params = {"n": 2, "temperature": 1.0, "seed": 3} if label == "abc" else {}
        return httpx.post(url + path, json={**body, **params}, headers=headers, timeout=120)

    with ThreadPoolExecutor(len(labels)) as pool:
        answers = list(pool.map(one, labels))
    for label, resp in zip(labels, answers, strict=True):
        assert resp.status_code == 200, f"X-Request-Id {label}: {resp.status_code} {resp.text}"
        assert resp.headers.get("x-request-id") == label


SETTLED = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def gauges(pod_url: str) -> dict[str, float]:
    """The pod's settle gauges (absent ones, e.g. an encoder pod's KV usage, are left out)."""
    samples = metrics_text.parse(httpx.get(pod_url + "/metrics", timeout=5).text)
    found = {name: metrics_text.values(samples, name) for name in SETTLED}
    return {name: sum(values) for name, values in found.items() if values}


def assert_settled(pod_url: str, timeout: float = 15) -> None:
    """Nothing running or waiting and no KV block held: a request that leaked its blocks
    would keep the usage above 0 for good."""
    deadline = time.monotonic() + timeout
    assert "vllm:num_requests_running" in gauges(pod_url), f"{pod_url} exports no gauges"
    while any(gauges(pod_url).values()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{pod_url} holds requests or blocks: {gauges(pod_url)}")
        time.sleep(0.05)


def assert_intact(case: str, pods: dict, cores: dict, url: str, path: str, body: dict) -> None:
    """How every hostile case must end: each pod's engine core the same process, a normal
    request through ``url`` answered, and no pod holding a request or a KV block."""
    now = {name: pod.core_pid() for name, pod in pods.items()}
    assert now == cores, f"{case}: an engine core was replaced ({cores} -> {now})"
    resp = httpx.post(url + path, json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, f"after {case}: {resp.status_code} {resp.text[:300]}"
    assert resp.json()["usage"]["completion_tokens"] >= 1
    for pod in pods.values():
        assert_settled(pod.url)
