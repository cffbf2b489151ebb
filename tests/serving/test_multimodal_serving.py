"""Image chat through a real ``epdserve serve`` of a tiny Gemma3, with the openai client."""

from __future__ import annotations

import base64
import io

import httpx
import image_bombs
import pytest
from hostile_inputs import IMAGE_BOMBS, check, send
from openai import OpenAI
from serving_support import ServerProcess


def data_url(color, size=(80, 50)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def gemma_server(models):
    srv = ServerProcess(str(models.get("gemma3")), api_key=None)
    yield srv
    srv.stop()


def chat(client, url, text="what is it"):
    return client.chat.completions.create(
        model="tiny",
        max_tokens=8,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": text},
                ],
            }
        ],
    )


def test_image_chat_matches_offline_and_repeated_images_hit_the_encoder_cache(gemma_server, models):
    from epdserve.engine import LLM, SamplingParams

    srv = gemma_server
    client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    red = data_url((200, 10, 30))
    first = chat(client, red)
    llm = LLM(model=str(models.get("gemma3")), max_model_len=512)
    offline = llm.chat(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": red}},
                    {"type": "text", "text": "what is it"},
                ],
            }
        ],
        SamplingParams(temperature=0, max_tokens=8),
    )[0]
    assert first.choices[0].message.content == offline.outputs[0].text
    runs = srv.metric("epdserve:encoder_runs_total")
    chat(client, red, "and now?")  # same image, new text: no prefix hit, encoder cache hit
    assert srv.metric("epdserve:encoder_runs_total") == runs == 1
    assert srv.metric("epdserve:encoder_cache_hits_total") >= 1


@pytest.mark.parametrize(
    "url, fragment",
    [
        ("data:image/png;base64,!!!", "invalid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a decodable"),
        ("https://example.com/cat.png", "not allowed"),
    ],
)
def test_bad_images_get_a_400_naming_the_part(gemma_server, url, fragment):
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    resp = httpx.post(gemma_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "messages[0].content[1]" and fragment in error["message"]
    ok = httpx.post(
        gemma_server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert ok.status_code == 200


def test_pan_and_scan_per_request_and_bad_processor_options_get_a_400(gemma_server):
    client = OpenAI(base_url=gemma_server.url + "/v1", api_key="x", max_retries=0)
    wide = data_url((20, 90, 200), size=(900, 300))  # 3:1, crops of 300 px
    plain = chat(client, wide)
    runs = gemma_server.metric("epdserve:encoder_runs_total")
    content = [
        {"type": "image_url", "image_url": {"url": wide}},
        {"type": "text", "text": "what is it"},
    ]
    scanned = client.chat.completions.create(
        model="tiny",
        max_tokens=8,
        temperature=0,
        messages=[{"role": "user", "content": content}],
        extra_body={"mm_processor_kwargs": {"do_pan_and_scan": True}},
    )
    assert scanned.usage.prompt_tokens > plain.usage.prompt_tokens  # the crops' placeholders
    assert gemma_server.metric("epdserve:encoder_runs_total") - runs == 4  # original + 3 crops
    for bad, param in [
        ({"do_pan_and_scan": "yes"}, "mm_processor_kwargs.do_pan_and_scan"),
        ({"crop_everything": True}, "mm_processor_kwargs.crop_everything"),
    ]:
        resp = httpx.post(
            gemma_server.url + "/v1/chat/completions",
            timeout=30,
            json={
                "model": "tiny",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": content}],
                "mm_processor_kwargs": bad,
            },
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


def test_every_image_bomb_gets_a_400_naming_the_part_and_the_core_lives(gemma_server):
    core = gemma_server.core_pid()
    for case in IMAGE_BOMBS:
        check(send(gemma_server.url, case), case)
    assert gemma_server.core_pid() == core
    client = OpenAI(base_url=gemma_server.url + "/v1", api_key="x", max_retries=0)
    answer = chat(client, data_url((30, 60, 90)))
    assert answer.choices[0].finish_reason and answer.usage.completion_tokens >= 1


def test_an_animated_gif_of_100000_frames_is_served_as_its_first_frame(gemma_server):
    client = OpenAI(base_url=gemma_server.url + "/v1", api_key="x", max_retries=0)
    frames = image_bombs.gif(64, 48, 100_000)  # 2.4 MB; only frame 0 is ever decoded
    answer = chat(client, image_bombs.data_url(frames, "image/gif"))
    assert answer.usage.completion_tokens >= 1
