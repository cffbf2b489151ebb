"""PromptTokenizer agrees with transformers on the tiny model's tokenizer and template."""

from __future__ import annotations

import pytest

from epdserve.router.tokenize import PromptError, PromptTokenizer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "def main(): hello"},
]


@pytest.fixture(scope="module")
def model_dir(models):
    return models.get("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def test_completion_prompt_ids_match_transformers(model_dir, hf):
    tok = PromptTokenizer(model_dir)
    text = "import os\nprint(os.getcwd())  # déjà vu"
    assert tok.completion_ids({"prompt": text}) == hf(text)["input_ids"]


def test_chat_prompt_ids_match_apply_chat_template(model_dir, hf):
    tok = PromptTokenizer(model_dir)
    expected = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok.render_chat({"messages": MESSAGES}) == expected
    ids = hf(expected, add_special_tokens=False)["input_ids"]
    assert tok.chat_ids({"messages": MESSAGES}) == ids


def test_token_id_prompts_and_batches_are_taken_as_given(model_dir):
    tok = PromptTokenizer(model_dir)
    assert tok.completion_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert tok.completion_ids({"prompt": [[8, 9], [1]]}) == [8, 9]
    assert tok.completion_ids({"prompt": ["ab", "cd"]}) == tok.completion_ids({"prompt": "ab"})


@pytest.mark.parametrize("body", [{}, {"prompt": 3}, {"prompt": [1, "x"]}])
def test_bad_completion_prompts_raise_prompt_error(model_dir, body):
    with pytest.raises(PromptError):
        PromptTokenizer(model_dir).completion_ids(body)


def test_chat_without_messages_raises_prompt_error(model_dir):
    with pytest.raises(PromptError, match="messages"):
        PromptTokenizer(model_dir).chat_ids({"messages": []})


def test_a_directory_without_tokenizer_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        PromptTokenizer(tmp_path)


CONVERSATIONS = [
    (MESSAGES, {}),
    (
        [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "and now?"},
        ],
        {},
    ),
    ([{"role": "user", "content": "say A"}], {"add_generation_prompt": False}),
    (
        [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "once upon"}],
        {"continue_final_message": True},
    ),
]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_the_routers_renderer_equals_transformers_on_every_architecture(models, arch):
    """The router renders with a torch-free twin of transformers' renderer; P/D pods take
    its token ids as they are, so the two must agree exactly."""
    transformers = pytest.importorskip("transformers")
    model_dir = models.get(arch)
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tok = PromptTokenizer(model_dir)
    for messages, options in CONVERSATIONS:
        continue_final = options.get("continue_final_message", False)
        expected = hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=options.get("add_generation_prompt", True) and not continue_final,
            continue_final_message=continue_final,
        )
        assert tok.render_chat({"messages": messages, **options}) == expected, (arch, messages)
