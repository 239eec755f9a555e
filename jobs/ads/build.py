"""Making one format of one ad from its shots' footage: the template's layers drawn for the
format, the timeline, the music, the encode with the format's delivery settings, and the
ad-level QC of what was written.

``footage`` is each shot's frames at the ad's fps, at the size the format's footage was rendered
at (``rows.render_sizes``). The output file appears complete or not at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clipmill.pipeline import assemble, audio, i420
from clipmill.pipeline.overlay import load_image, parse_colour, place, render_text, resize_layer
from clipmill.qc import ad as ad_qc

from .rows import AdRow, logo_width, text_style
from .template import AdTemplate, Format, TextSpec


@dataclass
class Built:
    """What making one format produced: the file's facts, the ad-level QC, and timings."""

    format: str
    path: Path
    width: int
    height: int
    frames: int
    seconds: float
    bytes: int
    reencoded: bool
    qc: ad_qc.AdQC
    boundaries: list[int]
    poster: np.ndarray  # the frame a third of the way in, as delivered
    timings: dict = field(default_factory=dict)


def _text_layer(t: TextSpec, text: str, font: str, px: int, fmt: Format, tpl: AdTemplate, offset: float
                ) -> tuple[assemble.Layer, TextSpec]:
    style = text_style(t, font, fmt, px / fmt.height)
    rgba = render_text(text, style)
    x, y = place(rgba.shape[:2], (fmt.height, fmt.width), t.anchor, t.margin, tpl.safe_area)
    return assemble.Layer(rgba, x, y, offset + t.start, offset + t.end, t.fade, t.name), t


def layers(tpl: AdTemplate, ad: AdRow, fmt: Format) -> tuple[list[assemble.Layer], dict[str, TextSpec]]:
    """Every layer of ``ad`` in ``fmt``: texts at the sizes its row check fitted them to, the
    logo, and the end card's texts (their times moved to the end card's start)."""
    out, specs = [], {}
    for t in tpl.texts:
        layer, specs[t.name] = _text_layer(t, ad.texts[t.name], ad.files[f"font:{t.name}"], ad.text_px[fmt.name][t.name],
                                           fmt, tpl, 0.0)
        out.append(layer)
    if tpl.end_card:
        for t in tpl.end_card.texts:
            layer, specs[t.name] = _text_layer(t, ad.texts[t.name], ad.files[f"font:{t.name}"],
                                               ad.text_px[fmt.name][t.name], fmt, tpl, tpl.footage_seconds)
            out.append(layer)
    if tpl.logo:
        lg = tpl.logo
        rgba = resize_layer(load_image(ad.files["logo"]), logo_width(tpl, fmt))
        x, y = place(rgba.shape[:2], (fmt.height, fmt.width), lg.anchor, lg.margin, tpl.safe_area)
        out.append(assemble.Layer(rgba, x, y, lg.start, lg.end, lg.fade, "logo"))
    return out, specs


def timeline(tpl: AdTemplate, ad: AdRow, fmt: Format, footage: dict[int, np.ndarray]) -> tuple[assemble.Timeline, dict]:
    shots = []
    for shot in ad.shots:
        frames = footage[shot.index]
        want = round(shot.seconds * tpl.fps)
        if len(frames) < want:
            raise ValueError(f"shot {shot.index}: {len(frames)} frames of footage at {tpl.fps} fps, the template "
                             f"needs {want} ({shot.seconds:g} s)")
        shots.append(assemble.Shot(frames[:want], shot.crossfade if shot.transition == "crossfade" else 0.0))
    end = None
    if tpl.end_card:
        bg = tpl.end_card.background
        end = (assemble.EndCard(tpl.end_card.seconds, None, 0.02) if bg == "blur"
               else assemble.EndCard(tpl.end_card.seconds, parse_colour(bg)))
    lays, specs = layers(tpl, ad, fmt)
    return assemble.Timeline(shots, tpl.fps, end, lays), specs


