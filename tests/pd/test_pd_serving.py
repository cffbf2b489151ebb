"""A prefill pod → decode pod pair answers exactly like a colocated pod, loading the prompt."""

from __future__ import annotations

import httpx
import pytest
from pd_support import answer, greedy, loadable_tokens, post, prompts, source_tokens

BACKENDS = ("redis_pods", "shared_pods")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_pod_answers_like_a_colocated_pod_and_loads_all_but_the_last_token(
    request, backend, colocated
):
    pods = request.getfixturevalue(backend)
    hits0 = pods.decode.metric("vllm:external_prefix_cache_hits_total")
    failures0 = pods.decode.metric("epdserve:kv_load_failures_total")
    computed0 = source_tokens(pods.decode, "local_compute")
    external0 = source_tokens(pods.decode, "external_kv_transfer")
    expected_hits = expected_computed = 0
    for prompt in prompts(seed=1 + BACKENDS.index(backend)):
        first, second = pods.run(greedy(prompt))
        assert answer(second) == answer(post(colocated, greedy(prompt)))
        assert first["choices"][0]["text"] == answer(second)[1][0]  # prefill's one token
        assert second["kv_transfer_params"] is None
        hashes = first["kv_transfer_params"]["block_hashes"]
        assert len(hashes) == len(prompt) // 16
        assert ("tail_hash" in first["kv_transfer_params"]) == (len(prompt) % 16 >= 2)
        # the loaded blocks count as computed: no prefill compute for them on the decode pod
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable_tokens(prompt)
        expected_hits += loadable_tokens(prompt)
        expected_computed += len(prompt) - loadable_tokens(prompt)
    hits = pods.decode.metric("vllm:external_prefix_cache_hits_total") - hits0
    assert hits == expected_hits
    # vLLM's prompt-token sources: the decode pod computed only each prompt's last token
    assert source_tokens(pods.decode, "local_compute") - computed0 == expected_computed
    assert source_tokens(pods.decode, "external_kv_transfer") - external0 == expected_hits
    assert pods.decode.metric("epdserve:kv_load_failures_total") == failures0


def test_a_decode_pod_finds_a_stored_prompt_by_lookup_without_params(shared_pods, colocated):
    prompt = prompts(seed=13, lengths=(66,))[0]
    post(shared_pods.prefill, greedy(prompt, 1))  # a prefill pod saves whatever it computes
    hits0 = shared_pods.decode.metric("vllm:external_prefix_cache_hits_total")
    body = post(shared_pods.decode, greedy(prompt))
    assert answer(body) == answer(post(colocated, greedy(prompt)))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == loadable_tokens(prompt)
    hits = shared_pods.decode.metric("vllm:external_prefix_cache_hits_total") - hits0
    assert hits == loadable_tokens(prompt)


def test_streaming_from_the_decode_pod_matches_the_colocated_answer(redis_pods, colocated):
    prompt = prompts(seed=11, lengths=(90,))[0]
    first = post(
        redis_pods.prefill, {**greedy(prompt, 1), "kv_transfer_params": {"do_remote_decode": True}}
    )
    body = {**greedy(prompt), "stream": True, "kv_transfer_params": first["kv_transfer_params"]}
    body.pop("logprobs")
    text = ""
    with httpx.stream(
        "POST", redis_pods.decode.url + "/v1/completions", json=body, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == answer(post(colocated, greedy(prompt)))[0]


def test_a_prefill_pod_answers_with_kv_transfer_params_even_unasked(redis_pods):
    prompt = prompts(seed=12, lengths=(50,))[0]
    body = post(redis_pods.prefill, greedy(prompt, 1))
    assert body["kv_transfer_params"]["num_tokens"] == 50  # 3 full blocks and a 2-token tail
    assert body["kv_transfer_params"]["pool"] == "default"


@pytest.mark.parametrize(
    "params, field",
    [
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
        ({"block_hashes": ["not-hex"]}, "kv_transfer_params.block_hashes"),
        ({"num_tokens": -1}, "kv_transfer_params.num_tokens"),
        ([1, 2], "kv_transfer_params"),
    ],
)
def test_malformed_kv_transfer_params_are_a_400_naming_the_field(redis_pods, params, field):
    body = {**greedy([5, 6, 7]), "kv_transfer_params": params}
    resp = httpx.post(redis_pods.decode.url + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == field
