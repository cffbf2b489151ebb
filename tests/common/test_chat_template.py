"""The one chat-template renderer equals transformers' ``apply_chat_template`` (the oracle) on
every template we ship and on templates that use what real checkpoints' templates use."""

from __future__ import annotations

import json
import shutil

import pytest

from epdserve.common.chat_parts import template_messages
from epdserve.common.chat_template import ChatTemplate, ChatTemplateError, render_options
from epdserve.engine.make_model import ARCHS

transformers = pytest.importorskip("transformers")

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
SYSTEM = {"role": "system", "content": "You are terse."}
CHATS = {  # OpenAI messages, as a client sends them
    "one turn": [{"role": "user", "content": "def main(): hello"}],
    "system": [SYSTEM, {"role": "user", "content": "déjà vu <|im_end|>"}],
    "multi turn": [
        SYSTEM,
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "now?"}],
        },
    ],
    "image": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "what is this?"}]}],
    "images in turns": [
        SYSTEM,
        {"role": "user", "content": [{"type": "text", "text": "first "}, IMAGE]},
        {"role": "assistant", "content": "a red square"},
        {"role": "user", "content": [IMAGE, IMAGE, {"type": "text", "text": "and these?"}]},
    ],
    "empty content": [{"role": "user", "content": None}, {"role": "assistant", "content": []}],
}
OPTIONS = {  # request fields -> the same call to transformers
    "generation prompt": ({}, dict(add_generation_prompt=True)),
    "no generation prompt": ({"add_generation_prompt": False}, {}),
    "template kwargs": (
        {"chat_template_kwargs": {"enable_thinking": False}},
        dict(add_generation_prompt=True, enable_thinking=False),
    ),
    "tools": (
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        dict(add_generation_prompt=True, tools=[{"type": "function", "function": {"name": "f"}}]),
    ),
}


def oracle(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def both(model_dir, messages, request, hf_kwargs):
    ours, _ = template_messages(messages)
    want = oracle(model_dir).apply_chat_template(ours, tokenize=False, **hf_kwargs)
    got = ChatTemplate.from_dir(model_dir).render(ours, **render_options(request))
    return got, want


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_shipped_template_renders_as_transformers(models, arch, chat, option):
    request, hf_kwargs = OPTIONS[option]
    got, want = both(models.get(arch), CHATS[chat], request, hf_kwargs)
    assert got == want


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "last",
    [
        "once upon",
        "trailing spaces   ",
        [IMAGE, {"type": "text", "text": "look: "}],
    ],
)
def test_continue_final_message_ends_where_transformers_ends(models, arch, last):
    messages = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": last}]
    request = {"continue_final_message": True, "add_generation_prompt": False}
    got, want = both(models.get(arch), messages, request, dict(continue_final_message=True))
    assert got == want


