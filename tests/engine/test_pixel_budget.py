"""The pixel budget: images are checked from their headers (per image, then per request)
before anything is decoded, and decoded one at a time."""

from __future__ import annotations

import gc
import sys
import warnings
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))  # the shared image bombs

import image_bombs as bombs  # noqa: E402

from epdserve.engine.inputs import budget  # noqa: E402
from epdserve.engine.inputs.budget import ImageHeader, check_request_pixels  # noqa: E402
from epdserve.engine.inputs.images import ImageLimits, LoadedImage, load_image_url  # noqa: E402

WHERE = "messages[0].content[1]"


def load(raw: bytes, limits: ImageLimits | None = None) -> LoadedImage:
    return load_image_url(bombs.data_url(raw), limits or ImageLimits(), WHERE)


def charged(width: int, height: int, where: str) -> LoadedImage:
    return LoadedImage(header=ImageHeader("PNG", width, height), where=where)


def test_the_request_total_counts_every_image_and_names_the_one_past_the_bound():
    limits = ImageLimits(max_pixels_per_request=1000)
    images = [charged(10, 50, "a"), charged(10, 50, "b")]
    assert check_request_pixels(images, limits) == 1000  # exactly the bound passes
    with pytest.raises(
        ValueError, match=r"^c: the request's images up to this one decode to 1,001 "
    ):
        check_request_pixels([*images, charged(1, 1, "c")], limits)


def test_handed_over_pixels_are_not_charged():
    from PIL import Image

    given = LoadedImage(Image.new("RGB", (100, 100)), b"")
    assert check_request_pixels([given], ImageLimits(max_pixels_per_request=1)) == 0


def test_the_charge_is_the_rgb_the_processor_makes():
    assert ImageHeader("PNG", 6300, 6300).rgb_bytes == 6300 * 6300 * 3


def test_the_header_check_decodes_nothing(monkeypatch):
    from PIL import ImageFile

    def no_load(self):
        raise AssertionError("pixels were decoded during the header check")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    for raw in (bombs.png_1bit(4000, 4000), bombs.small("JPEG"), bombs.gif(64, 64, 10)):
        assert load(raw).header.pixels > 0
    with pytest.raises(ValueError, match="pixels"):
        load(bombs.png_1bit(6300, 6300))


# (name, encoded image, what the 400 says): each refused before a pixel is decoded
HEADER_BOMBS = [
    ("the 6.5 KB 1-bit PNG of 6300x6300", bombs.png_1bit(6300, 6300), "6300x6300 = 39,690,000"),
    ("a PNG header of 50000x50000", bombs.png_header_only(50_000, 50_000), "PIL's own limit"),
    ("a PNG inside PIL's warning range", bombs.png_header_only(10_000, 10_000), "10000x10000"),
    ("a JPEG patched to 65000x65000", bombs.jpeg_claiming(65_000, 65_000), "PIL's own limit"),
    ("a JPEG patched to 6000x6000", bombs.jpeg_claiming(6000, 6000), "6000x6000"),
    ("a GIF of 1000 frames on a 9000x9000 screen", bombs.gif(9000, 9000, 1000), "9000x9000"),
    ("a GIF whose first frame outgrows its screen", bombs.gif(1, 1, 3, (0, 0, 6000, 6000)), "6000"),
    ("a WebP canvas of 16000x16000", bombs.webp_canvas(16_000, 16_000), "16000x16000"),
    ("a WebP canvas of 6000x6000", bombs.webp_canvas(6000, 6000), "6000x6000"),
]


@pytest.mark.parametrize(
    "raw, fragment", [c[1:] for c in HEADER_BOMBS], ids=[c[0] for c in HEADER_BOMBS]
)
def test_header_bombs_are_refused_naming_the_part(raw, fragment):
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: image has ") as info:
        load(raw)
    assert fragment in str(info.value) and "allowed per image" in str(info.value)


def test_a_webp_canvas_is_checked_before_pil_allocates_it(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("opened a WebP bomb"))
    with pytest.raises(ValueError, match="10000x10000"):
        load(bombs.webp_canvas(10_000, 10_000))


def test_pils_bomb_warning_as_an_error_is_the_same_400():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: image has more than"):
            load(bombs.png_header_only(10_000, 10_000), ImageLimits(max_pixels=200_000_000))


@pytest.mark.parametrize(
    "raw",
    [
        bombs.png_header_only(2000, 2000),  # a big header over a 64-byte body
        bombs.truncated(bombs.small("PNG", (400, 300))),
        bombs.truncated(bombs.small("JPEG", (400, 300))),
    ],
    ids=["huge header, tiny body", "truncated PNG", "truncated JPEG"],
)
def test_truncated_images_pass_the_header_check_and_fail_to_decode_naming_the_part(raw):
    image = load(raw)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: not a decodable image"):
        image.decode()


def test_an_animated_image_is_its_first_frame_and_its_other_frames_cost_nothing():
    image = load(bombs.gif(64, 48, 100_000))  # 2.4 MB: 100,000 one-pixel frames
    assert image.header.pixels == 64 * 48
    assert image.decode().size == (64, 48) and image.decode().mode == "RGB"


