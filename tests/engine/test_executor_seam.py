"""The executor seam (DESIGN.md §10): everything that crosses it survives msgpack as it is (a
worker in another process gets bytes, never a pickle), and the core reaches the model only
through the executor's methods."""

from __future__ import annotations

import msgspec
import pytest

from epdserve.connectors.kv_connector import (
    BlockTransfer,
    KVConnectorMetadata,
    KVConnectorOutput,
)
from epdserve.engine.core.interfaces import (
    CachedRequestData,
    KVCacheConfig,
    Logprobs,
    MMFeature,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    WorkerStats,
)
from epdserve.engine.core.kv_cache_groups import make_kv_cache_spec
from epdserve.engine.executor.base import RANK_METHODS, check_rank_method, create_executor
from epdserve.engine.lora.slots import LoRAModuleWeights, LoRASlotLoad
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured.params import StructuredOutputsParams
from epdserve.engine.worker.worker import Worker


def round_trip(obj):
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=type(obj))


def scheduler_output() -> SchedulerOutput:
    params = SamplingParams(
        temperature=0.7,
        seed=3,
        max_tokens=9,
        logprobs=2,
        logit_bias={5: -1.5},
        structured_outputs=StructuredOutputsParams(regex="[ab]+"),
    )
    image = MMFeature("f" * 64, 2, 4, b"\x00\x00\x80\x3f" * 12, [3, 2, 2])
    new = NewRequestData("r0", [1, 9, 9, 9, 9, 7], params, [[1, 2], [3]], 0, 6, [image], 1)
    cached = CachedRequestData(["r1"], [[[4], []]], [33])
    transfer = BlockTransfer("r1", [4], [b"\x01" * 32])
    return SchedulerOutput(
        [new],
        cached,
        {"r0": 6, "r1": 1},
        7,
        ["gone"],
        KVConnectorMetadata(loads=[transfer], saves=[transfer]),
        {"r0": [0]},
        ["old"],
        ["f" * 64],
        ["r0"],
        b"\xff\x00\x00\x00",
    )


def test_a_scheduler_output_crosses_msgpack_unchanged():
    sched = scheduler_output()
    assert round_trip(sched) == sched


def test_a_model_runner_output_with_every_field_crosses_msgpack_unchanged():
    lp = Logprobs([[5, 1]], [[-0.1, -2.5]], [1])
    out = ModelRunnerOutput(
        ["r0", "r1"],
        [[], [5]],
        {"r1": lp},
        {"r0": lp},
        KVConnectorOutput(["r1"], ["r0"], [4], [(b"\x02" * 32, True)], [b"\x03" * 32]),
        WorkerStats(2, 1, 3, {"kv_block": {"bad_header": 1}}),
    )
    assert round_trip(out) == out


def test_the_kv_cache_config_and_a_lora_placement_cross_msgpack_unchanged():
    kv = KVCacheConfig(17, make_kv_cache_spec([32, None, 32, 32]))
    load = LoRASlotLoad(1, 7, 2.0, [LoRAModuleWeights(0, "q_proj", 2, b"\0" * 16, b"\0" * 24)])
    assert round_trip(kv) == kv and round_trip(load) == load


def test_every_rank_method_is_a_worker_method():
    assert all(callable(getattr(Worker, m, None)) for m in RANK_METHODS)


def test_a_method_no_rank_runs_is_refused_by_name():
    with pytest.raises(ValueError, match="method: 'kv_cache' is not one of"):
        check_rank_method("kv_cache")


def test_an_unknown_executor_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="backend: 'ray' is not one of"):
        create_executor(None, "ray")


def test_the_core_steps_the_model_only_through_its_executor(models):
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest

    config = EngineConfig(model=str(models.get("llama")), dtype="float32", max_model_len=64)
    core = EngineCore(config)
    seen = []
    execute = core.executor.execute_model

    def spy(sched):
        seen.append(round_trip(sched))  # what a worker process would be sent
        return round_trip(execute(sched))  # and what it would send back

    core.executor.execute_model = spy
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    core.add_request(EngineCoreRequest("r", [5, 6, 7, 8], params))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert len(tokens) == 3 and len(seen) == 3
    assert not hasattr(core, "runner")
    core.close()
