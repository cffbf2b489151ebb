"""The engine core under structured outputs: grammars compiled off the step loop, each
sampled token masked by its request's grammar, failures answered per request."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from epdserve.engine.core.engine_core import EngineCore, EngineCoreRequest
from epdserve.engine.sampling_params import SamplingParams
from epdserve.engine.structured import StructuredOutputsParams as SO
from epdserve.engine.structured import manager as manager_mod
from epdserve.engine.structured import mask as mask_mod
from epdserve.engine.structured.mask import apply_bitmask

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-\d{2}"


@pytest.fixture(scope="module")
def llm(models):
    from epdserve.engine.llm import LLM

    return LLM(models.get("llama"), max_num_seqs=8)


def texts(outs):
    return [(c.text, c.finish_reason) for o in outs for c in o.outputs]


def test_outputs_match_their_grammar_greedy_and_sampled(llm):
    specs = [
        SO(json=SCHEMA, disable_any_whitespace=True),
        SO(regex=REGEX),
        SO(choice=["red", "green", "blue"]),
        SO(grammar='root ::= "(" [0-9] [0-9]? ")"'),
    ]
    params = [
        SamplingParams(max_tokens=64, temperature=t, seed=7, structured_outputs=s)
        for t in (0.0, 1.0)
        for s in specs
    ]
    got = texts(llm.generate(["The answer is"] * len(params), params))
    assert all(reason == "stop" for _, reason in got), got
    for (text, _), p in zip(got, params, strict=True):
        kind = p.structured_outputs.kind
        if kind == "json":
            value = json.loads(text)
            assert set(value) == {"id", "tags"} and 0 <= value["id"] <= 999
            assert set(value["tags"]) <= {"a", "b", "c"} and len(value["tags"]) <= 3
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in ("red", "green", "blue")
        else:
            assert re.fullmatch(r"\(\d\d?\)", text), text


def test_an_unconstrained_neighbour_is_unchanged(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = texts(llm.generate(["Once upon"], plain))
    mixed = llm.generate(
        ["Once upon", "x"], [plain, SamplingParams(max_tokens=8, structured_outputs=SO(regex="z+"))]
    )
    assert texts(mixed[:1]) == alone


def test_json_object_is_an_object_and_n_samples_logprobs_each_conform(llm):
    p = SamplingParams(
        n=3, max_tokens=48, temperature=1.0, seed=3, logprobs=2,
        structured_outputs=SO(json_object=True, disable_any_whitespace=True),
    )  # fmt: skip
    [out] = llm.generate(["{"], p)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.finish_reason == "length"


def test_a_finished_grammar_ends_the_request_even_with_ignore_eos(llm):
    p = SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=SO(choice=["done"]))
    [(text, reason)] = texts(llm.generate(["go"], p))
    assert (text, reason) == ("done", "stop")


def test_a_bad_spec_offline_is_a_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex: .*parenthesis"):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(regex="a(b")))
    assert not llm.engine.has_unfinished_requests()


def test_preempted_requests_resume_their_grammar(models):
    from epdserve.engine.llm import LLM

    # 40 blocks for eight ~9-block sequences: they preempt each other and recompute
    llm = LLM(models.get("llama"), max_num_seqs=8, kv_cache_memory=40 << 15, max_model_len=512)
    spec = SO(regex="[a-z]{100}")  # at most 100 tokens and the stop token
    p = SamplingParams(max_tokens=120, temperature=1.0, seed=11, structured_outputs=spec)
    got = texts(llm.generate([f"prompt {i} " * 20 for i in range(8)], p))
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(re.fullmatch("[a-z]{100}", t) and r == "stop" for t, r in got), got


def core_with_blocked_compile(models, monkeypatch, timeout_s=30.0):
    """An engine core whose compiles wait for ``release`` (a hook into our own manager)."""
    release = threading.Event()
    real = manager_mod.StructuredOutputManager._compile

    def slow(self, params):
        release.wait(10)
        return real(self, params)

    monkeypatch.setattr(manager_mod.StructuredOutputManager, "_compile", slow)
    from epdserve.engine.config import EngineConfig

    core = EngineCore(EngineConfig(model=str(models.get("llama")), max_num_seqs=4))
    core.structured.compile_timeout_s = timeout_s
    return core, release


def request(req_id, params):
    return EngineCoreRequest(req_id, [5, 6, 7, 8], params)


def run(core, outs, steps=200):
    for _ in range(steps):
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
        if not core.has_unfinished_requests():
            return


def test_others_keep_stepping_while_a_grammar_compiles(models, monkeypatch):
    core, release = core_with_blocked_compile(models, monkeypatch)
    core.add_request(request("so", SamplingParams(max_tokens=8, structured_outputs=SO(regex="q+"))))
    core.add_request(request("plain", SamplingParams(max_tokens=6, ignore_eos=True)))
    outs: dict = {}
    run(core, outs, steps=40)
    assert outs["plain"][-1].finish_reason == "length"
    assert "so" not in outs and core.has_unfinished_requests()  # still waiting, nothing computed
    release.set()
    run(core, outs)
    assert outs["so"][-1].finish_reason in ("stop", "length")
    core.close()


def test_a_compile_past_its_deadline_fails_only_that_request_with_a_400(models, monkeypatch):
    core, release = core_with_blocked_compile(models, monkeypatch, timeout_s=0.0)
    core.add_request(request("so", SamplingParams(max_tokens=8, structured_outputs=SO(regex="q+"))))
    core.add_request(request("plain", SamplingParams(max_tokens=4, ignore_eos=True)))
    outs: dict = {}
    run(core, outs)
    release.set()
    [fail] = outs["so"]
    assert fail.finish_reason == "abort" and fail.error_status == 400
    assert fail.error.startswith("structured_outputs.regex: ")
    assert outs["plain"][-1].finish_reason == "length"
    assert core.kv.usage == 0.0  # nothing leaked
    core.close()


def test_equal_specs_share_one_compile(models):
    from epdserve.engine.config import EngineConfig

    core = EngineCore(EngineConfig(model=str(models.get("llama")), max_num_seqs=4))
    for i in range(3):
        spec = SO(json={"type": "object", "required": ["a"], "properties": {"a": {"const": i % 2}}})
        core.add_request(request(f"r{i}", SamplingParams(max_tokens=20, structured_outputs=spec)))
    run(core, {})
    assert (core.structured.compiles, core.structured.cache_hits) == (2, 1)
    core.close()


@pytest.mark.parametrize("kernel", ["cpu", "torch"])
@pytest.mark.parametrize("rows", [[4, 0, 2], [0, 1, 2, 3, 4]], ids=["some-rows", "every-row"])
@pytest.mark.parametrize("vocab", [64, 100])
def test_bitmask_rows_mask_exactly_the_disallowed_tokens(vocab, rows, kernel, monkeypatch):
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    words, n = (vocab + 31) // 32, len(rows)
    bits = torch.randint(0, 2, (n, words * 32), generator=gen, dtype=torch.int64)
    packed = (bits.view(n, words, 32) << torch.arange(32)).sum(-1)
    packed = packed.to(torch.int64).where(packed < 2**31, packed - 2**32).to(torch.int32)
    logits = torch.randn(5, vocab + 3, generator=gen)  # wider than the grammar's vocabulary
    ours, ref = logits.clone(), logits.clone()
    if kernel == "torch":  # the path for devices without xgrammar's kernel
        monkeypatch.setattr(mask_mod, "_apply_cpu", mask_mod._apply_torch)
    apply_bitmask(ours, rows, packed.numpy().tobytes(), n)
    full = torch.full((5, words), -1, dtype=torch.int32)
    full[rows] = packed
    xgr.apply_token_bitmask_inplace(ref, full, vocab_size=vocab)  # the reference
    assert torch.equal(ours[:, :vocab], ref[:, :vocab])
    others = [r for r in range(5) if r not in rows]
    assert torch.equal(ours[others], logits[others])
    covered = words * 32  # columns past the grammar's vocabulary are never allowed
    assert bool((ours[rows, covered:] == float("-inf")).all())


def test_a_prefill_for_a_decode_pod_compiles_no_grammar(models):
    # the decode pod samples the first token itself: the prefill pod's one token is dropped
    from epdserve.engine.config import EngineConfig

    core = EngineCore(EngineConfig(model=str(models.get("llama")), max_num_seqs=4))
    params = SamplingParams(max_tokens=1, ignore_eos=True, structured_outputs=SO(regex="q+"))
    req = EngineCoreRequest("p", [5, 6, 7], params, kv_transfer_params={"do_remote_decode": True})
    core.add_request(req)
    outs: dict = {}
    run(core, outs)
    assert outs["p"][-1].finish_reason == "length" and core.structured.compiles == 0
    core.close()