PARSER_BOMBS = [  # PIL would loop once per piece, in Python, before decoding a pixel
    ("a PNG of 200,000 empty chunks", bombs.png_chunks(200_000), "chunks"),
    ("a JPEG of 1,000,000 fill bytes", bombs.jpeg_fill(1_000_000), "fill bytes"),
    ("a GIF of 200,000 comment blocks", bombs.gif_comments(200_000), "blocks"),
]


@pytest.mark.parametrize(
    "raw, fragment", [c[1:] for c in PARSER_BOMBS], ids=[c[0] for c in PARSER_BOMBS]
)
def test_parser_bombs_are_refused_before_pil_parses_them(monkeypatch, raw, fragment):
    from PIL import Image

    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("PIL parsed a parser bomb"))
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]: not a decodable") as info:
        load(raw)
    assert "(more than 16,384 " in str(info.value) and fragment in str(info.value)


def rechunked_png(width: int, height: int, chunk: int) -> bytes:
    """A noise PNG whose image data is cut into ``chunk``-byte IDAT chunks."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    raw = bombs.saved(Image.fromarray(pixels), "PNG")
    ihdr_end, idat = 33, b""
    pos = ihdr_end
    while raw[pos + 4 : pos + 8] != b"IEND":
        length = int.from_bytes(raw[pos : pos + 4], "big")
        idat += raw[pos + 8 : pos + 8 + length] if raw[pos + 4 : pos + 8] == b"IDAT" else b""
        pos += 12 + length
    chunks = [bombs.png_chunk(b"IDAT", idat[i : i + chunk]) for i in range(0, len(idat), chunk)]
    return raw[:ihdr_end] + b"".join(chunks) + bombs.png_chunk(b"IEND", b"")


def test_real_images_are_far_inside_the_structure_bound():
    png = rechunked_png(1000, 1000, 1024)  # 2,900 chunks: libpng writes 8 KB ones
    assert load(png).decode().size == (1000, 1000)
    from epdserve.engine.inputs.structure import _png_turns

    assert 2000 < _png_turns(png) < 16_384


@pytest.fixture(scope="module")
def frontend(models):
    from epdserve.engine.inputs.processor import InputProcessor

    path = str(models.get("gemma3"))
    return lambda limits: InputProcessor(path, "tiny", image_limits=limits)


@pytest.fixture
def decodes(monkeypatch):
    """Every image decoded, as weak references (the images themselves are not kept)."""
    seen = []
    real = budget.decode_rgb

    def decode_rgb(*args):
        gc.collect()
        assert all(ref() is None for ref in seen), "an earlier decoded image is still alive"
        image = real(*args)
        seen.append(weakref.ref(image))
        return image

    monkeypatch.setattr("epdserve.engine.inputs.images.decode_rgb", decode_rgb)
    return seen


def prompt(n: int) -> str:
    return "<|im_start|>user\n" + "<start_of_image>" * n + "what?<|im_end|>\n"


def test_images_are_decoded_one_at_a_time_and_a_held_one_not_again(frontend, decodes):
    from epdserve.engine.core.pixel_cache import PixelSender

    mm, sender = frontend(ImageLimits()), PixelSender()
    images = [load(bombs.small("PNG", (40 + i, 30))) for i in range(3)]
    first = mm.prompt_with_images(prompt(3), images, False)
    assert decodes == []  # named from their bytes: nothing decoded yet
    features = sender.features(first.items)
    assert len(decodes) == 3 and all(f.data for f in features)
    again = mm.prompt_with_images(prompt(3), images, False)
    assert sender.missing(again.items) == []  # the core holds their pixels
    assert [f.data for f in sender.features(again.items)] == [b"", b"", b""]
    assert len(decodes) == 3 and again.token_ids == first.token_ids


def test_the_request_budget_is_checked_before_the_first_decode(frontend, decodes):
    mm = frontend(ImageLimits(max_pixels_per_request=5000))
    images = [load(bombs.small("PNG", (50, 50)), mm.image_limits) for _ in range(2)]
    images[1] = load_image_url(bombs.data_url(bombs.small("PNG", (51, 50))), mm.image_limits, "b")
    with pytest.raises(
        ValueError, match=r"^b: the request's images up to this one decode to 5,050"
    ):
        mm.prompt_with_images(prompt(2), images, False)
    assert decodes == []


def serve_args(*argv: str):
    import argparse

    from epdserve.engine.entrypoints import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["m", *argv])
    return serve_cli.from_args(serve_cli.ServeOptions, args).request_limits()[1]


def test_the_serve_flags_and_environment_set_both_bounds(monkeypatch):
    assert (serve_args().max_pixels, serve_args().max_pixels_per_request) == (
        25_000_000,
        100_000_000,
    )
    monkeypatch.setenv("EPDSERVE_MAX_IMAGE_PIXELS", "1234")
    limits = serve_args("--max-pixels-per-request", "99")
    assert (limits.max_pixels, limits.max_pixels_per_request) == (1234, 99)
    with pytest.raises(ValueError, match="^max_pixels_per_request: must be positive"):
        serve_args("--max-pixels-per-request", "0")
