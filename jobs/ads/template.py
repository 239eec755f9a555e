"""Ad templates: a TOML file that turns one spreadsheet row into a finished ad.

A template names the formats (aspect ratio, output size, how each is made from the footage, and
an ad platform's delivery settings), the shots (a prompt template filled from the row, a length,
a tier, the transition into it), text overlays, a logo, an end card and music. ``{column}``
placeholders in prompts, texts and file paths are filled from the row.

:func:`load` reads and checks the template itself (every problem is a :class:`TemplateError`
naming the file, the field, the value and what is allowed); ``jobs.ads.rows`` checks each row
against it. Nothing here renders.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from math import gcd
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from clipmill.jobs.core.preflight import NOTIFY_URL_RE, BadOption
from clipmill.pipeline.assemble import METHODS, PROFILES, Delivery
from clipmill.pipeline.choices import TIERS
from clipmill.pipeline.overlay import ANCHORS, parse_colour

MIN_FPS, MAX_FPS = 8, 60
LEVELS = ("3.0", "3.1", "3.2", "4.0", "4.1", "4.2", "5.0", "5.1")
# H.264's largest frame per level, in 16x16 macroblocks (ITU-T H.264 Table A-1, MaxFS)
LEVEL_MAX_BLOCKS = {"3.0": 1620, "3.1": 3600, "3.2": 5120, "4.0": 8192, "4.1": 8192, "4.2": 8704, "5.0": 22080,
                    "5.1": 36864}
TRANSITIONS = ("cut", "crossfade")
MAX_SHOT_SECONDS = 30.0
MIN_FILE_BYTES = 10_000  # max_size below this cannot hold an ad at any setting; 0 read as "no limit" before
_SIZE_RE = re.compile(r"^\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([kmg]?)b?\s*$", re.I)  # ASCII, as float() reads it
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([km]?)\s*$", re.I)


class TemplateError(BadOption):
    """A template that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Format:
    name: str
    width: int
    height: int
    method: str  # render | crop | pad
    pad_colour: tuple[int, int, int]
    delivery: Delivery

    @property
    def aspect(self) -> str:
        g = gcd(self.width, self.height)
        return f"{self.width // g}:{self.height // g}"


@dataclass(frozen=True)
class ShotSpec:
    prompt: str  # a template: {column} placeholders
    seconds: float
    tier: str | None
    transition: str  # into this shot
    crossfade: float
    negative_prompt: str = ""


@dataclass(frozen=True)
class TextSpec:
    name: str
    text: str  # a template
    anchor: str
    margin: tuple[float, float]  # in from the safe area, fractions of the frame (x, y)
    font: str  # a path template, relative to the template file
    size: float  # of the frame height
    min_size: float
    max_width: float  # of the box inside the safe area
    colour: tuple[int, int, int]
    outline: float  # of the frame height; 0: none
    outline_colour: tuple[int, int, int]
    shadow: float
    shadow_colour: tuple[int, int, int]
    start: float
    end: float
    fade: float


@dataclass(frozen=True)
class LogoSpec:
    file: str
    anchor: str
    margin: tuple[float, float]
    width: float  # of the frame width
    start: float
    end: float
    fade: float


@dataclass(frozen=True)
class EndCardSpec:
    seconds: float
    background: str  # "blur" or a colour
    texts: tuple[TextSpec, ...]


@dataclass(frozen=True)
class MusicSpec:
    file: str
    volume: float
    fade_out: float


