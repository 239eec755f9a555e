"""The shapes world: a procedural clip generator whose ground truth is known.

One shape in one colour moves over a textured background while the camera moves. A clip is
described by a :class:`Spec` and captioned in the prompt grammar, in English or Chinese::

    a {colour} {shape} {motion} on a {background} background, {camera}
    {颜色}{形状}{运动}，{背景}背景，{镜头}

The world is fixed so that any careful reader of a clip agrees with its caption:

- **Frames.** :data:`FRAMES` frames at :data:`FPS` fps, :data:`SIZE` x :data:`SIZE` pixels.
- **Colours.** Shapes are saturated red, green, blue, yellow or near-white. Backgrounds are black,
  a mid grey, or beige (a warm mid-tone: red well above blue, darker than white).
- **Textures.** Checks, vertical stripes or smooth noise, all varying along x, so that a pan
  shows. A texture only scales the background colour's brightness, so it never changes its hue.
  Its period (10-16 px) is more than twice the largest per-frame background shift.
- **Camera.** ``pan left`` / ``pan right`` move the view by 10-14% of the frame side over the clip,
  so the background drifts the *other* way on screen (a pan right drifts it left). ``zoom in``
  magnifies by 1.25-1.4x about the frame centre.
- **Training-only camera moves.** ``tilt up`` / ``tilt down`` (上摇 / 下摇, terms the project's
  cleaning already knows) move the view up or down as a pan moves it sideways, so the background
  drifts the other way vertically. They are not in the grammar: no prompt of the benchmark asks
  for them, the analyzer does not read them, and :func:`all_specs` and :func:`parse` leave them
  out. A training run may mix them in (:func:`tilt_specs`) so that a vertical move of the whole
  frame is seen as often as a horizontal one. Their texture is checks or noise, never vertical
  stripes (which a tilt would not move).
- **Motion** is relative to the background. A moving shape travels 28-36% of the frame side
  relative to the background, and at least 10% on screen in the same direction; it stays fully
  in frame. ``stays still`` means fixed to the background: it drifts with a pan, and under a zoom
  an off-centre shape drifts outward (and grows, as the whole scene does).

Pure numpy/OpenCV. Rendering is deterministic in ``(spec, seed)``.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, fields, replace
from typing import Iterator, Literal

import cv2
import numpy as np

FRAMES = 8
FPS = 8
SIZE = 64

COLOURS = ("red", "green", "blue", "yellow", "white")
SHAPES = ("circle", "square", "triangle")
MOTIONS = ("moves left", "moves right", "moves up", "moves down", "stays still")
BACKGROUNDS = ("black", "grey", "beige")
CAMERAS = ("static shot", "pan left", "pan right", "zoom in")
TILTS = ("tilt up", "tilt down")  # training-only camera moves (not in the grammar)
TRAIN_CAMERAS = CAMERAS + TILTS

COLOURS_ZH = dict(zip(COLOURS, ("红色", "绿色", "蓝色", "黄色", "白色")))
SHAPES_ZH = dict(zip(SHAPES, ("圆形", "方形", "三角形")))
MOTIONS_ZH = dict(zip(MOTIONS, ("向左移动", "向右移动", "向上移动", "向下移动", "静止不动")))
BACKGROUNDS_ZH = dict(zip(BACKGROUNDS, ("黑色", "灰色", "米色")))
CAMERAS_ZH = dict(zip(CAMERAS, ("固定镜头", "左摇", "右摇", "变焦推进")))
TILTS_ZH = dict(zip(TILTS, ("上摇", "下摇")))

ATTRIBUTES = ("colour", "shape", "motion", "background", "camera")
VOCAB: dict[str, tuple[str, ...]] = {
    "colour": COLOURS, "shape": SHAPES, "motion": MOTIONS, "background": BACKGROUNDS, "camera": CAMERAS,
}
VOCAB_ZH: dict[str, dict[str, str]] = {
    "colour": COLOURS_ZH, "shape": SHAPES_ZH, "motion": MOTIONS_ZH, "background": BACKGROUNDS_ZH,
    "camera": CAMERAS_ZH,
}
TRAIN_VOCAB: dict[str, tuple[str, ...]] = {**VOCAB, "camera": TRAIN_CAMERAS}  # what a Spec may hold

# Nominal RGB of each shape colour and each background's base colour (before per-seed jitter).
COLOUR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 185, 60),
    "blue": (45, 75, 225),
    "yellow": (230, 210, 40),
    "white": (242, 242, 242),
}
BACKGROUND_RGB: dict[str, tuple[int, int, int]] = {
    "black": (32, 32, 32),
    "grey": (128, 128, 128),
    "beige": (185, 160, 115),
}
# Texture amplitude range per background: pixel = base * (1 + amp * t), t in [-1, 1].
TEXTURE_AMP: dict[str, tuple[float, float]] = {
    "black": (0.40, 0.50),
    "grey": (0.16, 0.22),
    "beige": (0.11, 0.15),
}
TEXTURES = ("checks", "stripes", "noise")

# Per-seed ranges, as fractions of the frame side unless said otherwise.
SHAPE_SIZE = (0.23, 0.31)  # bounding-box side at zoom 1
TRAVEL = (0.28, 0.36)  # a moving shape's travel relative to the background
PAN = (0.10, 0.14)  # the view's travel under a pan
ZOOM = (1.25, 1.40)  # magnification over the clip under a zoom in
PERIOD = (10.0, 16.0)  # texture period in pixels at SIZE 64 (scaled with the size)
COLOUR_JITTER = 10  # +- per channel, shape colour
BACKGROUND_JITTER = 0.04  # +- per channel, as a fraction of the background base colour (no tint on black)
MIN_SCREEN_TRAVEL = 0.10  # a moving shape's on-screen travel along its direction
MARGIN = 1.0  # pixels kept between the shape's box and the frame edge

_SUPERSAMPLE = 4  # the shape is drawn at 4x and area-downsampled: smooth, exact edges


@dataclass(frozen=True)
class Spec:
    """What a clip shows: one value of each attribute of the grammar (or, for the camera, one of
    the training-only :data:`TILTS`)."""

    colour: str
    shape: str
    motion: str
    background: str
    camera: str

    def __post_init__(self) -> None:
        for name in ATTRIBUTES:
            value = getattr(self, name)
            if value not in TRAIN_VOCAB[name]:
                extra = f" (or, in training only, {', '.join(TILTS)})" if name == "camera" else ""
                raise ValueError(f"{name}={value!r} is not in the grammar; allowed: {', '.join(VOCAB[name])}{extra}")

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def combo(self) -> tuple[str, str, str]:
        """The (colour, motion, camera) combination the held-out split is drawn over."""
        return (self.colour, self.motion, self.camera)


def caption_en(spec: Spec) -> str:
    """``a {colour} {shape} {motion} on a {background} background, {camera}``"""
    return f"a {spec.colour} {spec.shape} {spec.motion} on a {spec.background} background, {spec.camera}"


def caption_zh(spec: Spec) -> str:
    """``{颜色}{形状}{运动}，{背景}背景，{镜头}``"""
    return (f"{COLOURS_ZH[spec.colour]}{SHAPES_ZH[spec.shape]}{MOTIONS_ZH[spec.motion]}，"
            f"{BACKGROUNDS_ZH[spec.background]}背景，{CAMERAS_ZH.get(spec.camera) or TILTS_ZH[spec.camera]}")


def caption(spec: Spec, language: Literal["en", "zh"] = "en") -> str:
    """The caption of ``spec`` in ``language`` ('en' or 'zh'), before cleaning."""
    if language == "en":
        return caption_en(spec)
    if language == "zh":
        return caption_zh(spec)
    raise ValueError(f"language={language!r}; allowed: en, zh")


def _alternation(words) -> str:
    return "(" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + ")"


_EN_PATTERN = re.compile(
    rf"^\s*an?\s+{_alternation(COLOURS)}\s+{_alternation(SHAPES)}\s+{_alternation(MOTIONS)}\s+on\s+an?\s+"
    rf"{_alternation(BACKGROUNDS)}\s+background\s*[,，]\s*{_alternation(CAMERAS)}\s*\.?\s*$", re.IGNORECASE)
_ZH_PATTERN = re.compile(
    rf"^\s*{_alternation(COLOURS_ZH.values())}{_alternation(SHAPES_ZH.values())}{_alternation(MOTIONS_ZH.values())}"
    rf"\s*[,，]\s*{_alternation(BACKGROUNDS_ZH.values())}背景\s*[,，]\s*{_alternation([*CAMERAS_ZH.values(), *CAMERAS])}"
    rf"\s*[。.]?\s*$", re.IGNORECASE)
_FROM_ZH = {zh: en for table in VOCAB_ZH.values() for en, zh in table.items()}


def parse(prompt: str) -> Spec | None:
    """The spec a prompt of the grammar asks for, in English or Chinese, raw or as the project's
    prompt cleaning leaves it (which turns the Chinese camera terms into the English ones); None
    for any other prompt."""
    if m := _EN_PATTERN.match(prompt):
        return Spec(*(g.lower() for g in m.groups()))
    if m := _ZH_PATTERN.match(prompt):
        return Spec(*(_FROM_ZH.get(g, g.lower()) for g in m.groups()))
    return None


def all_specs() -> list[Spec]:
    """Every spec of the grammar (5 * 3 * 5 * 3 * 4 = 900), in a fixed order."""
    return [Spec(*v) for v in itertools.product(COLOURS, SHAPES, MOTIONS, BACKGROUNDS, CAMERAS)]


def _held_out_combos() -> frozenset[tuple[str, str, str]]:
    # One colour per (motion, camera) pair: (c + 2m + 3k) % 5 == 0. That is 20 of the 100
    # combinations; every colour is held out in 4, and every (colour, motion) pair keeps at least
    # three cameras in training, so each held-out combination is a new composition of seen parts.
    return frozenset(
        (c, m, k)
        for (ci, c), (mi, m), (ki, k) in itertools.product(enumerate(COLOURS), enumerate(MOTIONS), enumerate(CAMERAS))
        if (ci + 2 * mi + 3 * ki) % 5 == 0
    )


HELD_OUT: frozenset[tuple[str, str, str]] = _held_out_combos()


def is_held_out(spec: Spec) -> bool:
    """Whether ``spec``'s (colour, motion, camera) combination is held out from training."""
    return spec.combo in HELD_OUT


