"""The corpus against the grammar backend itself, no engine: every spec passes the API's
validation and compiles against the tiny Llama's vocabulary; its checker accepts what the
grammar accepts and refuses what it refuses; and random walks under the token mask (each
step a token drawn uniformly among those the grammar allows, as a random model nearly does)
give outputs that pass the checks."""

from __future__ import annotations

import random

import pytest
import torch
from jsonschema import Draft202012Validator
from so_corpus import CHOICES, REGEXES, Spec, all_specs, check
from so_grammars import GRAMMARS
from so_schemas import SCHEMAS

from epdserve.engine.structured import backend

SPECS = all_specs()
WALKS = 3
MAX_STEPS = 200
EOS = 2  # make-model's eos_token_id


@pytest.fixture(scope="module")
def compiler(models):
    path = models.get("llama")
    return backend.Compiler(backend.tokenizer_info(path, 4096, [EOS]))


def test_the_corpus_has_fifty_schemas_and_every_other_kind():
    kinds = [s.kind for s in SPECS]
    assert len(SCHEMAS) >= 50 and kinds.count("json") >= 50
    assert len(REGEXES) >= 10 and len(CHOICES) >= 5 and len(GRAMMARS) >= 5
    assert "json_object" in kinds
    assert len({s.name for s in SPECS}) == len(SPECS)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_schema_is_a_valid_json_schema(name):
    Draft202012Validator.check_schema(SCHEMAS[name])


def test_every_spec_passes_the_api_validation():
    from epdserve.engine.structured.schema_check import check_schema

    for spec in SPECS:
        backend.validate(spec.params())  # raises ValueError naming the field
        if spec.kind == "json":
            check_schema(spec.value)  # no keyword the backend would ignore


def _matcher(compiler, spec):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiler.compile(spec.params()))


def _accepts(compiler, spec, text: str) -> bool:
    m = _matcher(compiler, spec)
    return m.accept_string(text) and m.is_completed()


EXAMPLES = [("regex:" + k, good, bad) for k, (_, good, bad) in REGEXES.items()]
EXAMPLES += [("grammar:" + k, g.good, g.bad) for k, g in GRAMMARS.items()]
EXAMPLES += [("choice:" + k, v[-1], v[0] + "!") for k, v in CHOICES.items()]


@pytest.mark.parametrize("name, good, bad", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_checker_and_grammar_agree_on_a_good_and_a_bad_example(compiler, name, good, bad):
    spec = next(s for s in SPECS if s.name == name)
    assert check(spec, good) is None
    assert check(spec, bad) is not None
    assert _accepts(compiler, spec, good)
    assert not _accepts(compiler, spec, bad)


def _allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    bits = (bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].nonzero().flatten().tolist()


def walk(compiler, spec, rng: random.Random) -> tuple[str | None, str]:
    """``(text, finish)``: tokens drawn uniformly under the mask until EOS or MAX_STEPS."""
    import xgrammar as xgr

    vocab = compiler.info.decoded_vocab
    m = _matcher(compiler, spec)
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    out = b""
    for _ in range(MAX_STEPS):
        m.fill_next_token_bitmask(mask, 0)
        token = rng.choice(_allowed(mask, len(vocab)))
        assert m.accept_token(token)
        if token == EOS:
            return out.decode(errors="replace"), "stop"  # as the detokenizer
        out += vocab[token]
    return None, "length"


def test_random_walks_under_the_mask_pass_the_checks(compiler):
    rng = random.Random(0)
    failures, unfinished = [], []
    for spec in SPECS:
        finished = 0
        for _ in range(WALKS):
            text, finish = walk(compiler, spec, rng)
            if finish == "stop":
                finished += 1
                if (why := check(spec, text)) is not None:
                    failures.append(f"{spec.name}: {text!r}: {why}")
        if spec.must_finish and not finished:
            unfinished.append(spec.name)
    assert not failures, "\n".join(failures)
    assert not unfinished, f"never finished in {MAX_STEPS} steps: {unfinished}"


# xgrammar 0.2.9 alone lets raw control characters into minLength/maxLength strings
def test_a_length_bounded_string_refuses_raw_control_characters(compiler):
    spec = Spec("json:bounded", "json", {"type": "string", "maxLength": 4})
    assert _accepts(compiler, spec, '"ab"')
    assert not _accepts(compiler, spec, '"a\x01"')
