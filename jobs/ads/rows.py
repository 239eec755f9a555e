"""Rows of an ad batch: one spreadsheet row is one ad. Each row is checked against its template
before anything renders, and every problem names the file, the line, the field, the value and
what is allowed (as a prompt batch's rows are):

- a placeholder the row has no column (or an empty value) for;
- a shot prompt that the prompt cleaning or the model's tokenizer refuses (the prompt batch's
  own row checks, run on the filled prompt);
- a text with characters its font has no glyph for (named), or one that does not fit its box at
  the template's smallest size in some format;
- a font, logo or music file that is missing or unreadable.

:func:`read_ads` returns the checked ads and every problem; nothing here touches the database.
"""

from __future__ import annotations

import functools
import math
import re
import unicodedata
from dataclasses import dataclass, field, replace
from pathlib import Path

from clipmill.jobs.core.cleaning import normalize
from clipmill.jobs.core.prompts import (MAX_SEED, FileProblem, Problem, PromptRow, RowChecker, TokenCounter,
                                        derive_seed, read_id, read_records, read_seed)
from clipmill.pipeline import audio
from clipmill.pipeline.models import ModelInfo
from clipmill.pipeline.overlay import TextStyle, box, fit_px, missing_glyphs

from .template import AdTemplate, Format, TextSpec, fill

RESERVED = ("id", "seed")  # columns of an ad row that are not placeholders


@dataclass
class Shot:
    """One shot of one ad, as a render job: its prompt row, and the render size it is made at
    (``render_key``: the formats made from this footage)."""

    index: int
    row: PromptRow
    seconds: float
    transition: str
    crossfade: float
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # format name -> render size


@dataclass
class AdRow:
    line: int
    client_id: str | None
    values: dict[str, str]
    seed: int
    shots: list[Shot]
    texts: dict[str, str]  # text name -> filled text
    files: dict[str, str]  # 'font:<text>', 'logo', 'music' -> resolved path
    text_px: dict[str, dict[str, int]] = field(default_factory=dict)  # format -> text -> size it is drawn at


@dataclass
class AdBatch:
    path: str
    template: AdTemplate
    ads: list[AdRow] = field(default_factory=list)
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def render_sizes(tpl: AdTemplate, info: ModelInfo) -> dict[str, tuple[int, int]]:
    """The size each format's footage is rendered at: the model's default size for ``crop`` and
    ``pad``; for ``render``, a size of the format's shape that the model takes (the default's short
    side, the long side rounded to the model's size multiple and kept in its range)."""
    out = {}
    dw, dh = info.default_size
    m = info.size_multiple
    for f in tpl.formats:
        if f.method != "render":
            out[f.name] = (dw, dh)
            continue
        short = min(dw, dh)
        long_side = min(info.max_size, max(info.min_size, round(short * max(f.width, f.height) / min(f.width, f.height) / m) * m))
        out[f.name] = (short, long_side) if f.height >= f.width else (long_side, short)
    return out


def _all_texts(tpl: AdTemplate) -> list[TextSpec]:
    return [*tpl.texts, *(tpl.end_card.texts if tpl.end_card else ())]


def text_style(t: TextSpec, font: str, fmt: Format, size: float) -> TextStyle:
    """A text's style in a format, at ``size`` (a fraction of the frame height)."""
    px = max(1, round(size * fmt.height))
    k = px / max(t.size * fmt.height, 1)
    return TextStyle(font, px, t.colour, round(t.outline * fmt.height * k), t.outline_colour,
                     round(t.shadow * fmt.height * k), t.shadow_colour)


def fit_text(t: TextSpec, text: str, font: str, fmt: Format, safe: tuple[float, float]) -> int | None:
    """The pixel size ``text`` is drawn at in ``fmt`` (the template's size, shrunk to fit its box
    down to ``min_size``), or None when it does not fit even there."""
    bw, bh = box((fmt.height, fmt.width), t.margin, safe)
    style = text_style(t, font, fmt, t.size)
    return fit_px(text, style, max(1, round(t.min_size * fmt.height)), int(bw * t.max_width), bh)


def _check_file(path: Path, kind: str) -> str | None:
    """Why a template's file cannot be used, or None."""
    if not path.exists():
        return f"no such file ({path})"
    if path.is_dir():
        return f"is a folder ({path}); give a file"
    try:
        if kind == "logo":
            from PIL import Image

            with Image.open(path) as im:
                im.verify()
                if im.mode not in ("RGBA", "LA", "P") and "transparency" not in im.info:
                    return None  # an opaque logo is allowed; it is drawn as a rectangle
        elif kind == "font":
            from PIL import ImageFont

            ImageFont.truetype(str(path), size=12, index=0)
            missing_glyphs(path, "a")  # the glyph check reads the font's tables too (fontTools)
        elif kind == "music":  # read as the ad is built: damaged packets and NaN samples are refused here
            st = path.stat()
            return _music_problem(str(path), st.st_size, st.st_mtime_ns)
    except Exception as e:  # noqa: BLE001 - Pillow, FreeType and FFmpeg raise their own kinds
        return f"cannot be read as a {kind} file ({path}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


