"""An adapter is its name and the digest of its files: a name loaded from other files names
other KV blocks (in the engine, its events and the router's keys), the core checks the bytes
it loads against the digest, and its host memory is bounded by ``max_cpu_loras`` however
many names are loaded, one read per set of files."""

from __future__ import annotations

import shutil
import time

import pytest

from epdserve.connectors.kv_events import BlockStored, EventBatch, EventDecoder, EventEncoder
from epdserve.connectors.kv_events.keys import request_keys, root_key
from epdserve.engine import LLM, SamplingParams
from epdserve.engine.core.hashing import BlockHasher, sha256_cbor
from epdserve.engine.lora.digest import adapter_digest
from epdserve.engine.lora.manager import LoRALoadError, LoRAManager
from epdserve.engine.lora.random_adapters import write_random_adapters
from epdserve.engine.lora.registry import LoRARegistry
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.models.config import load_model_config
from epdserve.router.index import PrefixIndex


@pytest.fixture(scope="module")
def setup(models, tmp_path_factory):
    path = models.get("llama")
    paths = write_random_adapters(path, 3, out=tmp_path_factory.mktemp("loras"))
    return path, paths


def wait_read(manager: LoRAManager, lora: LoRARequest):
    """``_host_weights`` until the read finishes (it runs on the loader thread)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        weights = manager._host_weights(lora)
        if weights is not None:
            return weights
        time.sleep(0.01)
    raise AssertionError("adapter never read")


def test_a_name_reloaded_from_other_files_gets_another_digest_and_other_block_hashes(setup):
    path, (a, b, _) = setup
    registry = LoRARegistry(str(path), 16, "tiny")
    first = registry.add("x", str(a))
    registry.remove("x")
    second = registry.add("x", str(b))
    assert first.digest == adapter_digest(a) != second.digest == adapter_digest(b)
    hasher = BlockHasher(4, sha256_cbor, b"root")
    tokens = list(range(8))
    hashes = {}
    for lora in (first, second):
        hashes[lora.digest] = []
        hasher.extend(hashes[lora.digest], tokens, lora_key=(lora.lora_name, lora.digest))
    assert hashes[first.digest][0] != hashes[second.digest][0]


def test_the_offline_engine_stamps_the_digest_and_serves_the_new_files_under_an_old_name(
    setup, tmp_path, caplog
):
    path, (a, b, _) = setup
    llm = LLM(model=str(path), dtype="float32", block_size=16, enable_lora=True, max_loras=1)
    prompt = [{"prompt_token_ids": list(range(20, 60))}]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    swapped = tmp_path / "x"
    shutil.copytree(a, swapped)
    lora = LoRARequest("x", 1, str(swapped))
    before = llm.generate(prompt, params, lora_request=lora)[0]
    shutil.rmtree(swapped)
    shutil.copytree(b, swapped)
    # the same request object, files changed under it: the core refuses the new bytes (its
    # host copy was read under the old digest, so a fresh engine shows the check)
    fresh = LLM(model=str(path), dtype="float32", block_size=16, enable_lora=True, max_loras=1)
    stale = LoRARequest("x", 1, str(swapped), digest=adapter_digest(a))
    refused = fresh.generate(prompt, params, lora_request=stale)[0].outputs[0]
    assert refused.finish_reason == "abort" and not refused.token_ids
    assert "files changed since it was loaded" in caplog.text
    reloaded = LoRARequest("x", 2, str(swapped))  # a new id: the digest of the new files
    after = llm.generate(prompt, params, lora_request=reloaded)[0]
    want = fresh.generate(prompt, params, lora_request=LoRARequest("y", 3, str(b)))[0]
    assert after.outputs[0].token_ids == want.outputs[0].token_ids
    assert before.outputs[0].token_ids != after.outputs[0].token_ids
    assert after.num_cached_tokens == 0  # the first files' blocks were not met


def test_many_names_over_one_set_of_files_are_read_once(setup):
    path, (a, _, _) = setup
    cfg = load_model_config(path)
    manager = LoRAManager(cfg, 2, 16, 2)
    digest = adapter_digest(a)
    names = [LoRARequest(f"n{i}", i + 1, str(a), digest=digest) for i in range(200)]
    for lora in names:
        manager.prefetch(lora)
    assert len(manager.loading) + len(manager.host) == 1
    wait_read(manager, names[-1])
    for lora in names:
        assert manager._host_weights(lora) is not None
    assert manager.num_loads == 1 and len(manager.host) == 1
    manager.close()


def test_host_weights_and_reads_in_flight_stay_within_max_cpu_loras(setup, tmp_path):
    path, (a, b, c) = setup
    cfg = load_model_config(path)
    manager = LoRAManager(cfg, 2, 16, 2)
    loras = []
    for i in range(12):  # twelve distinct sets of files: copies with a marker in the config
        d = tmp_path / f"copy{i}"
        shutil.copytree((a, b, c)[i % 3], d)
        config = d / "adapter_config.json"
        config.write_text(config.read_text().replace("{", f'{{"copy": {i}, ', 1))
        loras.append(LoRARequest(f"c{i}", i + 1, str(d), digest=adapter_digest(d)))
    for lora in loras:  # every name loaded at once: reads beyond the bound are not queued
        manager.prefetch(lora)
        assert len(manager.loading) <= 2 and len(manager.host) <= 2
    for lora in loras:  # then each asked for in turn
        wait_read(manager, lora)
        assert len(manager.loading) <= 2 and len(manager.host) <= 2
    assert manager.num_loads == 12
    manager.close()


def test_files_changed_since_the_load_fail_the_request_naming_why(setup, tmp_path):
    path, (a, b, _) = setup
    cfg = load_model_config(path)
    manager = LoRAManager(cfg, 1, 16, 1)
    lora = LoRARequest("x", 1, str(b), digest=adapter_digest(a))
    with pytest.raises(LoRALoadError, match="'x': lora_path: the adapter's files changed"):
        wait_read(manager, lora)
    manager.close()


def test_events_carry_the_digest_and_the_router_keys_each_pod_by_its_own_version():
    d1, d2 = "1" * 32, "2" * 32
    tokens = list(range(32))

    def stored(digest: str, hashes: list[int]) -> EventBatch:
        event = BlockStored(
            hashes, None, tokens, 16, 1, "GPU", "x", extra_keys=[["x"], ["x"]], lora_digest=digest
        )
        return EventDecoder().decode(EventEncoder().encode(EventBatch(0.0, [event])))

    batch = stored(d1, [1, 2])
    assert batch.events[0].lora_digest == d1 and batch.events[0].extra_keys == [["x"], ["x"]]
    index = PrefixIndex()
    index.apply("pod-a", batch)
    index.apply("pod-b", stored(d2, [3, 4]))
    assert index.lora_digest("pod-a", "x") == d1 and index.lora_digest("pod-b", "x") == d2
    v1, v2 = (request_keys(tokens, 16, "x", None, d) for d in (d1, d2))
    assert index.match(v1, ["pod-a", "pod-b"]) == {"pod-a": 2, "pod-b": 0}
    assert index.match(v2, ["pod-a", "pod-b"]) == {"pod-a": 0, "pod-b": 2}
    assert root_key("x", None, d1) != root_key("x") != root_key("x", None, d2)
    index.apply("pod-a", stored(d2, [5, 6]))  # pod-a reloaded x from the second files
    assert index.lora_digest("pod-a", "x") == d2
    assert index.match(v2, ["pod-a", "pod-b"]) == {"pod-a": 2, "pod-b": 2}


def test_a_digest_without_an_adapter_name_is_refused_on_the_wire():
    from epdserve.connectors.kv_events.schema import EventDecodeError

    event = BlockStored([1], None, list(range(16)), 16, None, "GPU", None, lora_digest="ab")
    with pytest.raises(EventDecodeError, match="lora_digest"):
        EventDecoder().decode(EventEncoder().encode(EventBatch(0.0, [event])))
