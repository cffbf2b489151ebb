"""Store faults never fail a request: the decode pod recomputes, counts it, and reconnects.

Every answer is compared token for token with a colocated pod's.
"""

from __future__ import annotations

import signal
import time

import redis
import torch
from pd_support import (
    BLOCK,
    answer,
    greedy,
    loadable_blocks,
    loadable_tokens,
    loaded_tokens,
    post,
    prompts,
)

from epdserve.connectors.storage import KVBlockMeta, KVPart, encode_kv_block

FAILURES = "epdserve:kv_load_failures_total"
HITS = "vllm:external_prefix_cache_hits_total"


def prefill(pods, prompt) -> dict:
    body = {**greedy(prompt, 1), "kv_transfer_params": {"do_remote_decode": True}}
    return post(pods.prefill, body)["kv_transfer_params"]


def decode(pods, prompt, params) -> dict:
    return post(pods.decode, {**greedy(prompt), "kv_transfer_params": params})


def assert_recomputed(pods, colocated, prompt, params, num_loaded: int) -> None:
    """The decode answer is exact; ``num_loaded`` blocks came from the store, the rest failed."""
    failures0, hits0 = pods.decode.metric(FAILURES), pods.decode.metric(HITS)
    got = decode(pods, prompt, params)
    assert answer(got) == answer(post(colocated, greedy(prompt)))
    loaded = loaded_tokens(prompt, num_loaded)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded
    expected_failures = loadable_blocks(prompt) - num_loaded
    assert pods.decode.metric(FAILURES) - failures0 == expected_failures
    assert pods.decode.metric(HITS) - hits0 == loaded


def stored_key(params: dict, index: int) -> str:
    return f"epd:kv:{params['pool']}:{params['fingerprint']}:{params['block_hashes'][index]}"


def test_a_corrupted_block_is_recomputed_from_the_first_bad_block(redis_pods, redis_url, colocated):
    prompt = prompts(seed=21, lengths=(100,))[0]
    params = prefill(redis_pods, prompt)
    client = redis.Redis.from_url(redis_url)
    client.set(stored_key(params, 2), b"\x00garbage" * 100)
    assert_recomputed(redis_pods, colocated, prompt, params, num_loaded=2)


def test_a_block_of_another_model_is_a_miss(redis_pods, redis_url, colocated):
    prompt = prompts(seed=22, lengths=(100,))[0]
    params = prefill(redis_pods, prompt)
    client = redis.Redis.from_url(redis_url)
    other = KVBlockMeta("another-model", BLOCK, "sha256_cbor", 2)
    key = stored_key(params, 0)
    value = encode_kv_block(torch.zeros(4, 2, BLOCK, 2, 32), other, key, KVPart(0, 2))
    client.set(key, value)
    assert_recomputed(redis_pods, colocated, prompt, params, num_loaded=0)


def test_a_flushed_store_means_recomputing_everything(redis_pods, redis_url, colocated):
    prompt = prompts(seed=23, lengths=(77,))[0]
    params = prefill(redis_pods, prompt)
    redis.Redis.from_url(redis_url).flushall()
    assert_recomputed(redis_pods, colocated, prompt, params, num_loaded=0)


def test_a_slow_redis_times_out_into_recomputing(redis_pods, redis_server, colocated):
    prompt = prompts(seed=24, lengths=(70,))[0]
    params = prefill(redis_pods, prompt)
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert_recomputed(redis_pods, colocated, prompt, params, num_loaded=0)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


def test_redis_killed_mid_run_then_restarted_is_reconnected(redis_pods, redis_server, colocated):
    batch = prompts(seed=25, lengths=(60, 90, 120, 45, 80, 100))
    try:
        params = prefill(redis_pods, batch[0])
        redis_server.stop()  # after the prefill pod saved, before the decode pod loads
        assert_recomputed(redis_pods, colocated, batch[0], params, num_loaded=0)
        first, second = redis_pods.run(greedy(batch[1]))  # both pods with Redis down
        assert answer(second) == answer(post(colocated, greedy(batch[1])))
        redis_server.start()
        for prompt in batch[2:]:  # the breaker lets calls through again after its backoff
            hits0 = redis_pods.decode.metric(HITS)
            _, second = redis_pods.run(greedy(prompt))
            assert answer(second) == answer(post(colocated, greedy(prompt)))
            if redis_pods.decode.metric(HITS) - hits0 == loadable_tokens(prompt):
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the pods never used Redis again after it restarted")
    finally:
        if redis_server.proc is None:
            redis_server.start()


def test_a_read_only_volume_still_serves_stored_blocks_and_recomputes_the_rest(
    shared_pods, colocated, read_only
):
    stored, fresh = prompts(seed=26, lengths=(70, 85))
    stored_params = prefill(shared_pods, stored)
    undo = read_only(str(shared_pods.volume))
    try:
        save_failures = shared_pods.prefill.metric("epdserve:kv_save_failures_total")
        fresh_params = prefill(shared_pods, fresh)  # its saves fail softly, counted
        assert shared_pods.prefill.metric("epdserve:kv_save_failures_total") > save_failures
        assert_recomputed(shared_pods, colocated, fresh, fresh_params, num_loaded=0)
        loaded = loadable_blocks(stored)
        assert_recomputed(shared_pods, colocated, stored, stored_params, num_loaded=loaded)
    finally:
        undo()