@dataclass(frozen=True)
class AdTemplate:
    path: Path
    name: str
    fps: int
    safe_area: tuple[float, float]  # margins (x, y) as fractions of the frame
    formats: tuple[Format, ...]
    shots: tuple[ShotSpec, ...]
    texts: tuple[TextSpec, ...] = ()
    logo: LogoSpec | None = None
    end_card: EndCardSpec | None = None
    music: MusicSpec | None = None
    notify: str | None = None
    text: str = ""  # the TOML it was read from
    # files the template names (as written, placeholders filled) -> a local copy to read instead
    # (assembly's copies of the files a batch stored at submit)
    copies: dict[str, Path] = field(default_factory=dict, compare=False)

    @property
    def footage_seconds(self) -> float:
        """The shots' length on the timeline, crossfades overlapping."""
        return sum(s.seconds for s in self.shots) - sum(s.crossfade for s in self.shots[1:] if s.transition == "crossfade")

    @property
    def seconds(self) -> float:
        return self.footage_seconds + (self.end_card.seconds if self.end_card else 0.0)

    def placeholders(self) -> list[str]:
        """Every column the template fills, in order of first use."""
        names: list[str] = []
        for text in self._templated():
            for n in fields_of(text):
                if n not in names:
                    names.append(n)
        return names

    def _templated(self) -> list[str]:
        out = [s.prompt for s in self.shots] + [s.negative_prompt for s in self.shots]
        for t in (*self.texts, *(self.end_card.texts if self.end_card else ())):
            out += [t.text, t.font]
        if self.logo:
            out.append(self.logo.file)
        if self.music:
            out.append(self.music.file)
        return out

    def resolve(self, relative: str) -> Path:
        """A file path of the template (filled), relative to the template's folder; its local
        copy where one is given."""
        if relative in self.copies:
            return self.copies[relative]
        p = Path(relative).expanduser()
        return p if p.is_absolute() else self.path.parent / p