_REVERSED_MOTION = {"moves left": "moves right", "moves right": "moves left", "moves up": "moves down",
                    "moves down": "moves up", "stays still": "stays still"}
_REVERSED_CAMERA = {"static shot": "static shot", "pan left": "pan right", "pan right": "pan left",
                    "tilt up": "tilt down", "tilt down": "tilt up"}


def reversed_spec(spec: Spec) -> Spec | None:
    """What a clip of ``spec`` shows played backwards: the motion and the pan swap direction
    (the paths are linear in time, so the reversed clip obeys the conventions too). None for a
    zoom in, whose reverse (a zoom out) the grammar has no words for."""
    if spec.camera not in _REVERSED_CAMERA:
        return None
    return replace(spec, motion=_REVERSED_MOTION[spec.motion], camera=_REVERSED_CAMERA[spec.camera])


Split = Literal["train", "heldout", "all"]


def split_specs(split: Split) -> list[Spec]:
    """The specs of a split: 'train' (720), 'heldout' (180) or 'all' (900)."""
    specs = all_specs()
    if split == "all":
        return specs
    if split == "train":
        return [s for s in specs if not is_held_out(s)]
    if split == "heldout":
        return [s for s in specs if is_held_out(s)]
    raise ValueError(f"split={split!r}; allowed: train, heldout, all")


