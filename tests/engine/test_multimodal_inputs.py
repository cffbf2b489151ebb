"""Image inputs: data URLs with limits, hashing, and processing identical to Gemma3Processor."""

from __future__ import annotations

import base64
import io

import pytest

from epdserve.engine.inputs.hashing import image_item_bytes, mm_hash
from epdserve.engine.inputs.images import ImageLimits, load_image_url


def png_data_url(color=(200, 10, 30), size=(80, 50), fmt="PNG") -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_data_url_decodes_to_rgb_with_original_bytes():
    loaded = load_image_url(png_data_url(), ImageLimits(), "messages[0].content[1]")
    assert loaded.image.mode == "RGB" and loaded.image.size == (80, 50)
    assert loaded.raw.startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64,!!!notbase64", "invalid base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "not a decodable image"),
        ("ftp://example.com/a.png", "unsupported image URL scheme"),
        ("https://example.com/a.png", "not allowed"),
    ],
)
def test_bad_images_raise_naming_the_part(url, message):
    with pytest.raises(ValueError, match=rf"^messages\[0\]\.content\[1\]: .*{message}"):
        load_image_url(url, ImageLimits(), "messages[0].content[1]")


def test_oversized_images_are_refused():
    with pytest.raises(ValueError, match="pixels"):
        load_image_url(png_data_url(size=(100, 100)), ImageLimits(max_pixels=5000), "image")
    with pytest.raises(ValueError, match="bytes"):
        load_image_url(png_data_url(), ImageLimits(max_bytes=10), "image")


def test_format_outside_the_list_is_refused():
    with pytest.raises(ValueError, match="format"):
        load_image_url(png_data_url(fmt="GIF"), ImageLimits(formats=("PNG",)), "image")


def test_hash_depends_on_bytes_model_and_kwargs():
    a = mm_hash("m", "image", b"x", {"size": 64})
    assert a == mm_hash("m", "image", b"x", {"size": 64})
    assert (
        len(
            {
                a,
                mm_hash("m", "image", b"y", {"size": 64}),
                mm_hash("n", "image", b"x", {"size": 64}),
                mm_hash("m", "image", b"x", {"size": 32}),
            }
        )
        == 4
    )


def test_pixels_hash_when_no_encoded_bytes():
    from PIL import Image

    img = Image.new("RGB", (2, 2), (1, 2, 3))
    assert image_item_bytes(None, img).startswith(b"pixels:RGB:2x2:")


def test_processing_matches_the_hf_processor(models):
    from transformers import AutoProcessor

    from epdserve.engine.inputs.image_processor import ImageProcessor
    from epdserve.engine.tokenizer import TokenizerInfo

    path = str(models.get("gemma3"))
    tok = TokenizerInfo(path)
    proc = ImageProcessor(path, "tiny-gemma3", tok)
    images = [
        load_image_url(png_data_url((i * 40, 10, 30)), ImageLimits(), "image") for i in range(2)
    ]
    prompt = "<|im_start|>user\n<start_of_image>a<start_of_image>b<|im_end|>\n"
    ours = proc.process(prompt, images)
    hf = AutoProcessor.from_pretrained(path)(
        text=prompt, images=[i.image for i in images], return_tensors="np"
    )
    assert ours.token_ids == hf["input_ids"][0].tolist()
    for k, item in enumerate(ours.items):
        assert (item.pixels() == hf["pixel_values"][k]).all()
        assert ours.token_ids[item.offset : item.offset + item.length] == [proc.image_token_id] * 4
    again = proc.process(prompt, images)
    assert [m.identifier for m in again.items] == [m.identifier for m in ours.items]
    assert ours.items[0].identifier != ours.items[1].identifier


def test_image_count_must_match_markers(models):
    from epdserve.engine.inputs.image_processor import ImageProcessor
    from epdserve.engine.tokenizer import TokenizerInfo

    path = str(models.get("gemma3"))
    proc = ImageProcessor(path, "m", TokenizerInfo(path), max_images=1)
    img = load_image_url(png_data_url(), ImageLimits(), "image")
    with pytest.raises(ValueError, match="^prompt:"):
        proc.process("no marker", [img])
    with pytest.raises(ValueError, match="^messages: at most 1"):
        proc.process("<start_of_image><start_of_image>", [img, img])
