"""The offline ``LLM`` API: sampling options, n, seeds, logprobs, stops, validation."""

from __future__ import annotations

import json

import pytest
import torch
from conftest_helpers import assert_no_leak, make_prompts

from epdserve.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(models):
    return LLM(model=str(models.get("llama")), max_model_len=512)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_string_prompts_are_tokenized_and_text_is_detokenized(llm):
    out = llm.generate(
        ["def main():\n    return"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    assert out.prompt_token_ids == llm.tokenizer.encode("def main():\n    return")
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8


def test_same_seed_reproduces_and_other_seeds_differ(llm):
    prompt = [{"prompt_token_ids": make_prompts(1, seed=3)[0]}]

    def run(seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True)
        return llm.generate(prompt, params)[0].outputs[0].token_ids

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_n_samples_share_the_prompt_and_differ(llm):
    out = llm.generate(
        [{"prompt_token_ids": list(range(20, 84))}],
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True),
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert_no_leak(llm)


def test_top_k_one_is_greedy(llm):
    prompt = [{"prompt_token_ids": list(range(30, 60))}]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    top1 = llm.generate(
        prompt, SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=8, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_logit_bias_forces_and_bans_tokens_and_leaves_logprobs_raw(llm):
    prompt = [{"prompt_token_ids": list(range(30, 60))}]
    plain = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    )[0].outputs[0]
    forced = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, logit_bias={777: 100.0}
        ),
    )[0].outputs[0]
    assert forced.token_ids == [777] * 6
    assert forced.logprobs[0][777].logprob < 0  # the model's own logprob, not the biased one
    banned = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, logit_bias={plain.token_ids[0]: -100.0}
        ),
    )[0].outputs[0]
    assert banned.token_ids[0] != plain.token_ids[0]


def test_logprobs_match_transformers_log_softmax(llm, models):
    from transformers import AutoModelForCausalLM

    prompt = list(range(40, 70))
    out = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1, ignore_eos=True),
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(models.get("llama"))
    ids = torch.tensor([prompt + out.outputs[0].token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    for step, entry in enumerate(out.outputs[0].logprobs):
        token = out.outputs[0].token_ids[step]
        assert entry[token].rank == 1 and len(entry) >= 2
        assert entry[token].logprob == pytest.approx(
            ref[len(prompt) - 1 + step, token].item(), abs=1e-4
        )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    second = out.prompt_logprobs[1][prompt[1]].logprob
    assert second == pytest.approx(ref[0, prompt[1]].item(), abs=1e-4)


def test_stop_string_truncates_text_and_finishes(llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(50, 90))}]
    full = llm.generate(prompt, params)[0].outputs[0].text
    stop = full[5:8]
    assert stop and stop not in full[: 5 + len(stop) - 1]
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert_no_leak(llm)


def test_penalties_change_greedy_choices(llm):
    prompt = [{"prompt_token_ids": list(range(100, 140))}]
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    pen = llm.generate(
        prompt,
        SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            repetition_penalty=2.0,
            frequency_penalty=1.5,
        ),
    )
    out = pen[0].outputs[0].token_ids
    assert out != base[0].outputs[0].token_ids
    assert len(set(out)) >= len(set(base[0].outputs[0].token_ids))


def test_prompt_longer_than_max_model_len_is_rejected(models):
    llm = LLM(model=str(models.get("qwen2")), max_model_len=32)
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate([{"prompt_token_ids": list(range(40))}])
    assert_no_leak(llm)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(tmp_path))


def test_missing_tensor_is_named(models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = models.get("qwen3")
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        LLM(model=str(tmp_path))
