"""LoRA through a P/D pool: a real prefill pod and a real decode pod (both ``--enable-lora``
with the same two adapters, KV over a real redis-server) behind the real router in P/D mode
answer the official ``openai`` client, for the base model and each adapter, token for token
as one colocated ``epdserve serve --enable-lora`` pod does. The decode pod loads every full
prompt block from the prefill pod, and one prompt asked for each model in turn never hits
another model's blocks, on either pod."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from pd_support import SEED, PDRouter, loadable_tokens, prompts, transfer_config
from serving_support import ServerProcess

from epdserve.common import metrics_text
from epdserve.engine.lora.random_adapters import write_random_adapters

MODELS = ("lora0", "lora1", "tiny")  # the adapters first: the base model asks last
MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "tell me about caches and adapters " * 3}]
RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}


@pytest.fixture(scope="module")
def pool(models, redis_server, tmp_path_factory):
    """``(colocated, prefill, decode, router)``: the pods start together, then the router.
    The adapters are ``make-model --lora 2``'s (the same writer, beside the shared model)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    model = str(models.get("llama"))
    loras = write_random_adapters(model, 2, out=tmp_path_factory.mktemp("loras"))
    lora = ["--enable-lora", "--max-loras", "2"]
    for path in loras:
        lora += ["--lora-modules", f"{path.name}={path}"]
    extra = {"url": redis_server.url, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}

    def pd(role: str, kv_role: str) -> list[str]:
        config = transfer_config("RedisConnector", kv_role, extra)
        return ["--role", role, "--kv-transfer-config", config, "--hash-seed", SEED]

    flags = {
        "colocated": lora,
        "prefill": [*pd("prefill", "kv_producer"), *lora],
        "decode": [*pd("decode", "kv_consumer"), *lora],
    }
    pods, router = {}, None
    try:
        with ThreadPoolExecutor(len(flags)) as workers:
            futures = {
                name: workers.submit(ServerProcess, model, *f, api_key=None, env=RUNTIME_LORA)
                for name, f in flags.items()
            }
            for name, future in futures.items():
                pods[name] = future.result()
        router = PDRouter(model, pods["prefill"], pods["decode"])
        yield pods["colocated"], pods["prefill"], pods["decode"], router
    finally:
        if router is not None:
            router.stop()
        with ThreadPoolExecutor(len(flags)) as workers:  # each pod takes seconds to stop
            list(workers.map(ServerProcess.stop, pods.values()))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(url: str, model: str, prompt: list[int]) -> tuple[str, tuple[str, ...]]:
    with client(url) as c:
        out = c.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
    assert out.model == model and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].text, tuple(out.choices[0].logprobs.tokens)


def chat(url: str, model: str) -> str:
    with client(url) as c:
        out = c.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    assert out.model == model and out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].message.content


def counters(pod: ServerProcess) -> dict[str, float]:
    """The pod's prefix-cache and KV-load counters, and its finished requests per model."""
    page = httpx.get(pod.url + "/metrics", timeout=5).text

    def total(name: str, **labels) -> float:
        return sum(metrics_text.values(page, name, **labels))

    out = {
        "local_hits": total("vllm:prefix_cache_hits_total"),
        "external_hits": total("vllm:external_prefix_cache_hits_total"),
        "load_failures": total("epdserve:kv_load_failures_total"),
    }
    for name in MODELS[:2]:
        out[name] = total("epdserve:lora_requests_total", lora_name=name)
    return out


