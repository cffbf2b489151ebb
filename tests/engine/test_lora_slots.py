"""Device slots of LoRA: the scheduler half (``LoRAManager``) places adapters least recently
used first, never on a slot a running request uses, reads them off the step loop and fails an
unreadable one with its reason; the worker half (``LoRASlots``) writes what it is sent."""

from __future__ import annotations

import time

import pytest
import torch

from epdserve.engine.lora.manager import LoRALoadError, LoRAManager
from epdserve.engine.lora.random_adapters import write_random_adapters
from epdserve.engine.lora.request import LoRARequest
from epdserve.engine.lora.slots import LoRASlotLoad, LoRASlots
from epdserve.engine.models.config import load_model_config


@pytest.fixture(scope="module")
def setup(models, tmp_path_factory):
    path = models.get("llama")
    paths = write_random_adapters(path, 3, out=tmp_path_factory.mktemp("loras"))
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    return load_model_config(path), loras


def placed(manager: LoRAManager, lora: LoRARequest, busy=frozenset()) -> bool:
    """``acquire`` until the adapter is read (it loads in the background)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if manager.acquire(lora, set(busy)):
            return True
        if manager.content_key(lora) not in manager.loading:
            return False  # read, but no slot
        time.sleep(0.01)
    raise AssertionError("adapter never loaded")


def test_slots_are_reused_least_recently_used_first_but_never_when_busy(setup):
    cfg, (a, b, c) = setup
    manager = LoRAManager(cfg, 2, 16, 3)
    assert placed(manager, a) and placed(manager, b)
    assert manager.slot_of(a) == 0 and manager.slot_of(b) == 1
    assert placed(manager, a)  # a is now the most recently used
    assert placed(manager, c)
    assert manager.slot_of(b) == -1 and manager.slot_of(c) == 1  # b was evicted
    assert not placed(manager, b, busy={a.lora_int_id, c.lora_int_id})  # waits
    assert manager.slot_of(b) == -1 and manager.num_loads == 3
    assert placed(manager, b, busy={c.lora_int_id})
    assert manager.slot_of(b) == 0 and manager.slot_of(a) == -1
    assert manager.num_loads == 3  # b came back from the host LRU, not from disk
    manager.close()


def test_slot_holds_the_weights_padded_to_the_maximum_rank(setup):
    cfg, (a, b, _) = setup
    manager = LoRAManager(cfg, 1, 16, 1)
    worker = LoRASlots(cfg, 1, 16, torch.float32, torch.device("cpu"))
    assert placed(manager, b)
    assert placed(manager, a)  # rank 8 over b's rank 16: the rest must be zeros again
    assert [(op.slot, op.lora_int_id) for op in manager.slot_ops] == [(0, 2), (0, 1)]
    for op in manager.slot_ops:
        worker.load(op)
    a_stack, b_stack = worker.stacks[1]["k_proj"]
    assert a_stack.shape == (1, 16, 128) and b_stack.shape == (1, 64, 16)
    assert a_stack[0, :8].abs().sum() > 0 and a_stack[0, 8:].abs().sum() == 0
    assert b_stack[0, :, 8:].abs().sum() == 0 and worker.scaling[0] == 2.0
    manager.close()


def test_an_unloaded_adapter_on_a_slot_has_that_slot_cleared_on_the_workers(setup):
    from types import SimpleNamespace

    from epdserve.engine.lora.core_side import LoRAMessage, apply_message

    cfg, (a, _, _) = setup
    manager = LoRAManager(cfg, 1, 16, 1)
    assert placed(manager, a)
    apply_message(manager, SimpleNamespace(requests={}), LoRAMessage("remove", a))
    load, clear = manager.slot_ops
    assert isinstance(load, LoRASlotLoad) and clear == 0
    manager.close()


def test_an_unreadable_adapter_fails_with_its_reason(setup, tmp_path):
    cfg, _ = setup
    manager = LoRAManager(cfg, 1, 16, 1)
    missing = LoRARequest("gone", 7, str(tmp_path / "gone"))
    with pytest.raises(LoRALoadError, match="'gone': lora_path: .* is not a directory"):
        placed(manager, missing)
    with pytest.raises(LoRALoadError):  # remembered: not read again
        manager.acquire(missing, set())
    manager.close()


def test_an_unloaded_adapter_leaves_its_slot_and_host_memory(setup):
    from types import SimpleNamespace

    from epdserve.engine.lora.core_side import LoRAMessage, apply_message

    cfg, (a, b, _) = setup
    manager = LoRAManager(cfg, 2, 16, 2)
    assert placed(manager, a) and placed(manager, b)
    user = SimpleNamespace(lora=b)  # a live request of b keeps it
    queues = SimpleNamespace(requests={"r": user})
    for lora in (a, b):
        apply_message(manager, queues, LoRAMessage("remove", lora))
    key_a, key_b = manager.content_key(a), manager.content_key(b)
    assert manager.slot_of(a) == -1 and key_a not in manager.host
    assert manager.slot_of(b) == 1 and key_b in manager.host
    apply_message(manager, queues, LoRAMessage("add", a))  # read again, ahead of requests
    assert key_a in manager.loading or key_a in manager.host
    manager.close()


def test_the_core_fails_a_request_whose_adapter_cannot_be_read_and_serves_the_rest(
    models, tmp_path
):
    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
    from epdserve.engine.sampling_params import SamplingParams

    config = EngineConfig(model=str(models.get("llama")), dtype="float32", enable_lora=True)
    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    gone = LoRARequest("gone", 5, str(tmp_path / "gone"))  # deleted after the API's check
    core.add_request(EngineCoreRequest("bad", [5, 6, 7], params, lora_request=gone))
    core.add_request(EngineCoreRequest("base", [5, 6, 7], params))
    outputs = []
    while core.has_unfinished_requests():
        outputs += core.step()
    failed = [o for o in outputs if o.request_id == "bad"]
    assert len(failed) == 1 and failed[0].error_status == 400
    assert "'gone': lora_path: " in failed[0].error and "is not a directory" in failed[0].error
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "base") == 2
    assert core.kv.num_free_blocks() == core.num_blocks - 1
    core.close()
