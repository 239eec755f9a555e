"""Frames as H.264 takes them: planar YUV 4:2:0 (I420), BT.601 limited range, as OpenCV's
``COLOR_RGB2YUV_I420`` makes it and every player reads an untagged ``yuv420p`` stream.

An I420 frame of ``w x h`` (both even) is one uint8 array of shape ``(h * 3 // 2, w)``: the
luma plane, then U and V at half the width and height. Composing an ad in I420 does half the
work of RGB (1.5 bytes a pixel, not 3) and needs no conversion before the encoder: footage
smaller than the output is converted at its own size and only its planes are scaled up; a
layer (text, logo) is converted once and blended into the luma at full and the chroma at half
resolution.
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

# BT.601 limited range in 8-bit integer arithmetic: OpenCV's RGB -> YUV_I420 coefficients
_M = np.array([[66, 129, 25], [-38, -74, 112], [112, -94, -18]], np.int32)
_OFF = np.array([16, 128, 128], np.int32)


def check_size(size: tuple[int, int]) -> tuple[int, int]:
    """``size`` (width, height) if both are even, as 4:2:0 needs; else ValueError."""
    w, h = size
    if w % 2 or h % 2:
        raise ValueError(f"size {w}x{h}: H.264 in yuv420p needs even width and height")
    return w, h


def planes(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Views of an I420 frame's Y, U and V planes (writing them writes the frame)."""
    if not buf.flags.c_contiguous:
        raise ValueError("an I420 frame must be one contiguous array (planes are views into it)")
    h = buf.shape[0] * 2 // 3
    w = buf.shape[1]
    flat = buf.reshape(-1)  # the chroma planes need not fill whole rows of the buffer (h % 4 == 2)
    n, q = w * h, (w // 2) * (h // 2)
    return buf[:h], flat[n:n + q].reshape(h // 2, w // 2), flat[n + q:n + 2 * q].reshape(h // 2, w // 2)


def blank(size: tuple[int, int], rgb=(0, 0, 0)) -> np.ndarray:
    """An I420 frame of ``size`` (width, height) filled with one RGB colour."""
    w, h = size
    buf = np.empty((h * 3 // 2, w), np.uint8)
    yuv = yuv444(np.array(rgb, np.uint8).reshape(1, 1, 3))[0, 0]
    for plane, v in zip(planes(buf), yuv):
        plane[...] = v
    return buf


def yuv444(rgb: np.ndarray) -> np.ndarray:
    """RGB uint8 (..., 3) to Y, U, V uint8 (..., 3) at the same resolution (BT.601 limited)."""
    x = rgb.astype(np.int32) @ _M.T
    return np.clip(((x + 128) >> 8) + _OFF, 0, 255).astype(np.uint8)


def from_rgb(rgb: np.ndarray) -> np.ndarray:
    """An RGB frame (even width and height) as I420."""
    return cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2YUV_I420)


def to_rgb(buf: np.ndarray) -> np.ndarray:
    """An I420 frame as RGB uint8."""
    return cv2.cvtColor(buf, cv2.COLOR_YUV2RGB_I420)


def put(buf: np.ndarray, rgb: np.ndarray, rect: tuple[int, int, int, int]) -> None:
    """Write the RGB picture ``rgb`` (any size) into ``rect`` (x, y, width, height; all even) of
    the I420 frame ``buf``, scaled to fit it exactly. Footage smaller than the rectangle is
    converted at its own size and its planes are scaled up (bilinear); larger footage is scaled
    down (area averaging) in RGB first."""
    x, y, w, h = rect
    Y, U, V = planes(buf)
    fh, fw = rgb.shape[:2]
    if fw >= w or fh >= h:
        small = rgb if (fw, fh) == (w, h) else cv2.resize(np.ascontiguousarray(rgb), (w, h), interpolation=cv2.INTER_AREA)
        sy, su, sv = planes(from_rgb(small))
        Y[y:y + h, x:x + w], U[y // 2:(y + h) // 2, x // 2:(x + w) // 2], V[y // 2:(y + h) // 2, x // 2:(x + w) // 2] = sy, su, sv
        return
    yuv = yuv444(rgb)
    full = (x, y, w, h) == (0, 0, Y.shape[1], Y.shape[0])
    for plane, c, k in ((Y, 0, 1), (U, 1, 2), (V, 2, 2)):
        src = np.ascontiguousarray(yuv[..., c])
        if full:  # scale straight into the frame
            cv2.resize(src, (w // k, h // k), dst=plane, interpolation=cv2.INTER_LINEAR)
        else:
            plane[y // k:(y + h) // k, x // k:(x + w) // k] = cv2.resize(src, (w // k, h // k),
                                                                       interpolation=cv2.INTER_LINEAR)


def region_rgb(buf: np.ndarray, box: tuple[int, int, int, int], step: int = 1) -> np.ndarray:
    """The RGB pixels (N, 3) of ``box`` (x, y, width, height) of an I420 frame, every ``step``-th
    row and column (chroma taken from the nearest half-resolution sample)."""
    Y, U, V = planes(buf)
    x, y, w, h = box
    x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + w, Y.shape[1]), min(y + h, Y.shape[0])
    if x0 >= x1 or y0 >= y1:
        return np.zeros((0, 3), np.uint8)
    ys, xs = np.arange(y0, y1, step), np.arange(x0, x1, step)
    yy = Y[np.ix_(ys, xs)].astype(np.float32) - 16
    u = U[np.ix_(ys // 2, xs // 2)].astype(np.float32) - 128
    v = V[np.ix_(ys // 2, xs // 2)].astype(np.float32) - 128
    r = 1.164 * yy + 1.596 * v
    g = 1.164 * yy - 0.392 * u - 0.813 * v
    b = 1.164 * yy + 2.017 * u
    return np.clip(np.stack([r, g, b], -1) + 0.5, 0, 255).astype(np.uint8).reshape(-1, 3)


def small_rgb(buf: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """An I420 frame scaled down to ``size`` (width, height; area averaging), as RGB."""
    w, h = size[0] // 2 * 2, size[1] // 2 * 2
    out = np.empty((h * 3 // 2, w), np.uint8)
    for src, dst, k in zip(planes(buf), planes(out), (1, 2, 2)):
        cv2.resize(src, (w // k, h // k), dst=dst, interpolation=cv2.INTER_AREA)
    rgb = to_rgb(out)
    return rgb if (w, h) == tuple(size) else cv2.resize(rgb, tuple(size), interpolation=cv2.INTER_LINEAR)


@dataclass
class Overlay:
    """An RGBA layer made ready to blend into I420 frames at (x, y): moved to even coordinates
    and sizes (a transparent row or column added where needed), its colour converted once, its
    alpha premultiplied and averaged for the half-resolution chroma."""

    x: int
    y: int
    alpha: tuple[np.ndarray, np.ndarray]  # uint16 alpha for luma (full) and chroma (half)
    pre: tuple[np.ndarray, np.ndarray, np.ndarray]  # uint16 colour x alpha: Y full, U and V half

    @classmethod
    def prepare(cls, rgba: np.ndarray, x: int, y: int) -> Overlay:
        px, py = x % 2, y % 2
        h, w = rgba.shape[:2]
        H, W = h + py + (h + py) % 2, w + px + (w + px) % 2
        padded = np.zeros((H, W, 4), np.uint8)
        padded[py:py + h, px:px + w] = rgba
        a = padded[..., 3].astype(np.uint16)
        yuv = yuv444(padded[..., :3]).astype(np.uint16)
        a2 = a.reshape(H // 2, 2, W // 2, 2)
        ac = ((a2.sum(axis=(1, 3)) + 2) // 4).astype(np.uint16)
        chroma = []
        for c in (1, 2):
            prod = (yuv[..., c] * a).astype(np.uint32).reshape(H // 2, 2, W // 2, 2).sum(axis=(1, 3))
            chroma.append(np.minimum((prod + 2) // 4, 255 * ac.astype(np.uint32)).astype(np.uint16))
        return cls(x - px, y - py, (a, ac), (yuv[..., 0] * a, chroma[0], chroma[1]))

    def blend(self, buf: np.ndarray, opacity: float = 1.0) -> None:
        """Composite onto the I420 frame ``buf`` in place, times ``opacity``; what lies outside
        the frame is dropped. (dst * (255 - a) + colour * a + 127) / 255, exact to one level."""
        if opacity <= 0:
            return
        k256 = int(round(opacity * 256))
        for plane, a, pre, s in zip(planes(buf), (self.alpha[0], self.alpha[1], self.alpha[1]), self.pre, (1, 2, 2)):
            ph, pw = plane.shape
            x, y = self.x // s, self.y // s
            lh, lw = a.shape
            x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + lw, pw), min(y + lh, ph)
            if x0 >= x1 or y0 >= y1:
                continue
            sl = (slice(y0 - y, y1 - y), slice(x0 - x, x1 - x))
            aa, pp = a[sl], pre[sl]
            if k256 < 256:
                aa = (aa * k256) >> 8
                pp = ((pp.astype(np.uint32) * k256) >> 8).astype(np.uint16)
            dst = plane[y0:y1, x0:x1]
            mixed = dst * (255 - aa) + pp + 127
            dst[...] = ((mixed + (mixed >> 8) + 1) >> 8).astype(np.uint8)
