"""An exception while serving one request fails that request only; the rest stay exact."""

from __future__ import annotations

import pytest
from conftest_helpers import make_prompts

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_core(path, **overrides) -> EngineCore:
    kwargs = dict(model=str(path), dtype="float32", max_model_len=512, **overrides)
    return EngineCore(EngineConfig(**kwargs))


def run(core: EngineCore, prompts: dict[str, list[int]]) -> tuple[dict, dict]:
    """Serve every prompt to the end: (tokens by id, error by id)."""
    for req_id, ids in prompts.items():
        core.add_request(EngineCoreRequest(req_id, ids, GREEDY))
    tokens = {r: [] for r in prompts}
    errors = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = out.error
    assert not core.has_unfinished_requests()
    return tokens, errors


def assert_clean(core: EngineCore) -> None:
    assert core.kv.num_free_blocks() == core.num_blocks - 1, "KV blocks leaked"
    core.kv.pool.check_integrity()


@pytest.fixture(scope="module")
def reference(models):
    path = models.get("llama")
    prompts = {f"req-{i}": p for i, p in enumerate(make_prompts(6, seed=3))}
    tokens, errors = run(make_core(path), prompts)
    assert not errors
    return path, prompts, tokens


@pytest.mark.parametrize("stage", ["execute", "update"])
def test_a_fault_in_one_request_fails_it_alone_and_the_others_stay_exact(
    reference, monkeypatch, stage
):
    path, prompts, expected = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", f"{stage}:req-3")
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-3"] and "injected fault" in errors["req-3"]
    for req_id in prompts:
        if req_id != "req-3":
            assert tokens[req_id] == expected[req_id], req_id
    assert_clean(core)
    if stage == "execute":
        assert core.stats().failed_steps >= 1
        assert not core.guard.suspects and not core.guard.strikes


def test_blocks_named_in_a_failed_step_are_not_served_from_the_prefix_cache(reference, monkeypatch):
    """The failed step named the batch's blocks before their KV was written; later
    requests with the same prompts must recompute them, not read garbage."""
    path, prompts, expected = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:req-3")
    run(core, prompts)
    monkeypatch.delenv("EPDSERVE_INJECT_FAULT")
    again = {f"again-{r}": p for r, p in prompts.items()}
    tokens, errors = run(core, again)
    assert not errors
    assert {r[len("again-") :]: t for r, t in tokens.items()} == expected
    assert_clean(core)


def test_a_fault_with_preemption_and_chunked_prefill_keeps_the_others_exact(reference, monkeypatch):
    path, prompts, expected = reference
    core = make_core(path, max_num_batched_tokens=32, kv_cache_memory=40 * 4 * 2 * 16 * 2 * 32 * 4)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:req-1")
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-1"]
    assert all(tokens[r] == expected[r] for r in prompts if r != "req-1")
    assert_clean(core)


def test_a_lone_request_that_fails_is_failed_at_once(reference, monkeypatch):
    path, prompts, _ = reference
    core = make_core(path)
    monkeypatch.setenv("EPDSERVE_INJECT_FAULT", "execute:req-0")
    tokens, errors = run(core, {"req-0": prompts["req-0"]})
    assert list(errors) == ["req-0"] and tokens["req-0"] == []
    assert core.stats().failed_steps == 1
    assert_clean(core)


def test_an_update_that_fails_after_its_request_finished_still_frees_it(reference, monkeypatch):
    """``make_output`` runs after the stop check: the request is finished, still running and
    holding blocks when it raises; failing it must free them."""
    from epdserve.engine.core import scheduler as scheduler_module

    path, prompts, expected = reference
    real = scheduler_module.make_output

    def flaky(request, *args):
        if request.request_id == "req-2" and request.is_finished:
            raise RuntimeError("output construction failed")
        return real(request, *args)

    monkeypatch.setattr(scheduler_module, "make_output", flaky)
    core = make_core(path)
    tokens, errors = run(core, prompts)
    assert list(errors) == ["req-2"] and "output construction failed" in errors["req-2"]
    assert all(tokens[r] == expected[r] for r in prompts if r != "req-2")
    assert_clean(core)
