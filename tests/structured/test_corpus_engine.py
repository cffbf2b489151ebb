"""The whole corpus through the offline engine (tiny random Llama, temperature 1): every output
that finished is in its spec's language, every other one was cut at ``max_tokens``."""

from __future__ import annotations

import json

import pytest
from so_corpus import all_specs, check

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.structured import StructuredOutputsParams

SPECS = all_specs()
PROMPTS = ["Answer:", "Here is the result of the tool call:", "def main():\n    return", "{"]
MAX_TOKENS = 256  # bounded specs finish well within it (random walks: < 160 tokens)
UNBOUNDED_MAX_TOKENS = 64  # free whitespace or free strings: most run on
SAMPLES = 2  # one request with n=2 per spec


@pytest.fixture(scope="module")
def llm(models):
    return LLM(model=str(models.get("llama")), max_model_len=512)


def params(spec, **kw) -> SamplingParams:
    max_tokens = MAX_TOKENS if spec.must_finish else UNBOUNDED_MAX_TOKENS
    kw = {"max_tokens": max_tokens, "temperature": 1.0, "n": SAMPLES} | kw
    return SamplingParams(structured_outputs=spec.params(), **kw)


@pytest.fixture(scope="module")
def corpus(llm):
    """``[(spec, max_tokens, completion)]`` for every sample of every spec: one generate call."""
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(len(SPECS))]
    plist = [params(spec, seed=k) for k, spec in enumerate(SPECS)]
    outs = llm.generate(prompts, plist)
    return [(s, p.max_tokens, c) for s, p, o in zip(SPECS, plist, outs, strict=True)
            for c in o.outputs]  # fmt: skip


def test_every_finished_output_is_in_its_spec_language(corpus):
    failures = [
        f"{spec.name}: {c.text!r}: {why}"
        for spec, _, c in corpus
        if c.finish_reason == "stop" and (why := check(spec, c.text)) is not None
    ]
    assert not failures, "\n".join(failures)


def test_every_other_output_was_cut_at_max_tokens(corpus):
    assert len(corpus) == SAMPLES * len(SPECS)
    cut = [(spec, n, c) for spec, n, c in corpus if c.finish_reason != "stop"]
    assert all(c.finish_reason == "length" for _, _, c in cut), {c.finish_reason for *_, c in cut}
    assert all(len(c.token_ids) == n for _, n, c in cut)


def test_bounded_specs_finish(corpus):
    bounded = [(spec.name, c.finish_reason) for spec, _, c in corpus if spec.must_finish]
    finished = {name for name, reason in bounded if reason == "stop"}
    assert sum(reason == "stop" for _, reason in bounded) >= 0.9 * len(bounded)
    assert finished == {name for name, _ in bounded}, "never finished: " + ", ".join(
        sorted({name for name, _ in bounded} - finished)
    )


def test_a_cut_off_output_is_a_prefix_of_the_language_and_says_length(llm):
    const = next(s for s in SPECS if s.name == "json:const_object")
    choice = next(s for s in SPECS if s.name == "choice:many")
    outs = llm.generate(
        ["Answer:", "Answer:"],
        [params(const, max_tokens=3, seed=1, n=3), params(choice, max_tokens=1, seed=2, n=3)],
    )
    for c in outs[0].outputs + outs[1].outputs:
        assert c.finish_reason == "length"
    for c in outs[0].outputs:
        assert len(c.token_ids) == 3 and '{"k": [1, "two", null]}'.startswith(c.text)
    for c in outs[1].outputs:
        assert len(c.token_ids) == 1 and any(x.startswith(c.text) for x in choice.value)


def test_logprobs_of_a_constrained_output_cover_each_sampled_token(llm):
    spec = StructuredOutputsParams(choice=["alpha beta gamma", "delta"])
    out = llm.generate(
        ["Answer:"],
        SamplingParams(structured_outputs=spec, logprobs=2, temperature=1.0, seed=3, n=2),
    )[0]
    for c in out.outputs:
        assert c.finish_reason == "stop" and c.text in spec.choice
        assert len(c.logprobs) == len(c.token_ids)
        assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))


def test_properties_come_in_the_schema_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"},
              "alpha": {"type": "boolean"}}, "required": ["zeta", "alpha"],
              "additionalProperties": False}  # fmt: skip
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    out = llm.generate(["Answer:"], SamplingParams(structured_outputs=spec, max_tokens=32))[0]
    assert out.outputs[0].finish_reason == "stop"
    assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha"]  # as OpenAI and vLLM
