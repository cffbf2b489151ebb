"""Store-tier KV events: a prefill pod's saves to the shared store are announced with
``medium="STORE"``, so the router indexes the prompt in both tiers for that pod."""

from __future__ import annotations

from pd_support import engine_core, prompts

from epdserve.connectors.kv_connector.storage_connector import take_store_events
from epdserve.connectors.kv_events import EventBatch, to_wire_event
from epdserve.engine.core.engine_core import EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams
from epdserve.router.index import LOCAL, STORE, PrefixIndex
from epdserve.router.keys import request_keys


def test_saved_blocks_are_indexed_in_the_store_tier(models, tmp_path):
    engine = engine_core(models.get("llama"), "prefill", tmp_path, enable_kv_events=True)
    prompt = prompts(3, lengths=(100,))[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request(EngineCoreRequest("r", prompt, params))
    index, events = PrefixIndex(), []
    for _ in range(3000):  # until the request ends and its saves have landed
        engine.step()
        events += engine.take_events() + take_store_events(engine.kv_connectors)
        if not engine.has_unfinished_requests() and any(
            getattr(e, "medium", None) == "STORE" for e in events
        ):
            break
    index.apply("prefill-0", EventBatch(0.0, [to_wire_event(e) for e in events], 0))
    keys = request_keys(prompt, engine.kv.block_size)
    local, loadable = index.match_tiers(keys, ["prefill-0"])["prefill-0"]
    assert local == len(keys) and loadable == len(keys)
    assert index.pod_block_count("prefill-0", STORE) == len(keys)
    assert index.pod_block_count("prefill-0", LOCAL) == len(keys)
    assert index.match_tiers(keys, ["decode-0"])["decode-0"] == (0, len(keys))
    engine.close()
