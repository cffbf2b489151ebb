"""Bad input gets OpenAI-shaped errors naming the field, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

AUTH = {"Authorization": "Bearer test-key"}


def post(server, path, body=None, raw=None, headers=AUTH):
    if raw is not None:
        return httpx.post(
            server.url + path,
            content=raw,
            headers={**headers, "content-type": "application/json"},
            timeout=30,
        )
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def assert_error(resp, status: int, param: str | None = None, text: str | None = None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if text is not None:
        assert text in error["message"], error


def test_malformed_json_is_a_400(server):
    assert_error(post(server, "/v1/completions", raw="{not json"), 400, text="JSON")


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("temperature", "hot", "temperature"),
        ("max_tokens", -1, "max_tokens"),
        ("n", 0, "n"),
        ("top_p", 1.5, "top_p"),
        ("temperature", -0.5, "temperature"),
        ("stop", 5, "stop"),
    ],
)
def test_wrong_types_and_out_of_range_values_name_the_field(server, field, value, param):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, field: value}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].split(".")[0] == param


def test_chat_without_messages_names_the_field(server):
    assert_error(post(server, "/v1/chat/completions", {"model": "tiny"}), 400, "messages")


def test_prompt_plus_max_tokens_over_the_context_says_by_how_much(server):
    body = {"model": "tiny", "prompt": "x = 1\n" * 60, "max_tokens": 500}
    resp = post(server, "/v1/completions", body)
    assert_error(resp, 400, "max_tokens", "maximum context length is 512")
    assert "too many" in resp.json()["error"]["message"]


def test_prompt_alone_over_the_context_is_a_400(server):
    assert_error(
        post(server, "/v1/completions", {"model": "tiny", "prompt": list(range(10, 600))}),
        400,
        "input_tokens",
    )


def test_unknown_model_is_a_404(server):
    assert_error(post(server, "/v1/completions", {"model": "nope", "prompt": "x"}), 404, "model")


def test_missing_or_wrong_api_key_is_a_401(server):
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, headers={}), 401)
    assert_error(
        post(server, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"}),
        401,
    )


def test_image_parts_are_rejected_for_a_text_model(server):
    body = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                ],
            }
        ],
    }
    assert_error(post(server, "/v1/chat/completions", body), 400, "messages[0].content[0]")


def test_server_still_serves_after_bad_requests(server):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 3, "ignore_eos": True}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
