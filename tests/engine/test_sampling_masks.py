"""bad_words and min_tokens (vLLM's semantics): the batched masks against a per-row
reference, the frontend's tokenization of words, and both through the offline ``LLM``."""

from __future__ import annotations

import numpy as np
import pytest
from conftest_helpers import make_prompts

from epdserve.engine import LLM, SamplingParams
from epdserve.engine.sample.bad_words import BadWords, bad_words_token_ids


def reference(output: list[int], words: list[list[int]]) -> set[int]:
    """vLLM's per-request rule: a word's last token is masked when the output ends with the
    rest of the word."""
    masked = set()
    for w in words:
        if len(w) > len(output) + 1:
            continue
        prefix = w[:-1]
        if not prefix or output[-len(prefix) :] == prefix:
            masked.add(w[-1])
    return masked


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_mask_what_the_per_request_rule_masks(seed):
    rng = np.random.default_rng(seed)
    n, vocab, width = 10, 20, 40
    token_ids = rng.integers(0, vocab, (n, width))
    num_tokens = rng.integers(1, width, n)
    num_prompt = np.minimum(rng.integers(0, 12, n), num_tokens)
    state, words = BadWords(n), {}
    for row in rng.permutation(n)[: n - 2]:  # two rows without words
        hist = token_ids[row, : num_tokens[row]].tolist()
        ws = []
        for _ in range(rng.integers(1, 5)):
            k = int(rng.integers(1, 5))
            if rng.random() < 0.6:  # the history's end, then a last token: often a match
                ws.append(hist[len(hist) - k + 1 :] + [int(rng.integers(0, vocab + 2))])
            else:
                ws.append(rng.integers(0, vocab, k).tolist())
        words[int(row)] = ws
        state.set(int(row), ws)
    rows = rng.permutation(n)
    found = state.entries(rows, token_ids, num_tokens, num_prompt, vocab)
    got = {int(r): set() for r in rows}
    for i, t in zip(*found, strict=True):
        got[int(rows[i])].add(int(t))
    for r in rows:
        out = token_ids[r, num_prompt[r] : num_tokens[r]].tolist()
        want = {t for t in reference(out, words.get(int(r), [])) if t < vocab}
        assert got[int(r)] == want, (r, out, words.get(int(r)))


def test_a_row_set_again_forgets_its_old_words():
    state = BadWords(2)
    state.set(0, [[1, 2, 3], [4]])
    state.set(0, [[5]])
    found = state.entries(np.array([0]), np.array([[1, 2]]), np.array([2]), np.array([0]), 9)
    assert [int(t) for t in found[1]] == [5]


class FakeTokenizer:
    vocab_size = 50
    table = {"hello": [5, 6], " hello": [7, 6], "x": [8], " x": [9, 10], "y": [11], " y": [11]}

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return self.table[text]


def test_words_tokenize_as_vllm_does():
    # " hello" differs in its first token and not in length: both forms count; " x" is
    # longer, " y" the same as "y": only the plain forms
    got = bad_words_token_ids(["hello", " x", "y"], FakeTokenizer())
    assert got == [[5, 6], [7, 6], [8], [11]]


def test_words_outside_the_vocabulary_and_empty_words_are_refused():
    tok = FakeTokenizer()
    tok.table = {"z": [99], " z": [98]}
    with pytest.raises(ValueError, match="^bad_words:"):
        bad_words_token_ids(["z"], tok)
    with pytest.raises(ValueError, match="^bad_words:"):
        SamplingParams(bad_words=[" "])


def test_too_many_or_too_long_words_are_refused_naming_the_field():
    from epdserve.engine.sample.bad_words import MAX_WORD_TOKENS
    from epdserve.engine.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS

    for words in (["w"] * (MAX_BAD_WORDS + 1), ["w" * (MAX_BAD_WORD_CHARS + 1)]):
        with pytest.raises(ValueError, match="^bad_words: at most"):
            SamplingParams(bad_words=words)
    tok = FakeTokenizer()
    tok.table = {"long": [1] * (MAX_WORD_TOKENS + 1), " long": [1]}
    with pytest.raises(ValueError, match="^bad_words: a word may be at most"):
        bad_words_token_ids(["long"], tok)


def test_the_arrays_shrink_once_no_row_holds_words():
    state = BadWords(3)
    state.set(0, [[1] * 40, [2]])
    state.set(1, [[3, 4]])
    state.set(0, [])
    assert state.prefix.shape[2] == 39  # row 1 still holds words
    state.set(1, [])
    assert state.prefix.shape == (3, 1, 0) and state.last.shape == (3, 1)
    assert not state.count.any()


@pytest.fixture(scope="module")
def llm(models):
    return LLM(model=str(models.get("llama")), max_model_len=256)


def greedy(llm, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]


def test_a_banned_token_sequence_is_not_generated(llm):
    prompt = make_prompts(1, seed=11)[0]
    free = greedy(llm, prompt).token_ids
    banned = greedy(llm, prompt, bad_words_token_ids=[free[3:5]]).token_ids
    assert banned[:4] == free[:4] and banned[4] != free[4]


def test_bad_words_as_text_go_through_the_tokenizer(llm):
    prompt = make_prompts(1, seed=12)[0]
    free = greedy(llm, prompt).token_ids
    word = llm.tokenizer.decode(free[:2]).strip()
    ids = bad_words_token_ids([word], llm.tokenizer)
    out = greedy(llm, prompt, bad_words=[word]).token_ids
    assert out != free
    for w in ids:
        assert all(out[i : i + len(w)] != w for i in range(len(out)))


def test_min_tokens_keeps_eos_out_until_reached(llm):
    eos = llm.tokenizer.eos_token_id
    prompt = [{"prompt_token_ids": make_prompts(1, seed=13)[0]}]

    def run(**kw):
        params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0}, **kw)
        return llm.generate(prompt, params)[0].outputs[0]

    assert run().token_ids == [eos]  # EOS first: stops at once
    out = run(min_tokens=3)  # vLLM: three tokens that are not EOS, then EOS
    assert out.token_ids[3] == eos and eos not in out.token_ids[:3]
    assert len(out.token_ids) == 4 and out.finish_reason == "stop"


def test_the_openai_request_carries_bad_words():
    from epdserve.engine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for request in (
        CompletionRequest(prompt="x", bad_words=["a b"]),
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], bad_words=["a b"]),
    ):
        assert request.sampling_params(16, None).bad_words == ["a b"]
