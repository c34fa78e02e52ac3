"""Issue 48, items 11-14: the reward server's defects found by probing. Only image formats
that mmrl allows are opened (item 14); image decoding runs off the event loop within a
per-request pixel budget (item 13); a client that sends headers and then no body is
disconnected (item 12); a request's time-out cancels its work, killing and replacing the
workers that still run its samples (item 11)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from mmrl.server.protocol import RequestError, check_image
from mmrl.types import ALLOWED_IMAGE_FORMATS, ImageError, load_image

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n"


def _encoded(fmt: str, size: tuple[int, int] = (8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format=fmt)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Item 14: only PNG, JPEG, WebP, GIF, BMP and TIFF are opened


def test_the_allowed_formats_are_png_jpeg_webp_gif_bmp_tiff():
    assert set(ALLOWED_IMAGE_FORMATS) == {"PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_allowed_formats_load_from_bytes_and_paths(fmt, tmp_path):
    data = _encoded(fmt)
    assert load_image(data).size == (8, 8)
    path = tmp_path / f"image.{fmt.lower()}"
    path.write_bytes(data)
    assert load_image(path).mode == "RGB"


def test_eps_is_refused_naming_its_format_and_never_reaches_ghostscript(tmp_path, monkeypatch):
    from PIL import EpsImagePlugin

    def no_ghostscript(*args, **kwargs):
        raise AssertionError("Ghostscript was asked to render untrusted data")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    with pytest.raises(ImageError, match=r"EPS images are not accepted \(allowed formats: PNG, JPEG, WebP"):
        load_image(EPS)
    path = tmp_path / "picture.png"  # the name does not matter, the bytes do
    path.write_bytes(EPS)
    with pytest.raises(ImageError, match="picture.png: EPS images are not accepted"):
        load_image(path)


@pytest.mark.parametrize("fmt", ["PPM", "ICO", "PCX", "SGI", "DDS"])
def test_other_formats_pillow_knows_are_refused_by_name(fmt):
    with pytest.raises(ImageError, match=f"{fmt} images are not accepted"):
        load_image(_encoded(fmt))


def test_the_server_refuses_an_eps_image_with_a_422_naming_the_format(tmp_path):
    for item in (
        base64.b64encode(EPS).decode(),
        "data:image/png;base64," + base64.b64encode(EPS).decode(),
    ):
        with pytest.raises(RequestError) as info:
            check_image(item, "samples[0].images[0]", decode=True)
        assert info.value.status == 422
        assert "samples[0].images[0]: unreadable image" in info.value.message
        assert "EPS images are not accepted" in info.value.message
    (tmp_path / "a.eps").write_bytes(EPS)
    with pytest.raises(RequestError, match="a.eps: EPS images are not accepted"):
        check_image("a.eps", "samples[0].images[0]", decode=True, image_root=tmp_path)
