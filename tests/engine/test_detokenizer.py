"""Incremental detokenization survives a stream the tokenizer refuses to continue."""

from __future__ import annotations

from epdserve.engine.outputs.detokenizer import IncrementalDetokenizer
from epdserve.engine.tokenizer import TokenizerInfo


class RefusingOnce:
    """A decode stream that rejects its prefix at one token, as the tokenizers binding
    does for byte sequences it cannot continue."""

    def __init__(self, real, bad_token: int):
        self.real, self.bad_token = real, bad_token

    def step(self, tokenizer, token_id):
        if token_id == self.bad_token:
            raise Exception("Invalid prefix encountered")
        return self.real.step(tokenizer, token_id)


def test_a_rejected_prefix_restarts_the_stream_and_keeps_the_text(models):
    tok = TokenizerInfo(str(models.get("llama")))
    ids = tok.encode("def main():\n    return 42\n")
    detok = IncrementalDetokenizer(tok, [])
    detok.stream = RefusingOnce(detok.stream, ids[3])
    assert detok.update(ids) is None
    assert detok.num_resets == 1
    assert detok.text == tok.decode(ids, False)


def test_after_a_rejection_the_token_is_decoded_on_a_fresh_stream(models):
    tok = TokenizerInfo(str(models.get("llama")))
    ids = tok.encode("x = 1")

    class Refusing:
        def step(self, tokenizer, token_id):
            raise Exception("Invalid prefix encountered")

    detok = IncrementalDetokenizer(tok, [])
    detok.stream = Refusing()
    detok.update(ids)
    assert detok.num_resets == 1
    assert detok.text == tok.decode(ids, False)
