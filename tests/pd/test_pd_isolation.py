"""P/D under faults at once: Redis killed while decodes run, and one request whose step
raises on the decode pod. Every other answer equals a colocated pod's, token for token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pd_support import PDPods, answer, greedy, post, prompts


@pytest.fixture(scope="module")
def faulty_pods(models, redis_server):
    if redis_server.proc is None:
        redis_server.start()
    extra = {"url": redis_server.url, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}
    env = {"EPDSERVE_INJECT_FAULT": "execute:poison"}
    pods = PDPods(str(models.get("llama")), "RedisConnector", extra, env)
    yield pods
    pods.stop()


def decode(pods, prompt, params, request_id=None) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    body = {**greedy(prompt, 24), "kv_transfer_params": params}
    return httpx.post(pods.decode.url + "/v1/completions", json=body, headers=headers, timeout=120)


def test_redis_killed_and_a_failing_request_leave_the_other_answers_exact(
    faulty_pods, redis_server, colocated
):
    batch = prompts(seed=41, lengths=(60, 90, 120, 45, 80, 100, 70, 110))
    pods = faulty_pods
    try:
        prefill = {**greedy(batch[0], 1), "kv_transfer_params": {"do_remote_decode": True}}
        params = [post(pods.prefill, {**prefill, "prompt": p})["kv_transfer_params"] for p in batch]
        with ThreadPoolExecutor(len(batch)) as pool:
            futures = [
                pool.submit(decode, pods, p, k, "poison-7" if i == 7 else None)
                for i, (p, k) in enumerate(zip(batch, params, strict=True))
            ]
            futures[0].result()
            redis_server.stop()  # the other decodes are queued or loading
            results = [f.result() for f in futures]
        for prompt, resp in zip(batch[:7], results[:7], strict=True):
            assert resp.status_code == 200, resp.text
            expected = post(colocated, greedy(prompt, 24))
            assert answer(resp.json()) == answer(expected)
        assert results[7].status_code == 500 and "injected" in results[7].text
        assert pods.decode.metric("epdserve:engine_failed_steps_total") >= 1
        for pod in (pods.prefill, pods.decode):
            assert httpx.get(pod.url + "/health").status_code == 200
    finally:
        if redis_server.proc is None:
            redis_server.start()
