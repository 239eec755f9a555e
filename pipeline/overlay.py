"""Text and image layers for finished ads: glyph coverage, fitting a text into its box, drawing it
with an outline or a shadow, and placing a layer by anchor inside a safe area.

Layers are RGBA uint8 arrays (H, W, 4) drawn once per ad and format, then blended into each
frame they cover (``pipeline.i420.Overlay``); nothing here knows about templates or jobs. Text is drawn by FreeType
through Pillow, with complex-script shaping when Pillow has libraqm.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ANCHORS = ("top-left", "top", "top-right", "left", "center", "right", "bottom-left", "bottom", "bottom-right")
_HEX = re.compile(r"^#([0-9a-fA-F]{6})$")


def parse_colour(value: str) -> tuple[int, int, int]:
    """``#RRGGBB`` to an RGB tuple; ValueError naming the value otherwise."""
    m = _HEX.match(str(value).strip())
    if not m:
        raise ValueError(f"{value!r} is not a colour; write it as #RRGGBB, for example #ffcc00")
    h = m.group(1)
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


@functools.lru_cache(maxsize=16)
def _cmap(path: str) -> frozenset[int]:
    from fontTools.ttLib import TTCollection, TTFont

    if path.lower().endswith((".ttc", ".otc")):
        font = TTCollection(path, lazy=True).fonts[0]
    else:
        font = TTFont(path, lazy=True, fontNumber=0)
    return frozenset(font.getBestCmap() or {})


def missing_glyphs(font: str | Path, text: str) -> list[str]:
    """The characters of ``text`` (in order, each once) that ``font`` has no glyph for; spaces and
    line breaks need none."""
    have = _cmap(str(font))
    out: list[str] = []
    for ch in text:
        if not ch.isspace() and ord(ch) not in have and ch not in out:
            out.append(ch)
    return out


@functools.lru_cache(maxsize=64)
def load_font(path: str, px: int):
    """A FreeType font at ``px`` pixels (the first face of a collection)."""
    from PIL import ImageFont

    return ImageFont.truetype(path, size=max(1, int(px)), index=0)


@dataclass(frozen=True)
class TextStyle:
    """How a text is drawn. ``outline`` (px, around each glyph) and ``shadow`` (px, down and
    right) are off at 0; their colours are RGB."""

    font: str
    px: int
    colour: tuple[int, int, int] = (255, 255, 255)
    outline: int = 0
    outline_colour: tuple[int, int, int] = (0, 0, 0)
    shadow: int = 0
    shadow_colour: tuple[int, int, int] = (0, 0, 0)

    def pad(self) -> int:
        return self.outline + self.shadow


def _bbox(text: str, style: TextStyle) -> tuple[int, int, int, int]:
    """Where ``text`` drawn at the origin in ``style`` lies (outline included, shadow not)."""
    from PIL import Image, ImageDraw

    draw = ImageDraw.Draw(Image.new("L", (1, 1)))
    return draw.multiline_textbbox((0, 0), text, font=load_font(style.font, style.px), stroke_width=style.outline,
                                   align="center")


def text_size(text: str, style: TextStyle) -> tuple[int, int]:
    """(width, height) in pixels of ``text`` drawn in ``style``, outline and shadow included."""
    x0, y0, x1, y1 = _bbox(text, style)
    return x1 - x0 + style.shadow, y1 - y0 + style.shadow


def fit_px(text: str, style: TextStyle, min_px: int, max_w: int, max_h: int) -> int | None:
    """The largest size from ``style.px`` down to ``min_px`` at which ``text`` fits a
    ``max_w`` x ``max_h`` box (outline scaled with the size); None if it does not fit at ``min_px``."""
    lo, hi, best = int(min_px), int(style.px), None
    while lo <= hi:  # the drawn width grows with the size, so bisect
        mid = (lo + hi) // 2
        w, h = text_size(text, scaled(style, mid))
        if w <= max_w and h <= max_h:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def scaled(style: TextStyle, px: int) -> TextStyle:
    """``style`` at size ``px``, its outline and shadow scaled alike (at least 1 px where set)."""
    k = px / max(style.px, 1)
    return TextStyle(style.font, px, style.colour, max(1, round(style.outline * k)) if style.outline else 0,
                     style.outline_colour, max(1, round(style.shadow * k)) if style.shadow else 0, style.shadow_colour)


