"""cache_salt in the router: salted blocks are indexed under salted keys and match only
requests carrying the same salt."""

from __future__ import annotations

import pytest

from epdserve.connectors.kv_events import BlockStored, EventBatch
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import first_block_salt, request_keys, root_key
from epdserve.router.pods import PodEndpoint
from epdserve.router.service import Router
from epdserve.router.strategy import make_strategy

BS = 4
PROMPT = list(range(100, 116))  # 4 blocks of 4


def stored(hashes, parent, tokens, extra=None):
    return BlockStored(list(hashes), parent, list(tokens), BS, None, "GPU", None, extra, 0)


def batch(*events):
    return EventBatch(0.0, list(events), 0)


def salted_index(salt="t1") -> PrefixIndex:
    """Pod "a" holds PROMPT's 4 blocks stored by a request salted with ``salt``, in two
    events as an engine sends them over two steps."""
    index = PrefixIndex()
    first = stored([1, 2], None, PROMPT[:8], extra=[[salt], None])
    index.apply("a", batch(first, stored([3, 4], 2, PROMPT[8:], extra=[None, None])))
    return index


def test_salted_keys_differ_from_unsalted_and_other_salts_from_the_first_block():
    plain, a, b = (request_keys(PROMPT, BS, cache_salt=s) for s in (None, "a", "b"))
    for i in range(4):
        assert len({plain[i], a[i], b[i]}) == 3, f"block {i}"


def test_no_or_empty_salt_keeps_the_unsalted_root():
    assert root_key(None, None) == root_key() == root_key(None, "")
    assert request_keys(PROMPT, BS, cache_salt="") == request_keys(PROMPT, BS)


def test_the_salt_and_the_lora_name_cannot_stand_in_for_each_other():
    assert root_key("ab", "c") != root_key("a", "bc")
    assert root_key("t1", None) != root_key(None, "t1")


def test_salted_blocks_match_a_request_with_the_same_salt():
    index = salted_index()
    assert index.match(request_keys(PROMPT, BS, cache_salt="t1"), ["a"]) == {"a": 4}
    index.check_integrity()


def test_salted_blocks_match_no_request_with_another_salt_or_none():
    index = salted_index()
    assert index.match(request_keys(PROMPT, BS, cache_salt="t2"), ["a"]) == {"a": 0}
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 0}


def test_unsalted_blocks_match_no_salted_request():
    index = PrefixIndex()
    index.apply("a", batch(stored([1, 2], None, PROMPT[:8], extra=[None, None])))
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 2}
    assert index.match(request_keys(PROMPT, BS, cache_salt="t1"), ["a"]) == {"a": 0}


def test_a_first_block_with_an_image_and_a_salt_is_not_indexed():
    index = PrefixIndex()
    result = index.apply("a", batch(stored([1, 2], None, PROMPT[:8], extra=[["img", "t1"], None])))
    assert result.stored == 0 and result.skipped == 2 and len(index) == 0


@pytest.mark.parametrize(
    ("extra", "salt"),
    [(None, None), (["t1"], "t1"), ([""], None), (["img", "t1"], None), ([7], None)],
)
def test_first_block_salt_reads_only_a_lone_string(extra, salt):
    assert first_block_salt(extra) == salt


@pytest.fixture
def router(models):
    from epdserve.router.tokenize import PromptTokenizer

    r = Router(
        make_strategy("prefix"),
        PromptTokenizer(models.get("llama")),
        subscribe=False,
        index=salted_index("t1"),
        default_block_size=BS,
    )
    r.add_pod(PodEndpoint("a", "http://127.0.0.1:1", "tcp://127.0.0.1:2", None))
    yield r
    r.close()


@pytest.mark.parametrize(("salt", "matched"), [("t1", 4), ("t2", 0), (None, 0), (7, 0)])
def test_route_reads_the_salt_from_the_request_body(router, salt, matched):
    body = {"model": "tiny", "prompt": PROMPT}
    if salt is not None:
        body["cache_salt"] = salt
    assert router.route("/v1/completions", body).matched == {"a": matched}


def test_a_prefill_body_keeps_the_salt():
    from epdserve.router.disagg import prefill_body

    assert (
        prefill_body({"model": "tiny", "prompt": PROMPT, "cache_salt": "t1"})["cache_salt"] == "t1"
    )