def tilt_specs() -> list[Spec]:
    """Every training-only spec with a vertical camera move (5 * 3 * 5 * 3 * 2 = 450), in a fixed
    order. None is in the grammar, so none is held out."""
    return [Spec(*v) for v in itertools.product(COLOURS, SHAPES, MOTIONS, BACKGROUNDS, TILTS)]


def sample_specs(rng: np.random.Generator, n: int, split: Split = "train") -> list[Spec]:
    """``n`` specs drawn uniformly (with replacement) from ``split``."""
    pool = split_specs(split)
    return [pool[i] for i in rng.integers(0, len(pool), size=n)]


def iter_samples(seed: int, split: Split = "train",
                 languages: tuple[str, ...] = ("en", "zh")) -> Iterator[tuple[Spec, int, str]]:
    """An endless, reproducible stream of ``(spec, clip_seed, raw caption)`` for training or eval."""
    rng = np.random.default_rng(seed)
    pool = split_specs(split)
    while True:
        spec = pool[int(rng.integers(len(pool)))]
        lang = languages[int(rng.integers(len(languages)))]
        yield spec, int(rng.integers(2**31)), caption(spec, lang)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Layout:
    """The per-seed numbers a clip was drawn with, all in output pixels."""

    size: float  # shape box side at zoom 1
    start: tuple[float, float]  # shape centre in world coordinates (world = screen at frame 0)
    travel: float  # the shape's travel relative to the background
    pan: float  # the view's travel (signed: + is right; + is down under a tilt)
    zoom: float  # magnification at the last frame
    texture: str
    period: float
    amp: float
    colour: tuple[float, float, float]
    base: tuple[float, float, float]