@functools.lru_cache(maxsize=64)
def _music_problem(path: str, size: int, mtime_ns: int) -> str | None:
    """Why a music file cannot be used, or None: read once per file as it is now (size and
    modification time), however many rows name it (a 3-minute track takes about 0.6 s)."""
    try:
        audio.load(path)
    except audio.AudioError as e:
        return f"{str(e).removeprefix(f'{path}: ')} ({path})"
    return None


def logo_width(tpl: AdTemplate, fmt: Format) -> int:
    """The logo's width in ``fmt``, in pixels: its template width, at most its box's."""
    bw, _ = box((fmt.height, fmt.width), tpl.logo.margin, tpl.safe_area)
    return max(2, min(round(tpl.logo.width * fmt.width), bw))


def _logo_fits(tpl: AdTemplate, path: Path) -> list[str]:
    """Why the logo, drawn at its width, would reach past its box in a format (a tall logo
    scaled by its width runs off the frame), one reason per format."""
    from PIL import Image

    with Image.open(path) as im:
        w, h = im.size
    out = []
    for fmt in tpl.formats:
        width = logo_width(tpl, fmt)
        height = max(1, round(h * width / w))
        _, bh = box((fmt.height, fmt.width), tpl.logo.margin, tpl.safe_area)
        if height > bh:
            out.append(f"is {w}x{h}; drawn {width} px wide in format {fmt.name} ({fmt.width}x{fmt.height}) it is "
                       f"{height} px tall, taller than the {bh} px the safe area and margins leave; lower logo.width "
                       "in the template, or use a wider logo")
    return out


def file_names(tpl: AdTemplate, values: dict[str, str]) -> list[tuple[str, str, str]]:
    """(key, name, kind) of each file an ad uses: its key in ``AdRow.files`` ('font:<text>',
    'logo', 'music'), the name the template gives it with the row's placeholders filled, and
    its kind ('font', 'logo', 'music')."""
    wanted = [(f"font:{t.name}", t.font, "font") for t in _all_texts(tpl)]
    if tpl.logo:
        wanted.append(("logo", tpl.logo.file, "logo"))
    if tpl.music:
        wanted.append(("music", tpl.music.file, "music"))
    return [(key, fill(template, values), kind) for key, template, kind in wanted]


def layout(tpl: AdTemplate, values: dict[str, str], path: str = "", line: int = 0, stored: bool = False
           ) -> tuple[dict[str, str], dict[str, str], dict[str, dict[str, int]], list[Problem]]:
    """An ad's texts (filled), its files (resolved and checked) and the size each text is drawn
    at in each format, with the problems found: what both the row check and the assembly need.
    ``stored``: an ad accepted at submit, laid out for its assembly: the logo's fit, a check
    added since some batches were accepted, is not applied again."""
    errs: list[Problem] = []
    P = lambda f, v, m: Problem(path, line, f, v, m)  # noqa: E731
    files: dict[str, str] = {}
    # files first: a text cannot be checked against a font that is not there
    for key, name, kind in file_names(tpl, values):
        p = tpl.resolve(name)
        if why := _check_file(p, kind):
            errs.append(P(key.replace("font:", "font of text "), str(p), why))
        files[key] = str(p)

    if tpl.logo and not stored and not any(e.field == "logo" for e in errs):
        errs += [P("logo", files["logo"], why) for why in _logo_fits(tpl, Path(files["logo"]))]

    texts: dict[str, str] = {}
    text_px: dict[str, dict[str, int]] = {f.name: {} for f in tpl.formats}
    for t in _all_texts(tpl):
        text = fill(t.text, values)
        texts[t.name] = text
        if f"font:{t.name}" not in files or any(e.field == f"font of text {t.name}" for e in errs):
            continue
        font = files[f"font:{t.name}"]
        if missing := missing_glyphs(font, text):
            chars = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in missing[:10])
            errs.append(P(f"text {t.name}", text, f"has characters its font {Path(font).name} has no glyph for: {chars}; "
                          "pick a font that covers them (for Chinese, for example WenQuanYi Micro Hei)"))
            continue
        for fmt in tpl.formats:
            px = fit_text(t, text, font, fmt, tpl.safe_area)
            if px is None:
                errs.append(P(f"text {t.name}", text, f"does not fit its box in format {fmt.name} ({fmt.width}x{fmt.height}) "
                              f"even at its min_size {t.min_size:g} ({round(t.min_size * fmt.height)} px); shorten it, "
                              "or lower min_size or the margins in the template"))
                break
            text_px[fmt.name][t.name] = px

    return texts, files, text_px, errs


