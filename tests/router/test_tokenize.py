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


def test_a_chat_with_images_is_left_to_the_pods(models):
    """Image placeholders are expanded by a pod's processor: the router never guesses them."""
    tok = PromptTokenizer(models.get("gemma3"))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}
    with pytest.raises(PromptError, match="images"):
        tok.chat_ids(body)


def test_template_errors_and_reserved_kwargs_are_prompt_errors(model_dir):
    tok = PromptTokenizer(model_dir)
    body = {"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}}
    with pytest.raises(PromptError, match="chat_template_kwargs"):
        tok.chat_ids(body)
    with pytest.raises(PromptError, match="continue_final_message"):
        tok.chat_ids({"messages": MESSAGES, "continue_final_message": True})


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chat_ids_equal_transformers_tokenizing_its_own_rendering(models, arch):
    """What a P/D pod takes as its prompt when the router tokenized it."""
    transformers = pytest.importorskip("transformers")
    model_dir = models.get(arch)
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    body = {
        "messages": [*MESSAGES, {"role": "assistant", "content": "once upon"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    want = hf.apply_chat_template(body["messages"], continue_final_message=True, return_dict=False)
    assert PromptTokenizer(model_dir).chat_ids(body) == want