def grew(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def test_one_prompt_per_model_answers_as_colocated_and_loads_only_its_own_blocks(pool):
    colocated, prefill, decode, router = pool
    prompt = prompts(seed=29, lengths=(70,))[0]  # 4 full 16-token blocks + 6 tokens
    answers = {}
    for model in MODELS:
        before = {pod: counters(pod) for pod in (prefill, decode)}
        answers[model] = complete(router.url, model, prompt)
        assert answers[model] == complete(colocated.url, model, prompt), model
        on_prefill = grew(before[prefill], counters(prefill))
        on_decode = grew(before[decode], counters(decode))
        # the decode pod loaded every full block from the prefill pod and found none of the
        # other models' blocks for the same tokens in its own cache; nor did the prefill pod
        assert on_decode["external_hits"] == loadable_tokens(prompt), (model, on_decode)
        assert on_decode["local_hits"] == 0 and on_prefill["local_hits"] == 0, model
        assert on_decode["load_failures"] == 0
        for name in MODELS[:2]:  # both legs ran with the request's adapter
            assert on_prefill[name] == on_decode[name] == (name == model), (model, name)
    assert len(set(answers.values())) == len(MODELS)  # each adapter changes the answer


def test_chat_per_model_answers_as_colocated_through_both_legs(pool):
    colocated, prefill, decode, router = pool
    answers = {}
    for model in MODELS:
        before = counters(decode)
        answers[model] = chat(router.url, model)
        assert answers[model] == chat(colocated.url, model), model
        assert grew(before, counters(decode))["external_hits"] >= 16, model  # KV was loaded
    assert len(set(answers.values())) == len(MODELS)


def test_a_streamed_adapter_completion_joins_to_the_colocated_text(pool):
    colocated, _, _, router = pool
    prompt = prompts(seed=30, lengths=(40,))[0]
    with client(router.url) as c:
        chunks = list(
            c.completions.create(
                model="lora1",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    assert {c.model for c in chunks} == {"lora1"}
    assert (
        "".join(c.choices[0].text for c in chunks if c.choices)
        == (complete(colocated.url, "lora1", prompt)[0])
    )


def adapter_path(pod: ServerProcess, name: str) -> str:
    models = httpx.get(pod.url + "/v1/models", timeout=5).json()["data"]
    return next(m["root"] for m in models if m["id"] == name)


def load_on(pods, name: str, path: str | None) -> None:
    """Unload ``name`` from each pod when ``path`` is None, else load it from ``path``."""
    for pod in pods:
        if path is None:
            r = httpx.post(pod.url + "/v1/unload_lora_adapter", json={"lora_name": name})
        else:
            body = {"lora_name": name, "lora_path": path}
            r = httpx.post(pod.url + "/v1/load_lora_adapter", json=body, timeout=30)
        assert r.status_code == 200, r.text


def complete_once_listed(router: PDRouter, model: str, prompt: list[int]):
    """``complete`` through the router once it knows a pod holds ``model`` (it reads the
    pods' models now and then: until then it answers 404)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return complete(router.url, model, prompt)
        except openai.NotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_an_adapter_reloaded_from_other_files_on_both_legs_never_meets_the_old_blocks(pool):
    """The prefill pod holds the first files' blocks in its cache and in the shared store;
    after the reload under the same name neither pod finds them, and the answer is the new
    files' (lora1 on the colocated pod serves the same files)."""
    colocated, prefill, decode, router = pool
    prompt = prompts(seed=31, lengths=(70,))[0]
    first, second = adapter_path(colocated, "lora0"), adapter_path(colocated, "lora1")
    load_on((prefill, decode), "swap", first)
    old = complete_once_listed(router, "swap", prompt)
    assert old == complete(colocated.url, "lora0", prompt)
    load_on((prefill, decode), "swap", None)
    load_on((prefill, decode), "swap", second)
    before = {pod: counters(pod) for pod in (prefill, decode)}
    new = complete(router.url, "swap", prompt)
    assert new == complete(colocated.url, "lora1", prompt) != old
    on_prefill = grew(before[prefill], counters(prefill))
    on_decode = grew(before[decode], counters(decode))
    assert on_prefill["local_hits"] == 0 and on_decode["local_hits"] == 0
    assert on_decode["external_hits"] == loadable_tokens(prompt)  # the new blocks, handed over
    assert on_decode["load_failures"] == 0
    load_on((prefill, decode), "swap", None)
