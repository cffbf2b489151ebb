"""The hostile-input table: requests a pod (and a router in front of it) must refuse with a
4xx in OpenAI's error shape, without harming anything else. Shared by the pod and router
tests; ``docs/operations.md`` lists what each gets."""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from serving_support import API_KEY

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