def check_row(tpl: AdTemplate, checker: RowChecker, path: str, line: int, rec: dict) -> tuple[AdRow | None, list[Problem]]:
    """One row against its template: the ad, or its problems."""
    errs: list[Problem] = []
    P = lambda f, v, m: Problem(path, line, f, v, m)  # noqa: E731
    values = {k: normalize(str(v)) for k, v in rec.items()}
    placeholders = tpl.placeholders()
    for col in placeholders:
        if not values.get(col, "").strip():
            errs.append(P(col, rec.get(col, ""), f"is missing or empty; the template "
                          f"{tpl.path.name} fills {{{col}}} from it (its placeholders: {', '.join(placeholders)})"))
    client_id, why = read_id(rec)
    if why:
        errs.append(P("id", rec["id"], why))
    seed, why = read_seed(rec)
    if why:
        errs.append(P("seed", rec["seed"], why))
    if errs:
        return None, errs

    # the texts drawn on the ad keep the row's own characters: the prompt cleaning (full-width
    # punctuation folded, "™" to "TM", joiners and direction marks dropped) is for prompts only;
    # the ad keeps these values, and its assembly draws them
    shown = {k: shown_text(v) for k, v in rec.items()}
    texts, files, text_px, layout_errs = layout(tpl, shown, path, line)
    errs += layout_errs

    base_seed = seed if seed is not None else derive_seed("\n".join(fill(s.prompt, values) for s in tpl.shots), line)
    sizes = render_sizes(tpl, checker.info)
    shots: list[Shot] = []
    for i, spec in enumerate(tpl.shots):
        prompt = fill(spec.prompt, values)
        frames = _frames_for(spec.seconds, checker.info)
        shot_rec = {"prompt": prompt, "seed": (base_seed + 1_000_003 * i) % (MAX_SEED + 1), "frames": frames,
                    "fps": tpl.fps}
        if spec.tier:
            shot_rec["tier"] = spec.tier
        if spec.negative_prompt:
            shot_rec["negative_prompt"] = fill(spec.negative_prompt, values)
        row, shot_errs, _ = checker.check(line, shot_rec)
        for e in shot_errs:
            errs.append(Problem(path, line, f"shots[{i}].{e.field}" if e.field else f"shots[{i}]", e.value, e.message))
        if row is not None:
            shots.append(Shot(i, row, spec.seconds, spec.transition, spec.crossfade, dict(sizes)))
    if errs:
        return None, errs
    return AdRow(line, client_id, shown, base_seed, shots, texts, files, text_px), []


def shown_text(value) -> str:
    """A row's value as an ad draws it: Unicode NFC, control characters other than line breaks
    and tabs removed (format characters such as ZWNJ, ZWJ and direction marks kept: they change
    how a word is spelled or ordered), runs of spaces and tabs made one space, ends trimmed."""
    text = unicodedata.normalize("NFC", str(value))
    text = "".join(ch for ch in text if ch in "\n\t" or unicodedata.category(ch) != "Cc")
    return "\n".join(re.sub(r"[ \t]+", " ", part).strip() for part in text.split("\n")).strip()


def _frames_for(seconds: float, info: ModelInfo) -> int:
    """A shot's frame count at the model's native rate: as many as ``seconds`` needs, at least
    the model's minimum, and one more, so that frame-rate conversion to the ad's fps gives at
    least the shot's frames (a longer shot than the model renders at once is a long shot)."""
    return max(info.min_frames, math.ceil(seconds * info.native_fps - 1e-9) + 1)


def read_ads(path: str | Path, tpl: AdTemplate, info: ModelInfo, count_tokens: TokenCounter) -> AdBatch:
    """Read and check every row of an ad batch. Problems are collected, never raised."""
    path_s = str(path)
    out = AdBatch(path_s, tpl)
    checker = RowChecker(path_s, info, count_tokens)
    checker.info = _long_shots(info)
    try:
        columns, records, unreadable = read_records(path)
    except FileProblem as e:
        out.errors.append(e.problem)
        return out
    out.errors.extend(unreadable)
    known = set(tpl.placeholders()) | set(RESERVED)
    for c in columns:
        if c not in known:
            out.warnings.append(Problem(path_s, 1, None, None, f"column {c!r} is not used by the template {tpl.path.name} "
                                        f"(its placeholders: {', '.join(tpl.placeholders()) or 'none'})"))
    if not records and not unreadable:
        out.errors.append(Problem(path_s, 1, None, None, "no rows; expected at least one ad"))
        return out
    seen: dict[str, int] = {}
    for line, rec in records:
        ad, errs = check_row(tpl, checker, path_s, line, rec)
        out.errors.extend(errs)
        if ad is None:
            continue
        if ad.client_id is not None:
            if ad.client_id in seen:
                out.errors.append(Problem(path_s, line, "id", ad.client_id, f"repeats the id of line {seen[ad.client_id]}; ids must be unique in a batch"))
                continue
            seen[ad.client_id] = line
        out.ads.append(ad)
    out.errors.sort(key=lambda p: p.line)
    return out


def _long_shots(info: ModelInfo) -> ModelInfo:
    """``info`` for checking shot rows: a shot may be longer than the model renders at once (it
    is rendered over overlapping windows), so any frame count from the minimum up is taken."""
    return replace(info, max_frames=max(info.max_frames, 100_000))
