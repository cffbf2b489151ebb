"""A real ``epdserve serve --enable-lora`` pod and the official openai client: adapters by
``model`` name, ``/v1/models``, runtime load/unload, bad adapters, metrics."""

from __future__ import annotations

import shutil
import threading

import httpx
import openai
import pytest
from serving_support import API_KEY, ServerProcess

from epdserve.common import metrics_text
from epdserve.engine import LLM, LoRARequest, SamplingParams
from epdserve.engine.lora.random_adapters import write_random_adapters

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    return write_random_adapters(models.get("llama"), 3, out=tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def pod(models, adapters):
    srv = ServerProcess(
        str(models.get("llama")),
        "--enable-lora",
        "--lora-modules",
        f"lora0={adapters[0]}",
        "--lora-modules",
        f'{{"name": "lora1", "path": "{adapters[1]}", "base_model_name": "tiny"}}',
        "--max-loras",
        "2",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(pod):
    return openai.OpenAI(base_url=pod.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(pod, path: str, body: dict) -> httpx.Response:
    return httpx.post(pod.url + path, json=body, headers=HEADERS, timeout=30)


def complete(client, model: str) -> list[int]:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=0
    )
    assert out.model == model
    return out.choices[0].logprobs.tokens


def test_each_adapter_answers_as_the_offline_engine_does(pod, client, models, adapters):
    llm = LLM(model=str(models.get("llama")), dtype="float32", enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = {}
    for name, lora in (("tiny", None), ("lora0", 0), ("lora1", 1)):
        req = None if lora is None else LoRARequest(name, lora + 1, str(adapters[lora]))
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=req)[0]
        want[name] = out.outputs[0].text
    got = {}
    for name in want:
        got[name] = (
            client.completions.create(model=name, prompt=PROMPT, max_tokens=6, temperature=0.0)
            .choices[0]
            .text
        )
    assert got == want
    assert len(set(got.values())) == 3  # the adapters change the answer


def test_unknown_adapter_is_404_like_an_unknown_model(client):
    with pytest.raises(openai.NotFoundError, match="lora9"):
        client.completions.create(model="lora9", prompt="hi", max_tokens=2)


def test_models_lists_the_adapters_with_their_parent(client, adapters):
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:3] == ["tiny", "lora0", "lora1"]
    assert models["lora0"].parent == "tiny" and models["lora0"].root == str(adapters[0])
    assert models["tiny"].parent is None


def test_bad_adapters_are_refused_at_load_and_the_pod_keeps_serving(
    pod, client, adapters, tmp_path
):
    bad = tmp_path / "bad"
    shutil.copytree(adapters[2], bad)
    (bad / "adapter_config.json").write_text(
        '{"r": 64, "lora_alpha": 8, "target_modules": ["q_proj"]}'
    )
    cases = {
        str(bad): "rank 64 is above max_lora_rank 16",
        str(tmp_path / "none"): "is not a directory",
    }
    for path, message in cases.items():
        r = post(pod, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
        assert r.status_code == 400 and message in r.json()["error"]["message"]
    r = post(pod, "/v1/load_lora_adapter", {"lora_name": "lora0", "lora_path": str(adapters[2])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    assert complete(client, "lora0")


def test_load_serve_unload_and_a_request_for_an_unloaded_adapter(pod, client, adapters, tmp_path):
    path = tmp_path / "l2"
    shutil.copytree(adapters[2], path)
    r = post(pod, "/v1/load_lora_adapter", {"lora_name": "lora2", "lora_path": str(path)})
    assert r.status_code == 200 and "added successfully" in r.text
    assert complete(client, "lora2") != complete(client, "tiny")
    r = post(pod, "/v1/unload_lora_adapter", {"lora_name": "lora2"})
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "lora2")
    assert post(pod, "/v1/unload_lora_adapter", {"lora_name": "lora2"}).status_code == 404
    shutil.rmtree(path)  # gone: loading it again is refused, naming why
    r = post(pod, "/v1/load_lora_adapter", {"lora_name": "lora2", "lora_path": str(path)})
    assert r.status_code == 400 and "is not a directory" in r.json()["error"]["message"]
    assert complete(client, "lora0")


@pytest.mark.parametrize("times", [10, pytest.param(100, marks=pytest.mark.slow)])
def test_loading_and_unloading_under_requests_leaks_nothing(pod, client, adapters, times):
    stop, errors = threading.Event(), []

    def traffic():
        while not stop.is_set():
            try:
                for model in ("lora0", "lora1", "tiny"):
                    complete(client, model)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(times):
        body = {"lora_name": "churn", "lora_path": str(adapters[i % 3])}
        assert post(pod, "/v1/load_lora_adapter", body).status_code == 200
        if i % 10 == 0:
            assert complete(client, "churn")
        assert post(pod, "/v1/unload_lora_adapter", {"lora_name": "churn"}).status_code == 200
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors
    page = httpx.get(pod.url + "/metrics", timeout=5).text
    assert metrics_text.values(page, "vllm:num_requests_running") == [0.0]
    assert metrics_text.values(page, "vllm:kv_cache_usage_perc") == [0.0]
    assert [m.id for m in client.models.list().data] == ["tiny", "lora0", "lora1"]


def test_metrics_name_the_adapters(pod, client):
    complete(client, "lora1")
    page = httpx.get(pod.url + "/metrics", timeout=5).text
    assert 'vllm:lora_requests_info{max_lora="2"' in page
    counted = [
        line for line in page.splitlines()
        if line.startswith("epdserve:lora_requests_total{") and 'lora_name="lora1"' in line
    ]  # fmt: skip
    assert counted and float(counted[0].split()[-1]) >= 1


def test_chat_streams_name_the_adapter(client):
    stream = client.chat.completions.create(
        model="lora1",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0.0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks and all(c.model == "lora1" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


LONG = [(7 * i + 3) % 4000 + 10 for i in range(300)]  # full blocks at any block size <= 256


def answer(client, model: str) -> tuple[tuple[str, ...], int]:
    """The tokens ``model`` answers LONG with, and how many prompt tokens came from cache."""
    out = client.completions.create(
        model=model, prompt=LONG, max_tokens=6, temperature=0.0, logprobs=0
    )
    return tuple(out.choices[0].logprobs.tokens), out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("inplace", [False, True], ids=["unload-then-load", "load_inplace"])
def test_an_adapter_reloaded_from_other_files_never_meets_the_old_files_blocks(
    pod, client, adapters, inplace
):
    name = f"swapped-{int(inplace)}"
    assert post(pod, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[0])})
    old, _ = answer(client, name)
    again, hit = answer(client, name)
    assert again == old and hit > 0  # its own blocks are found again
    if not inplace:
        assert post(pod, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
    body = {"lora_name": name, "lora_path": str(adapters[1]), "load_inplace": inplace}
    assert post(pod, "/v1/load_lora_adapter", body).status_code == 200
    new, cached = answer(client, name)
    assert cached == 0  # the first files' blocks are another adapter's
    assert new == answer(client, "lora1")[0] != old  # lora1 is served from the same files
    assert answer(client, name) == (new, hit)  # and the new files' blocks are shared
    assert post(pod, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200