def fields_of(text: str) -> list[str]:
    """The ``{column}`` names in ``text``; ValueError for a malformed one."""
    names = []
    for _, name, spec, conv in string.Formatter().parse(text):
        if name is None:
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name or "") or spec or conv:
            raise ValueError(f"placeholder {{{name}}} must be a plain column name like {{merchant}}")
        names.append(name.lower())
    return names


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with its placeholders filled from ``values`` (lower-case column names)."""
    return string.Formatter().vformat(text, (), _Lower(values))


class _Lower(dict):
    def __getitem__(self, key):
        return super().__getitem__(key.lower())


# -- reading ------------------------------------------------------------------------------------


class _Reader:
    """Typed access to a TOML table, each problem naming ``file: field``."""

    def __init__(self, path: Path, table: dict, where: str = "", stored: bool = False):
        self.path, self.t, self.where, self.stored = path, table, where, stored

    def err(self, key: str, value, allowed: str) -> TemplateError:
        name = f"{self.where}{key}" if key else self.where.rstrip(".")
        shown = repr(value) if isinstance(value, str) else value
        return TemplateError(f"{self.path}: {name} = {shown}: {allowed}")

    def child(self, key: str, table: dict) -> _Reader:
        return _Reader(self.path, table, f"{self.where}{key}.", self.stored)

    def known(self, keys: tuple[str, ...]) -> None:
        for k in self.t:
            if k not in keys:
                raise TemplateError(f"{self.path}: {self.where}{k}: unknown setting; allowed: {', '.join(keys)}")

    def has(self, key: str) -> bool:
        return key in self.t

    def num(self, key: str, default=None, lo: float | None = None, hi: float | None = None, *, integer: bool = False,
            required: bool = False) -> float:
        if key not in self.t:
            if required or default is None:
                raise TemplateError(f"{self.path}: {self.where}{key} is missing"
                                    + (f"; give {'an integer' if integer else 'a number'}" if lo is None else
                                       f"; give {'an integer' if integer else 'a number'} from {lo:g} to {hi:g}"))
            return default
        v = self.t[key]
        ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)  # TOML has nan and inf
        if isinstance(v, bool) or not ok or (lo is not None and v < lo) or (hi is not None and v > hi):
            kind = "an integer" if integer else "a number"
            rng = f" from {lo:g} to {hi:g}" if lo is not None and hi is not None else (f" >= {lo:g}" if lo is not None else "")
            raise self.err(key, v, f"allowed: {kind}{rng}")
        return int(v) if integer else float(v)

    def text(self, key: str, default: str | None = None, choices: tuple[str, ...] | None = None) -> str:
        if key not in self.t:
            if default is None:
                raise TemplateError(f"{self.path}: {self.where}{key} is missing"
                                    + (f"; allowed: {', '.join(choices)}" if choices else "; give a text"))
            return default
        v = self.t[key]
        if not isinstance(v, str):
            raise self.err(key, v, "give a text" + (f"; allowed: {', '.join(choices)}" if choices else ""))
        if choices is not None and v not in choices:
            raise self.err(key, v, f"allowed: {', '.join(choices)}")
        if choices is None:
            try:
                fields_of(v)
            except ValueError as e:
                raise self.err(key, v, str(e)) from None
        return v

    def colour(self, key: str, default: str) -> tuple[int, int, int]:
        v = self.t.get(key, default)
        try:
            return parse_colour(v)
        except ValueError:
            raise self.err(key, v, "give a colour as #RRGGBB, for example #ffcc00") from None

    def pair(self, key: str, default: tuple[float, float], lo: float, hi: float) -> tuple[float, float]:
        v = self.t.get(key, list(default))
        if (not isinstance(v, list) or len(v) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and lo <= x <= hi for x in v)):
            raise self.err(key, v, f"allowed: two numbers [x, y], each from {lo:g} to {hi:g}")
        return float(v[0]), float(v[1])

    def tables(self, key: str) -> list[dict]:
        v = self.t.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
            raise self.err(key, v, f"write it as [[{self.where}{key}]] tables")
        return v

    def table(self, key: str) -> dict | None:
        v = self.t.get(key)
        if v is not None and not isinstance(v, dict):
            raise self.err(key, v, f"write it as a [{self.where}{key}] table")
        return v


def _bytes(r: _Reader, key: str) -> int | None:
    if not r.has(key):
        return None
    v = r.t[key]
    m = _SIZE_RE.match(str(v)) if isinstance(v, (str, int)) and not isinstance(v, bool) else None
    n = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]) if m else 0
    if not m or (n < MIN_FILE_BYTES and not r.stored):
        raise r.err(key, v, f"give a size such as '8MB', '500kB' or a number of bytes, at least {MIN_FILE_BYTES // 1000}kB")
    return n


def _kbps(r: _Reader, key: str, default: int | None, lo: int, hi: int) -> int | None:
    if not r.has(key):
        return default
    v = r.t[key]
    m = _RATE_RE.match(str(v)) if isinstance(v, (str, int)) and not isinstance(v, bool) else None
    kbps = None if not m else float(m.group(1)) * {"": 0.001, "k": 1, "m": 1000}[m.group(2).lower()]
    if kbps is None or not lo <= kbps <= hi:
        raise r.err(key, v, f"give a bitrate such as '128k' or '6M', from {lo}k to {hi // 1000}M")
    return int(kbps)


def _delivery(r: _Reader) -> Delivery:
    r.known(("profile", "level", "crf", "max_bitrate", "audio_bitrate", "max_size", "over_size", "preset"))
    return Delivery(
        profile=r.text("profile", "high", PROFILES),
        level=str(r.text("level", "4.0", LEVELS)),
        crf=r.num("crf", 20, 0, 51, integer=True),
        max_kbps=_kbps(r, "max_bitrate", None, 100, 100_000),
        audio_kbps=_kbps(r, "audio_bitrate", 128, 32, 512),
        max_bytes=_bytes(r, "max_size"),
        over_size=r.text("over_size", "reencode", ("reencode", "refuse")),
        preset=r.text("preset", "veryfast", ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium")),
    )


def _format(r: _Reader, i: int) -> Format:
    r.known(("name", "size", "method", "pad_colour", "delivery"))
    size = r.t.get("size")
    if (not isinstance(size, list) or len(size) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                and 64 <= x <= 3840 and x % 2 == 0 for x in size)):
        raise r.err("size", size, "allowed: [width, height], even integers from 64 to 3840")
    d = r.table("delivery")
    name = r.text("name", f"format{i + 1}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}", name):  # it names the ad's files: BATCH/ROW/NAME.mp4
        raise r.err("name", name, "allowed: 1-32 letters, digits, '.', '_' or '-', starting with a letter or digit")
    delivery = _delivery(r.child("delivery", d or {}))
    blocks = -(-size[0] // 16) * -(-size[1] // 16)
    if blocks > LEVEL_MAX_BLOCKS[delivery.level]:  # players may refuse a file labelled below its frame size
        fits = next((lv for lv in LEVELS if LEVEL_MAX_BLOCKS[lv] >= blocks), None)
        if fits is not None and "level" not in (d or {}):  # the default, 4.0: the lowest level above it that fits
            delivery = dataclasses.replace(delivery, level=fits)
        else:
            raise r.err("delivery.level", delivery.level, f"{size[0]}x{size[1]} is over H.264 level {delivery.level}'s "
                                                          f"frame size; allowed: {fits or 'none (too large)'} or above")
    return Format(name=name, width=size[0], height=size[1],
                  method=r.text("method", "render", METHODS), pad_colour=r.colour("pad_colour", "#000000"),
                  delivery=delivery)


def _text(r: _Reader, i: int, length: float, default_font: str | None) -> TextSpec:
    r.known(("name", "text", "anchor", "margin", "font", "size", "min_size", "max_width", "colour", "outline",
             "outline_colour", "shadow", "shadow_colour", "start", "end", "fade"))
    size = r.num("size", 0.05, 0.005, 0.5)
    start = r.num("start", 0.0, 0.0, length)
    end = r.num("end", length, 0.0, length)
    if end <= start:
        raise r.err("end", end, f"must be after start ({start:g} s), at most {length:g} s")
    font = r.text("font", default_font) if default_font is not None else r.text("font")
    return TextSpec(
        name=r.text("name", f"text{i + 1}"), text=r.text("text"), anchor=r.text("anchor", "center", ANCHORS),
        margin=r.pair("margin", (0.0, 0.0), 0.0, 0.45), font=font, size=size,
        min_size=r.num("min_size", size, 0.005, size), max_width=r.num("max_width", 1.0, 0.05, 1.0),
        colour=r.colour("colour", "#ffffff"), outline=r.num("outline", 0.0, 0.0, 0.05),
        outline_colour=r.colour("outline_colour", "#000000"), shadow=r.num("shadow", 0.0, 0.0, 0.05),
        shadow_colour=r.colour("shadow_colour", "#000000"), start=start, end=end,
        fade=r.num("fade", 0.0, 0.0, (end - start) / 2),
    )


def load(path: str | Path, stored: bool = False) -> AdTemplate:
    """Read and check an ad template. Files it names are checked per row (their paths may hold
    placeholders), not here. ``stored``: see ``loads``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # Windows editors write a byte-order mark
    except FileNotFoundError:
        raise TemplateError(f"--ad {path}: no such file") from None
    except IsADirectoryError:
        raise TemplateError(f"--ad {path}: is a folder; give the template's .toml file") from None
    except UnicodeDecodeError:
        raise TemplateError(f"--ad {path}: not valid UTF-8; save the template as UTF-8") from None
    return loads(text, path, stored)


