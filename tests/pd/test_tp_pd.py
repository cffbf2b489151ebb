"""P/D between pods of different tensor-parallel sizes (DESIGN.md §10, "KV layout"): a TP 2
prefill engine hands its prompts to a TP 1 decode engine and the reverse, through Redis and a
shared volume. The decode engine answers exactly like a colocated one, loads every prompt token
but the last (the partial last block included), and computes only that last one; a block whose
second head's value is gone is recomputed, from it on. In-process engine cores (a TP 2 one runs
a worker process per rank) on the tiny llama (2 KV heads)."""

from __future__ import annotations

import json

import pytest
from pd_support import engine_core, loadable_blocks, loadable_tokens, prompts

from epdserve.connectors.storage import create_store
from epdserve.engine.config import EngineConfig
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
HAND_OVER = {"do_remote_decode": True}


def kv_engine(path: str, tp: int, extra: dict) -> EngineCore:
    """An engine core of TP ``tp`` that saves and loads through the store of ``extra``."""
    connector = "RedisConnector" if "url" in extra else "SharedStorageConnector"
    transfer = {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}
    config = EngineConfig(
        model=path,
        dtype="float32",
        max_model_len=512,
        hash_seed="7",
        tensor_parallel_size=tp,
        kv_transfer_config=json.dumps(transfer),
    )
    return EngineCore(config)


def run(engine: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, tuple[list, dict]]:
    """Every request to its end: id -> (tokens, kv_transfer_params)."""
    for req in requests:
        engine.add_request(req)
    got = {r.request_id: ([], None) for r in requests}
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens, params = got[out.request_id]
            assert out.error is None, out.error
            got[out.request_id] = (tokens + out.new_token_ids, out.kv_transfer_params or params)
    assert not engine.has_unfinished_requests(), "a request never finished"
    assert engine.kv.num_free_blocks() == engine.num_blocks - 1, "KV blocks leaked"
    return got


@pytest.fixture(scope="module")
def colocated(models):
    engine = engine_core(models.get("llama"))
    yield lambda batch: [tokens for tokens, _ in run(engine, requests("c", batch, GREEDY)).values()]
    engine.close()


@pytest.fixture(scope="module", params=["redis", "shared_storage"])
def pods(request, models, tmp_path_factory):
    """``{1: engine, 2: engine}``: a TP 1 and a TP 2 engine over one store."""
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        if server.proc is None:
            server.start()
        extra = {"url": server.url, "backoff_initial_s": 0.1, "backoff_max_s": 0.5}
    else:
        extra = {"path": str(tmp_path_factory.mktemp("kv-tp"))}
    path = str(models.get("llama"))
    engines = {1: kv_engine(path, 1, extra), 2: kv_engine(path, 2, extra)}
    engines["extra"] = extra
    yield engines
    for tp in (1, 2):
        engines[tp].close()


def requests(prefix: str, batch, params, handed=None) -> list[EngineCoreRequest]:
    return [
        EngineCoreRequest(
            f"{prefix}{i}", p, params, kv_transfer_params=(handed[i] if handed else None)
        )
        for i, p in enumerate(batch)
    ]


def hand_over(prefill: EngineCore, decode: EngineCore, batch, tag: str):
    """Prefill ``batch`` with one token each, then decode it from the handed-over params:
    (decoded tokens, prefill's first tokens, params, the decode engine's prompt sources)."""
    first = run(prefill, requests(f"p{tag}", batch, ONE, [HAND_OVER] * len(batch)))
    params = [p for _, p in first.values()]
    sources = list(decode.scheduler.prompt_sources)
    failures = decode.scheduler.kv_transfer.load_failures
    got = run(decode, requests(f"d{tag}", batch, GREEDY, params))
    grew = [b - a for a, b in zip(sources, decode.scheduler.prompt_sources, strict=True)]
    failed = decode.scheduler.kv_transfer.load_failures - failures
    return [t for t, _ in got.values()], [t for t, _ in first.values()], params, grew, failed


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_decode_pod_of_another_tp_loads_the_whole_prompt_and_answers_as_colocated(
    pods, colocated, prefill_tp, decode_tp
):
    batch = prompts(seed=70 + prefill_tp, lengths=(40, 77, 100))  # partial last blocks
    decoded, firsts, params, grew, failed = hand_over(
        pods[prefill_tp], pods[decode_tp], batch, f"{prefill_tp}{decode_tp}"
    )
    assert decoded == colocated(batch)
    assert [f[0] for f in firsts] == [d[0] for d in decoded]  # the prefill's one token
    assert all(
        p["tail_hash"] and p["num_tokens"] == len(b) for p, b in zip(params, batch, strict=True)
    )
    # prompt tokens: computed, local hit, loaded: only each prompt's last one is computed
    assert grew == [len(batch), 0, sum(map(loadable_tokens, batch))] and failed == 0