@dataclass(frozen=True)
class Clip:
    """A rendered clip: ``frames`` (T, H, W, 3) uint8, ``alpha`` (T, H, W) float32 shape coverage,
    ``centres`` (T, 2) the shape's on-screen centre (x, y) per frame."""

    frames: np.ndarray
    alpha: np.ndarray
    centres: np.ndarray
    layout: Layout


_DIRECTION = {
    "moves left": (-1.0, 0.0), "moves right": (1.0, 0.0), "moves up": (0.0, -1.0), "moves down": (0.0, 1.0),
    "stays still": (0.0, 0.0),
}


def view_path(camera: str, frames: int, pan: float, zoom: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The view centre's offset (x, + is right; y, + is down; world px) and the magnification,
    per frame."""
    u = np.linspace(0.0, 1.0, frames)
    dx, dy = np.zeros(frames), np.zeros(frames)
    z = np.ones(frames)
    if camera == "pan left":
        dx = -pan * u
    elif camera == "pan right":
        dx = pan * u
    elif camera == "tilt up":
        dy = -pan * u
    elif camera == "tilt down":
        dy = pan * u
    elif camera == "zoom in":
        z = zoom ** u
    return dx, dy, z


def _to_screen(world: np.ndarray, dx: np.ndarray, dy: np.ndarray, z: np.ndarray, side: int) -> np.ndarray:
    """World points (T, 2) to screen points (T, 2), with the view centred on
    (side/2 + dx, side/2 + dy)."""
    c = side / 2.0
    out = np.empty_like(world)
    out[:, 0] = (world[:, 0] - c - dx) * z + c
    out[:, 1] = (world[:, 1] - c - dy) * z + c
    return out


def _layout(spec: Spec, rng: np.random.Generator, frames: int, side: int) -> tuple[Layout, np.ndarray]:
    """Draw the per-seed numbers and a shape path that obeys the conventions."""
    r = lambda lo_hi: float(rng.uniform(*lo_hi))  # noqa: E731
    size = r(SHAPE_SIZE) * side
    travel = r(TRAVEL) * side if spec.motion != "stays still" else 0.0
    pan = r(PAN) * side * (-1.0 if spec.camera in ("pan left", "tilt up") else 1.0)
    zoom = r(ZOOM)
    dx, dy, z = view_path(spec.camera, frames, abs(pan), zoom)
    direction = np.array(_DIRECTION[spec.motion])
    u = np.linspace(0.0, 1.0, frames)[:, None]
    for attempt in range(400):
        if attempt and attempt % 100 == 0:  # a crowded case: make it a little smaller
            size *= 0.93
            travel = max(travel * 0.95, TRAVEL[0] * side * 0.95) if travel else 0.0
        half0 = size / 2 + MARGIN
        start = rng.uniform(half0, side - half0, size=2)
        # The start is chosen on screen at frame 0, where screen == world.
        world = start[None, :] + travel * direction[None, :] * u
        screen = _to_screen(world, dx, dy, z, side)
        half = size * z / 2 + MARGIN
        inside = np.all(screen - half[:, None] >= 0) and np.all(screen + half[:, None] <= side)
        if not inside:
            continue
        if travel:
            along = float((screen[-1] - screen[0]) @ direction)
            if along < MIN_SCREEN_TRAVEL * side:
                continue
        break
    else:  # pragma: no cover - the ranges leave plenty of room; this guards a future change
        raise RuntimeError(f"no layout fits {spec} at {side}px")
    jitter = rng.uniform(-COLOUR_JITTER, COLOUR_JITTER, 3)
    colour = np.clip(np.array(COLOUR_RGB[spec.colour], float) + jitter, 0, 255)
    nominal = np.array(BACKGROUND_RGB[spec.background], float)
    base = np.clip(nominal * (1.0 + rng.uniform(-BACKGROUND_JITTER, BACKGROUND_JITTER, 3)), 0, 255)
    layout = Layout(
        size=size, start=(float(start[0]), float(start[1])), travel=travel,
        pan=pan if spec.camera.startswith(("pan", "tilt")) else 0.0, zoom=zoom if spec.camera == "zoom in" else 1.0,
        texture=_texture_kind(spec, rng),
        period=r(PERIOD) * side / 64.0, amp=r(TEXTURE_AMP[spec.background]),
        colour=tuple(colour.tolist()), base=tuple(base.tolist()),
    )
    return layout, screen


def _texture_kind(spec: Spec, rng: np.random.Generator) -> str:
    # One draw either way, so a tilt's clip draws the same numbers after it as any other.
    k = int(rng.integers(len(TEXTURES)))
    if spec.camera in TILTS and TEXTURES[k] == "stripes":  # vertical stripes would hide a tilt
        return "checks"
    return TEXTURES[k]


def _texture_fn(layout: Layout, rng: np.random.Generator):
    """t(x, y) in [-1, 1] over world coordinates, for the layout's texture kind."""
    p = layout.period
    phx, phy = rng.uniform(0, 2 * np.pi, 2)

    def square(v: np.ndarray, phase: float) -> np.ndarray:  # a square wave with soft (anti-aliased) edges
        return np.clip(3.0 * np.sin(2 * np.pi * v / p + phase), -1.0, 1.0)

    if layout.texture == "checks":
        return lambda x, y: square(x, phx) * square(y, phy)
    if layout.texture == "stripes":
        return lambda x, y: square(x, phx)
    # noise: a sum of plane waves, every one with a clear horizontal component
    n = 6
    angles = rng.uniform(-np.pi / 3, np.pi / 3, n) + rng.integers(0, 2, n) * np.pi
    periods = rng.uniform(1.0, 1.5, n) * p
    phases = rng.uniform(0, 2 * np.pi, n)
    kx = 2 * np.pi * np.cos(angles) / periods
    ky = 2 * np.pi * np.sin(angles) / periods

    def noise(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        s = sum(np.sin(kx[i] * x + ky[i] * y + phases[i]) for i in range(n))
        return np.clip(s * (1.6 / math.sqrt(n)), -1.0, 1.0)

    return noise


def _shape_mask(shape: str, centre: np.ndarray, box: float, side: int) -> np.ndarray:
    """Coverage in [0, 1] of ``shape`` with box side ``box`` centred at ``centre`` (screen px)."""
    k = _SUPERSAMPLE
    big = np.zeros((side * k, side * k), np.uint8)
    shift = 4  # fixed-point bits for sub-pixel drawing
    cx, cy = centre * k
    h = box * k / 2
    if shape == "circle":
        cv2.circle(big, (round(cx * (1 << shift)), round(cy * (1 << shift))), round(h * (1 << shift)), 255, -1,
                   cv2.LINE_8, shift)
    else:
        if shape == "square":
            pts = [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
        else:  # an upright isosceles triangle filling the box
            pts = [(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
        poly = np.array([[round(x * (1 << shift)), round(y * (1 << shift))] for x, y in pts], np.int32)
        cv2.fillPoly(big, [poly], 255, cv2.LINE_8, shift)
    return cv2.resize(big, (side, side), interpolation=cv2.INTER_AREA).astype(np.float32) / 255.0


def render(spec: Spec, seed: int, frames: int = FRAMES, size: int = SIZE) -> Clip:
    """Render ``spec`` with the per-seed variation drawn from ``seed``; see :class:`Clip`."""
    if frames < 2 or size < 32:
        raise ValueError(f"frames={frames}, size={size}: need at least 2 frames and 32 px")
    rng = np.random.default_rng([seed, 0x5EA9E])
    layout, screen = _layout(spec, rng, frames, size)
    tex = _texture_fn(layout, rng)
    dx, dy, z = view_path(spec.camera, frames, abs(layout.pan), layout.zoom)
    c = size / 2.0
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    base = np.array(layout.base)
    colour = np.array(layout.colour)
    out = np.empty((frames, size, size, 3), np.uint8)
    alpha = np.empty((frames, size, size), np.float32)
    for t in range(frames):
        wx = (xs - c) / z[t] + c + dx[t]
        wy = (ys - c) / z[t] + c + dy[t]
        # area-average the texture over the pixel (2x2 samples) so edges do not alias
        o = 0.25 / z[t]
        tt = sum(tex(wx + a, wy + b) for a in (-o, o) for b in (-o, o)) / 4.0
        bg = base[None, None, :] * (1.0 + layout.amp * tt[..., None])
        a = _shape_mask(spec.shape, screen[t], layout.size * z[t], size)
        img = bg * (1.0 - a[..., None]) + colour[None, None, :] * a[..., None]
        out[t] = np.clip(np.rint(img), 0, 255).astype(np.uint8)
        alpha[t] = a
    return Clip(frames=out, alpha=alpha, centres=screen.astype(np.float32), layout=layout)


def render_clip(spec: Spec, seed: int, frames: int = FRAMES, size: int = SIZE) -> np.ndarray:
    """The clip's frames, (frames, size, size, 3) uint8 RGB."""
    return render(spec, seed, frames, size).frames