def loads(text: str, path: str | Path, stored: bool = False) -> AdTemplate:
    """An ad template from its TOML ``text``; ``path`` names it in errors, and its folder is
    where the relative file paths it names are found. ``stored``: a batch's template as it was
    accepted at submit, read for its assembly: checks added since are not applied to it (a
    crossfade length on a cut is ignored, a max_size under 10 kB kept as it was read then), so
    a batch accepted once is never failed by a later rule."""
    path = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TemplateError(f"--ad {path}: not valid TOML ({e})") from None
    except ValueError:  # an integer of more than 4300 digits (Python's limit on reading one)
        raise TemplateError(f"--ad {path}: holds a number of more than 4300 digits; no setting takes one") from None
    r = _Reader(path, data, stored=stored)
    r.known(("name", "fps", "safe_area", "font", "formats", "shots", "texts", "logo", "end_card", "music", "notify"))
    fps = r.num("fps", 30, MIN_FPS, MAX_FPS, integer=True)
    safe_area = r.pair("safe_area", (0.05, 0.05), 0.0, 0.3)
    formats = tuple(_format(r.child(f"formats[{i}]", t), i) for i, t in enumerate(r.tables("formats")))
    if not formats:
        raise TemplateError(f"{path}: formats is missing; give at least one [[formats]] table with a size")
    names = [f.name for f in formats]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise TemplateError(f"{path}: formats: the name {dup[0]!r} is used twice; each format needs its own name")
    shots = []
    for i, t in enumerate(r.tables("shots")):
        s = r.child(f"shots[{i}]", t)
        s.known(("prompt", "negative_prompt", "seconds", "tier", "transition", "crossfade"))
        transition = s.text("transition", "cut", TRANSITIONS)
        seconds = s.num("seconds", None, 0.25, MAX_SHOT_SECONDS, required=True)
        if transition == "cut" and s.has("crossfade") and not s.stored:
            raise s.err("crossfade", s.t["crossfade"], "set only with transition = 'crossfade'; this shot cuts in "
                                                       "(transition = 'cut', the default)")
        crossfade = s.num("crossfade", 0.5, 0.04, seconds / 2) if transition == "crossfade" else 0.0
        if transition == "crossfade" and i == 0:
            raise s.err("transition", transition, "the first shot has no shot before it to fade from; use 'cut'")
        for key, v in (("seconds", seconds), ("crossfade", crossfade)):
            if abs(v * fps - round(v * fps)) > 1e-6:  # each is cut to whole frames: the ad came out short
                raise s.err(key, v, f"allowed: a whole number of frames at the template's {fps} fps "
                                    f"(a multiple of {1 / fps:.4g} s, such as {round(v * fps) / fps:g})")
        tier = s.text("tier", "", ("", *TIERS)) or None
        shots.append(ShotSpec(s.text("prompt"), seconds, tier, transition, crossfade, s.text("negative_prompt", "")))
    if not shots:
        raise TemplateError(f"{path}: shots is missing; give at least one [[shots]] table with a prompt and seconds")
    for i, (a, b) in enumerate(zip(shots, shots[1:]), 1):
        if b.crossfade > a.seconds / 2:
            raise TemplateError(f"{path}: shots[{i}].crossfade = {b.crossfade:g}: at most half of the shot before "
                                f"it ({a.seconds:g} s)")
    default_font = r.text("font", "") or None
    footage = sum(s.seconds for s in shots) - sum(s.crossfade for s in shots[1:])
    ec = r.table("end_card")
    end_card = None
    if ec is not None:
        e = r.child("end_card", ec)
        e.known(("seconds", "background", "texts"))
        secs = e.num("seconds", None, 0.5, 10.0, required=True)
        if abs(secs * fps - round(secs * fps)) > 1e-6:
            raise e.err("seconds", secs, f"allowed: a whole number of frames at the template's {fps} fps "
                                         f"(a multiple of {1 / fps:.4g} s, such as {round(secs * fps) / fps:g})")
        bg = e.text("background", "blur")
        if bg != "blur":
            try:
                parse_colour(bg)
            except ValueError:
                raise e.err("background", bg, "allowed: 'blur' (the last frame blurred) or a colour as #RRGGBB") from None
        end_card = EndCardSpec(secs, bg, tuple(_text(e.child(f"texts[{i}]", t), i, secs, default_font)
                                               for i, t in enumerate(e.tables("texts"))))
    total = footage + (end_card.seconds if end_card else 0.0)
    texts = tuple(_text(r.child(f"texts[{i}]", t), i, total, default_font) for i, t in enumerate(r.tables("texts")))
    all_names = [t.name for t in texts] + [t.name for t in (end_card.texts if end_card else ())]
    if dup := sorted({n for n in all_names if all_names.count(n) > 1}):
        raise TemplateError(f"{path}: texts: the name {dup[0]!r} is used twice; each text needs its own name")
    logo = None
    if (lt := r.table("logo")) is not None:
        lo = r.child("logo", lt)
        lo.known(("file", "anchor", "margin", "width", "start", "end", "fade"))
        start, end = lo.num("start", 0.0, 0.0, total), lo.num("end", total, 0.0, total)
        if end <= start:
            raise lo.err("end", end, f"must be after start ({start:g} s), at most {total:g} s")
        logo = LogoSpec(lo.text("file"), lo.text("anchor", "top-right", ANCHORS), lo.pair("margin", (0.0, 0.0), 0.0, 0.45),
                        lo.num("width", 0.15, 0.02, 0.9), start, end, lo.num("fade", 0.0, 0.0, (end - start) / 2))
    music = None
    if (mt := r.table("music")) is not None:
        m = r.child("music", mt)
        m.known(("file", "volume", "fade_out"))
        music = MusicSpec(m.text("file"), m.num("volume", 1.0, 0.0, 2.0), m.num("fade_out", 1.0, 0.0, total))
    notify = r.text("notify", "") or None
    if notify and not NOTIFY_URL_RE.match(notify):  # the same as --notify
        raise r.err("notify", notify, "give an http://HOST/... or https://HOST/... URL")
    return AdTemplate(path=path, name=r.text("name", path.stem), fps=fps, safe_area=safe_area, formats=formats,
                      shots=tuple(shots),
                      texts=texts, logo=logo, end_card=end_card, music=music, notify=notify, text=text)
