"""The one walker of chat content parts: images found, stripped, and template-ready messages."""

from __future__ import annotations

import pytest

from epdserve.common.chat_parts import (
    ImagePart,
    image_parts,
    image_urls,
    template_messages,
    without_images,
)

A = {"type": "image_url", "image_url": {"url": "http://a/1.png"}}
B = {"type": "input_image", "image_url": "http://b/2.png"}
NO_URL = {"type": "image"}
TEXT = {"type": "text", "text": "hi"}
MESSAGES = [
    {"role": "system", "content": "plain"},
    {"role": "user", "content": [TEXT, A, {"type": "text", "text": None}, B]},
    {"role": "user", "content": [NO_URL]},
]


def test_every_image_part_is_found_in_order_with_its_place():
    assert list(image_parts(MESSAGES)) == [
        ImagePart(1, 1, "http://a/1.png"),
        ImagePart(1, 3, "http://b/2.png"),
        ImagePart(2, 0, None),
    ]
    assert image_urls(MESSAGES) == ["http://a/1.png", "http://b/2.png"]
    assert ImagePart(2, 0, None).where == "messages[2].content[0]"


def test_without_images_keeps_text_and_leaves_the_request_untouched():
    stripped = without_images(MESSAGES)
    assert stripped[1]["content"] == [TEXT, {"type": "text", "text": None}]
    assert stripped[2]["content"] == [] and stripped[0] == MESSAGES[0]
    assert MESSAGES[1]["content"][1] is A  # a copy, not an edit
    assert list(image_parts(stripped)) == []


def test_template_messages_mark_images_and_join_all_text_messages():
    messages, images = template_messages(
        [
            *MESSAGES,
            {"role": "user", "content": [TEXT, {"type": "text", "text": " there"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}], "name": None},
        ]
    )
    assert messages == [
        {"role": "system", "content": "plain"},
        {
            "role": "user",
            "content": [TEXT, {"type": "image"}, {"type": "text", "text": ""}, {"type": "image"}],
        },
        {"role": "user", "content": [{"type": "image"}]},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
    ]
    assert images == list(image_parts(MESSAGES))


def test_template_messages_keep_only_fields_a_template_may_read():
    messages, _ = template_messages(
        [{"role": "tool", "content": "ok", "tool_call_id": "c", "secret": 1, "name": "w"}]
    )
    assert messages == [{"role": "tool", "content": "ok", "name": "w", "tool_call_id": "c"}]


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ({"role": "user"}, "messages"),
        (["hi"], r"messages\[0\]"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content"),
    ],
)
def test_malformed_messages_are_errors_naming_the_field(messages, where):
    with pytest.raises(ValueError, match=f"^{where}:"):
        template_messages(messages)