def render_text(text: str, style: TextStyle) -> np.ndarray:
    """``text`` as an RGBA layer (H, W, 4) cropped to what is drawn: shadow, outline, then fill."""
    from PIL import Image, ImageDraw

    font = load_font(style.font, style.px)
    x0, y0, x1, y1 = _bbox(text, style)
    w, h = x1 - x0 + style.shadow, y1 - y0 + style.shadow
    img = Image.new("RGBA", (max(w, 1), max(h, 1)), (0, 0, 0, 0))
    draw = ImageDraw.Draw(img)
    origin = (-x0, -y0)
    if style.shadow:
        draw.multiline_text((origin[0] + style.shadow, origin[1] + style.shadow), text, font=font,
                            fill=(*style.shadow_colour, 255), stroke_width=style.outline,
                            stroke_fill=(*style.shadow_colour, 255), align="center")
    draw.multiline_text(origin, text, font=font, fill=(*style.colour, 255), stroke_width=style.outline,
                        stroke_fill=(*style.outline_colour, 255), align="center")
    return np.asarray(img, dtype=np.uint8).copy()


def place(layer_hw: tuple[int, int], frame_hw: tuple[int, int], anchor: str, margin: tuple[float, float],
          safe: tuple[float, float]) -> tuple[int, int]:
    """Top-left (x, y) of a ``layer_hw`` layer at ``anchor`` in a ``frame_hw`` frame, ``margin``
    (x, y, fractions of the frame) in from the safe area, whose own margins are ``safe``."""
    if anchor not in ANCHORS:
        raise ValueError(f"anchor {anchor!r} is not known; allowed: {', '.join(ANCHORS)}")
    lh, lw = layer_hw
    fh, fw = frame_hw
    left, top = round(fw * (safe[0] + margin[0])), round(fh * (safe[1] + margin[1]))
    right, bottom = fw - left, fh - top
    col = "left" if anchor.endswith("left") else "right" if anchor.endswith("right") else "center"
    row = "top" if anchor.startswith("top") else "bottom" if anchor.startswith("bottom") else "middle"
    x = left if col == "left" else right - lw if col == "right" else (fw - lw) // 2
    y = top if row == "top" else bottom - lh if row == "bottom" else (fh - lh) // 2
    return int(x), int(y)


def box(frame_hw: tuple[int, int], margin: tuple[float, float], safe: tuple[float, float]) -> tuple[int, int]:
    """(width, height) a layer may take inside the safe area less ``margin`` on each side."""
    fh, fw = frame_hw
    return (max(0, fw - 2 * round(fw * (safe[0] + margin[0]))), max(0, fh - 2 * round(fh * (safe[1] + margin[1]))))


def load_image(path: str | Path) -> np.ndarray:
    """An image file as RGBA uint8 (H, W, 4)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGBA"), dtype=np.uint8).copy()


def resize_layer(layer: np.ndarray, width: int) -> np.ndarray:
    """An RGBA layer scaled to ``width`` pixels wide, keeping its aspect (area filter)."""
    import cv2

    h, w = layer.shape[:2]
    height = max(1, round(h * width / w))
    # premultiply, so that transparent pixels' colours do not bleed into the edges
    pm = layer.astype(np.float32)
    pm[..., :3] *= pm[..., 3:4] / 255.0
    out = cv2.resize(pm, (int(width), height), interpolation=cv2.INTER_AREA)
    a = out[..., 3:4]
    out[..., :3] = np.where(a > 0, out[..., :3] * 255.0 / np.maximum(a, 1e-6), 0)
    return np.clip(out + 0.5, 0, 255).astype(np.uint8)