def test_a_block_with_one_heads_value_gone_is_recomputed_from_it(pods, colocated):
    batch = prompts(seed=80, lengths=(100,))
    first = run(pods[2], requests("pg", batch, ONE, [HAND_OVER]))
    params = next(iter(first.values()))[1]
    store = create_store({k: v for k, v in pods["extra"].items() if "backoff" not in k})
    prefix = f"epd:kv:{params['pool']}:{params['fingerprint']}:{params['block_hashes'][1]}"
    values = store.get_many([f"{prefix}@h0+1", f"{prefix}@h1+1"])
    assert [b'"tp":"0/2"' in values[0], b'"tp":"1/2"' in values[1]] == [True, True]  # per rank
    assert store.delete_many([f"{prefix}@h1+1"]) == 1  # rank 1's half of block 1 is gone
    store.close()
    sources = list(pods[1].scheduler.prompt_sources)
    failures = pods[1].scheduler.kv_transfer.load_failures
    got = run(pods[1], requests("dg", batch, GREEDY, [params]))
    assert [t for t, _ in got.values()] == colocated(batch)
    grew = [b - a for a, b in zip(sources, pods[1].scheduler.prompt_sources, strict=True)]
    assert grew == [100 - 16, 0, 16]  # block 0 loaded; block 1 is half there: a miss
    assert pods[1].scheduler.kv_transfer.load_failures - failures == loadable_blocks(batch[0]) - 1


def test_at_the_cpu_block_size_a_200_token_prompt_costs_the_decode_pod_one_token(models, tmp_path):
    """The issue's case: 200 prompt tokens, 128-token blocks. Before, the hand-over named the
    full block only (``tail_hash`` absent, as an older prefill pod sends it) and the decode
    pod computed the 72 tokens after it; now it computes the last one."""
    path = models.get("llama")
    big = dict(block_size=128, hash_seed="7")
    prefill = engine_core(path, "prefill", tmp_path, **big)
    decode = engine_core(path, "decode", tmp_path, **big)
    batch = prompts(seed=90, lengths=(200,))
    params = next(iter(run(prefill, requests("p", batch, ONE)).values()))[1]
    assert params["num_tokens"] == 200 and len(params["block_hashes"]) == 1
    full_blocks_only = {k: v for k, v in params.items() if k != "tail_hash"}
    alone = engine_core(path, **big)
    expected = [t for t, _ in run(alone, requests("c", batch, GREEDY)).values()]
    computed = []
    for tag, handed in (("before", full_blocks_only), ("after", params)):
        sources = list(decode.scheduler.prompt_sources)
        got = run(decode, requests(tag, batch, GREEDY, [handed]))
        assert [t for t, _ in got.values()] == expected, tag
        computed.append(decode.scheduler.prompt_sources[0] - sources[0])
        assert decode.kv.reset_prefix_cache()  # the next run loads from the store again
    assert computed == [72, 1]
    for engine in (prefill, decode, alone):
        engine.close()


@pytest.mark.slow
def test_a_tp4_prefill_with_replicated_heads_hands_over_to_a_tp2_decode(
    models, tmp_path, colocated
):
    """At TP 4 the 2 KV heads are replicated: ranks 0 and 2 store them, ranks 1 and 3 leave it
    to them; the TP 2 decode engine loads every prompt token but the last."""
    path = str(models.get("llama"))
    extra = {"path": str(tmp_path)}
    prefill, decode = kv_engine(path, 4, extra), kv_engine(path, 2, extra)
    try:
        batch = prompts(seed=95, lengths=(45, 90))
        decoded, _, params, grew, failed = hand_over(prefill, decode, batch, "42")
        assert decoded == colocated(batch)
        assert grew == [len(batch), 0, sum(map(loadable_tokens, batch))] and failed == 0
        store = create_store(extra)
        prefix = f"epd:kv:{params[0]['pool']}:{params[0]['fingerprint']}"
        value = store.get_many([f"{prefix}:{params[0]['block_hashes'][0]}@h1+1"])[0]
        assert b'"tp":"2/4"' in value  # head 1's first replica wrote it
        store.close()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_pod_of_another_tp_finds_a_stored_prompt_by_lookup(
    pods, colocated, prefill_tp, decode_tp
):
    """No params: the decode engine looks the prompt up, its own cut first, then the other."""
    batch = prompts(seed=85 + prefill_tp, lengths=(70,))
    run(pods[prefill_tp], requests(f"pl{prefill_tp}", batch, ONE, [HAND_OVER]))
    sources = list(pods[decode_tp].scheduler.prompt_sources)
    got = run(pods[decode_tp], requests(f"dl{decode_tp}", batch, GREEDY))
    assert [t for t, _ in got.values()] == colocated(batch)
    grew = [b - a for a, b in zip(sources, pods[decode_tp].scheduler.prompt_sources, strict=True)]
    assert grew == [1, 0, 69]
