"""An adapter's blocks as engines really announce them: the adapter's name is the first extra
key of every block (vLLM 0.32: ``extra_keys: [["sql"], ["sql"]]``, with ``lora_name: "sql"``;
our pods do the same), the salt after it on block 0."""

from __future__ import annotations

from epdserve.connectors.kv_events import BlockStored, EventBatch
from epdserve.router.index import PrefixIndex
from epdserve.router.keys import request_keys, without_lora

BS = 4
PROMPT = list(range(200, 216))  # 4 blocks of 4


def adapter_blocks(extra, lora="sql") -> PrefixIndex:
    """Pod "a" holds PROMPT's 4 blocks, stored by a request for adapter ``lora`` in two steps."""
    first = BlockStored([1, 2], None, PROMPT[:8], BS, 1, "GPU", lora, extra[:2], 0)
    rest = BlockStored([3, 4], 2, PROMPT[8:], BS, 1, "GPU", lora, extra[2:], 0)
    index = PrefixIndex()
    index.apply("a", EventBatch(0.0, [first, rest], 0))
    return index


def test_an_adapters_blocks_match_requests_for_that_adapter():
    index = adapter_blocks([["sql"]] * 4)
    assert index.match(request_keys(PROMPT, BS, lora_name="sql"), ["a"]) == {"a": 4}
    index.check_integrity()


def test_an_adapters_blocks_match_neither_the_base_model_nor_another_adapter():
    index = adapter_blocks([["sql"]] * 4)
    assert index.match(request_keys(PROMPT, BS), ["a"]) == {"a": 0}
    assert index.match(request_keys(PROMPT, BS, lora_name="chat"), ["a"]) == {"a": 0}


def test_a_salted_adapter_request_matches_with_its_salt_only():
    index = adapter_blocks([["sql", "t1"], ["sql"], ["sql"], ["sql"]])
    keys = request_keys(PROMPT, BS, lora_name="sql", cache_salt="t1")
    assert index.match(keys, ["a"]) == {"a": 4}
    assert index.match(request_keys(PROMPT, BS, lora_name="sql"), ["a"]) == {"a": 0}


def test_an_adapters_image_block_still_ends_the_indexed_run():
    index = adapter_blocks([["sql"], ["sql", ["img", 0]], ["sql"], ["sql"]])
    assert index.match(request_keys(PROMPT, BS, lora_name="sql"), ["a"]) == {"a": 1}


def test_only_a_leading_adapter_name_is_dropped():
    assert without_lora([["sql"], ["t1"], None], "sql") == [None, ["t1"], None]
    assert without_lora([["sql", "t1"]], "sql") == [["t1"]]
    assert without_lora([["t1"]], None) == [["t1"]]
    assert without_lora(None, "sql") is None