def make_format(tpl: AdTemplate, ad: AdRow, fmt: Format, footage: dict[int, np.ndarray], dest: Path,
                qc_side: int = 320) -> Built:
    """Write ``dest`` (an MP4) for ``ad`` in ``fmt`` and check it. Raises
    ``assemble.DeliveryError`` when the file cannot meet its delivery settings."""

    t0, c0 = time.perf_counter(), time.process_time()  # wall, and CPU of every thread (x264's too)
    tl, specs = timeline(tpl, ad, fmt, footage)
    size = (fmt.width, fmt.height)
    pcm = None
    if tpl.music:
        pcm = audio.fit(audio.load(ad.files["music"]), tl.seconds, tpl.music.volume, tpl.music.fade_out)
    # the footage under each text, read as the frames are made (before the layers are drawn)
    texts = {lay.name: lay for lay in tl.layers if lay.name in specs}
    under: dict[str, list[np.ndarray]] = {n: [] for n in texts}
    small: list[np.ndarray] = []
    k = qc_side / max(size)
    small_size = (max(2, round(size[0] * k)), max(2, round(size[1] * k)))

    def observe(i: int, frame: np.ndarray) -> None:
        t = i / tl.fps
        for name, lay in texts.items():
            if lay.opacity(t) > 0 and i % 5 == 0:
                h, w = lay.rgba.shape[:2]
                under[name].append(i420.region_rgb(frame, (lay.x, lay.y, w, h), step=3))

    passes = [0]
    poster: list[np.ndarray] = []

    def source():  # the first pass also reads what QC needs; a second (to fit max_size) only encodes
        passes[0] += 1
        if passes[0] > 1:
            yield from assemble.frames(tl, size, fmt.method, fmt.pad_colour)
            return
        for frame in assemble.frames(tl, size, fmt.method, fmt.pad_colour, observe=observe):
            small.append(i420.small_rgb(frame, small_size))
            if len(small) == len(tl) // 3 + 1:
                poster.append(i420.to_rgb(frame))
            yield frame

    t1 = time.perf_counter()
    made = assemble.encode(source, len(tl), tl.fps, size, dest, fmt.delivery, pcm)
    t2, c2 = time.perf_counter(), time.process_time()
    info = assemble.probe_av(dest)
    checks = [ad_qc.TextCheck(n, (lay.x, lay.y, lay.rgba.shape[1], lay.rgba.shape[0]), specs[n].colour,
                              specs[n].outline_colour if specs[n].outline else (specs[n].shadow_colour if specs[n].shadow else None),
                              np.concatenate(under[n]) if under[n] else np.zeros((0, 3), np.uint8))
              for n, lay in texts.items()]
    boxes = {(f"text {lay.name}" if lay.name in specs else lay.name): (lay.x, lay.y, lay.rgba.shape[1], lay.rgba.shape[0])
             for lay in tl.layers}
    sx, sy = round(fmt.width * tpl.safe_area[0]), round(fmt.height * tpl.safe_area[1])
    safe = (sx, sy, fmt.width - 2 * sx, fmt.height - 2 * sy)
    cut_at = [b for b, kind in tl.boundaries() if kind == "cut"]
    # the file as written is what is checked: its frame count, its audio
    frames_small = np.stack(small[:info["frames"]]) if small else np.zeros((0, 2, 2, 3), np.uint8)
    result = ad_qc.check(frames_small, tl.fps, tpl.seconds, cut_at, checks, boxes, safe, info.get("_pcm"),
                         audio.RATE)
    if info["frames"] != len(tl):
        result.reasons.insert(0, f"frames: the file holds {info['frames']} frames, the timeline {len(tl)}")
        result.verdict = "reject"
    t3, c3 = time.perf_counter(), time.process_time()
    return Built(fmt.name, Path(dest), info["width"], info["height"], info["frames"], info["seconds"], made["bytes"],
                 made["reencoded"], result, cut_at, poster[0] if poster else small[0],
                 {"layers_s": t1 - t0, "encode_s": t2 - t1, "qc_s": t3 - t2, "assembly_cpu_s": c2 - c0,
                  "qc_cpu_s": c3 - c2})
