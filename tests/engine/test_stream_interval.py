"""``--stream-interval``: a stream's reads wait for that many tokens, except its first
token and its end; other output kinds are unchanged."""

from __future__ import annotations

import asyncio

import pytest

from epdserve.engine.config import EngineConfig
from epdserve.engine.core.interfaces import EngineCoreOutput
from epdserve.engine.outputs.output_processor import fan_out
from epdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from epdserve.engine.tokenizer import TokenizerInfo


def stream_state(models, interval: int, n: int = 1, kind=RequestOutputKind.DELTA):
    tok = TokenizerInfo(str(models.get("llama")))
    params = SamplingParams(max_tokens=10, n=n, output_kind=kind, ignore_eos=True)
    return fan_out("r", params, tok, 0.0, interval)


def feed(state, child: str, token: int, finish: str | None = None) -> None:
    state.process(EngineCoreOutput(child, [token], finish_reason=finish))


def test_reads_wait_for_the_interval_after_the_first_token(models):
    state, children = stream_state(models, 3)
    (child, _), = children  # fmt: skip
    ready = []
    for i in range(7):
        feed(state, child, 100 + i)
        ready.append(state.ready())
        if ready[-1]:
            out = asyncio.run(state.get())
            assert out.seqs[0].token_ids  # every read carries what waited
    assert ready == [True, False, False, True, False, False, True]
    feed(state, child, 200, finish="length")  # the end goes out at once
    assert state.ready()
    assert asyncio.run(state.get()).seqs[0].token_ids == [200]


def test_each_of_n_sequences_gets_its_first_token_at_once(models):
    state, children = stream_state(models, 4, n=2)
    feed(state, children[0][0], 5)
    assert state.ready()
    asyncio.run(state.get())
    feed(state, children[0][0], 6)
    assert not state.ready()
    feed(state, children[1][0], 7)  # the second sequence's first token
    assert state.ready()


def test_an_error_is_read_at_once(models):
    state, children = stream_state(models, 8)
    feed(state, children[0][0], 5)
    asyncio.run(state.get())
    feed(state, children[0][0], 6)
    state.fail("boom", 500)
    assert state.ready() and asyncio.run(state.get()).error == "boom"


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_other_output_kinds_ignore_the_interval(models, kind):
    state, children = stream_state(models, 5, kind=kind)
    feed(state, children[0][0], 5)
    feed(state, children[0][0], 6)
    assert state.ready() == (kind == RequestOutputKind.CUMULATIVE)


def test_the_setting_must_be_positive(models):
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(model=str(models.get("llama")), stream_interval=0)
