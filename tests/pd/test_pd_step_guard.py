"""A failed step on a P/D pod leaves no load unstarted and no save waited for forever:
in-process prefill and decode engine cores over a shared directory, with a fault injected
into a batch that holds loads and saves."""

from __future__ import annotations

import pytest
from pd_support import engine_core, prompts

from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def core(path, role: str | None = None, volume=None) -> EngineCore:
    return engine_core(path, role, volume, hash_seed="7")


def run(engine: EngineCore, requests: list[EngineCoreRequest]) -> dict:
    """Every request to its end: id -> (tokens, error, kv_transfer_params)."""
    for req in requests:
        engine.add_request(req)
    got = {r.request_id: [[], None, None] for r in requests}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            entry = got[out.request_id]
            entry[0] += out.new_token_ids
            entry[1] = out.error or entry[1]
            entry[2] = out.kv_transfer_params or entry[2]
    assert not engine.has_unfinished_requests(), "a request never finished"
    assert engine.kv.num_free_blocks() == engine.num_blocks - 1, "KV blocks leaked"
    return got


@pytest.mark.parametrize("poisoned", ["prefill", "decode"])
def test_a_failed_step_with_loads_and_saves_in_flight_finishes_every_other_request(
    models, tmp_path, monkeypatch, poisoned
):
    path = models.get("llama")
    batch = prompts(seed=51, lengths=(60, 90, 45, 120, 75))
    expected = run(core(path), [EngineCoreRequest(f"r{i}", p, GREEDY) for i, p in enumerate(batch)])
    prefill, decode = core(path, "prefill", tmp_path), core(path, "decode", tmp_path)
    ids = [f"poison-{i}" if i == 2 else f"r{i}" for i in range(len(batch))]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if poisoned == "prefill":
        monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:poison")
    handed = run(prefill, [EngineCoreRequest(i, p, one) for i, p in zip(ids, batch, strict=True)])
    if poisoned == "decode":
        monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:poison")
    decoded = run(
        decode,
        [
            EngineCoreRequest(i, p, GREEDY, kv_transfer_params=handed[i][2])
            for i, p in zip(ids, batch, strict=True)
        ],
    )
    assert "injected fault" in (handed if poisoned == "prefill" else decoded)["poison-2"][1]
    for i in (0, 1, 3, 4):
        assert decoded[f"r{i}"][0] == expected[f"r{i}"][0], i
    assert decode.stats().external_hits > 0  # the other prompts' blocks were stored and loaded


class _PlannedConnector:
    """A scheduler-side connector stand-in that plans one load and one save per step."""

    def __init__(self):
        self.step = 0
        self.failed = []

    def build_connector_meta(self, scheduled):
        from epdserve.connectors.kv_connector import BlockTransfer, KVConnectorMetadata

        self.step += 1
        load = BlockTransfer(f"load-{self.step}", [self.step], [b"h"])
        save = BlockTransfer(f"save-{self.step}", [self.step], [b"h"])
        return KVConnectorMetadata([load], [save])

    def step_failed(self, meta):
        self.failed.append(meta)


def test_a_failed_steps_loads_go_out_with_the_next_step_and_its_saves_are_not_awaited():
    from epdserve.engine.core.kv_cache_manager import KVCacheManager
    from epdserve.engine.kv_transfer.coordinator import KVTransferCoordinator

    connector = _PlannedConnector()
    transfer = KVTransferCoordinator(connector, KVCacheManager(8, 16), can_load=True)
    failed = transfer.build_meta([])
    assert transfer.saving == {"save-1"}
    transfer.step_failed(failed)
    assert transfer.saving == set() and connector.failed == [failed]
    after = transfer.build_meta([])
    assert [t.req_id for t in after.loads] == ["load-1", "load-2"]
    assert transfer.saving == {"save-2"}