# What real checkpoints' templates do: bos_token, tools and documents through tojson,
# namespace(), loop controls, raise_exception, reasoning fields, the generation tag.
FEATURES = """{{- bos_token }}
{%- if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{%- for d in documents or [] %}[doc {{ loop.index }}] {{ d.title }}: {{ d.text }}
{% endfor %}
{%- set ns = namespace(users=0) %}
{%- for message in messages %}
  {%- if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
  {%- if message.role == 'skip' %}{% continue %}{% endif %}
  {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('roles must be system, user, assistant or tool') }}
  {%- endif %}
<{{ message.role }}{% if message.name is defined %} name={{ message.name }}{% endif %}>
  {%- if message.reasoning_content is defined %}<think>{{ message.thinking }}</think>{% endif %}
  {%- if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{% endgeneration %}
  {%- else %}{{ message.content }}{% endif %}
  {%- if message.tool_calls is defined %} calls={{ message.tool_calls | tojson }}{% endif %}
</{{ message.role }}>
{%- endfor %}
{{ ns.users }} user turns, {{ strftime_now('%%') }}, flag={{ flag | default('none') }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def feature_dir(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models.get("llama") / name, out / name)
    (out / "chat_template.jinja").write_text(FEATURES)
    return out


TOOL_CHAT = [
    SYSTEM,
    {"role": "user", "content": "weather?", "name": "ann"},
    {
        "role": "assistant",
        "content": "  let me look  ",
        "reasoning": "the user wants weather",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
]
TOOLS = [{"type": "function", "function": {"name": "w", "description": "é <b>", "parameters": {}}}]
DOCS = [{"title": "a", "text": "alpha"}, {"title": "b", "text": "beta"}]


@pytest.mark.parametrize(
    ("request_fields", "hf_kwargs"),
    [
        ({}, dict(add_generation_prompt=True)),
        (
            {"tools": TOOLS, "documents": DOCS},
            dict(add_generation_prompt=True, tools=TOOLS, documents=DOCS),
        ),
        (
            {"chat_template_kwargs": {"flag": "on", "bos_token": "<B>"}},
            dict(add_generation_prompt=True, flag="on", bos_token="<B>"),
        ),
        (
            {"add_generation_prompt": False, "continue_final_message": True},
            dict(continue_final_message=True),
        ),
    ],
)
def test_features_of_real_templates_render_as_transformers(feature_dir, request_fields, hf_kwargs):
    messages = TOOL_CHAT if not request_fields.get("continue_final_message") else TOOL_CHAT[:3]
    got, want = both(feature_dir, messages, request_fields, hf_kwargs)
    assert got == want


def test_raise_exception_is_a_chat_template_error_naming_messages(feature_dir):
    with pytest.raises(transformers.utils.chat_template_utils.jinja2.TemplateError):
        oracle(feature_dir).apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    with pytest.raises(ChatTemplateError, match="^messages: roles must be system"):
        ChatTemplate.from_dir(feature_dir).render([{"role": "robot", "content": "x"}])


def test_named_templates_pick_tool_use_for_tools_and_default_otherwise(feature_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(feature_dir / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}]
    for request, hf_kwargs in (({}, {}), ({"tools": TOOLS}, {"tools": TOOLS})):
        got, want = both(tmp_path, messages, {**request, "add_generation_prompt": False}, hf_kwargs)
        assert got == want
    assert got == "tools:1:hi"


def test_a_model_without_a_template_has_none(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_dir(tmp_path) is None


@pytest.mark.parametrize("name", ["add_generation_prompt", "chat_template", "tokenize", "messages"])
def test_a_client_cannot_set_reserved_template_kwargs(name):
    with pytest.raises(ChatTemplateError, match=f"^chat_template_kwargs: {name} cannot be set"):
        render_options({"chat_template_kwargs": {name: True}})


def test_request_defaults_add_the_generation_prompt_and_kwargs_win():
    assert render_options({})["add_generation_prompt"] is True
    options = render_options({"tools": [1], "chat_template_kwargs": {"tools": None, "x": 2}})
    assert options["tools"] is None and options["x"] == 2


def test_continue_final_message_with_a_generation_prompt_is_refused(models):
    template = ChatTemplate.from_dir(models.get("llama"))
    with pytest.raises(ChatTemplateError, match="^continue_final_message:"):
        template.render(
            [{"role": "user", "content": "x"}], **render_options({"continue_final_message": True})
        )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"tools": "f"}, "tools"), ({"documents": [1]}, "documents"), ({}, "messages")],
)
def test_malformed_inputs_are_errors_naming_the_field(models, kwargs, field):
    template = ChatTemplate.from_dir(models.get("llama"))
    messages = [] if field == "messages" else [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match=f"^{field}:"):
        template.render(messages, **kwargs)


def test_a_template_tripping_on_the_data_is_a_client_error_not_a_crash(tmp_path):
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content + 1 }}")
    with pytest.raises(ChatTemplateError, match="^messages: the chat template failed"):
        ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}])


def test_templates_cannot_reach_python_internals(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}"
    )
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}])
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "x"}])
