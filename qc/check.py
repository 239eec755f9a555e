"""QC verdicts: pass or reject, with one reason per defect naming its frames and metric value.

Every threshold is a field of ``QCConfig``, with its default documented beside it. Luma,
differences and residuals are on a 0..255 scale and measured on the working copy (long side
``max_side``); flow is in working-copy pixels per frame.
"""

from __future__ import annotations

import dataclasses
import math
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import cv2
import numpy as np

from clipmill.qc.metrics import Series, measure, runs, working_size

MIN_SIDE = 32  # px: the smallest side of QC's working copy (DIS optical flow crashes on 320x24)


MAX_SECONDS = 3600.0  # the longest span a *_seconds setting takes: an hour, far longer than any clip QC can hold
# Settings with a bound beyond which QC cannot run them: (lowest, highest, what the value is).
# The others take any finite number of 0 or more (an SSIM limit: any finite number); a limit past
# what its value can reach turns its check off (1e9: how tests let the tiny model's noise through).
_SECONDS = "seconds (QC holds a whole clip in memory: a clip it checks is seconds long)"
RANGES: dict[str, tuple[float, float, str]] = {
    "boiling_area": (0, 1, "a share of the frame (0.015 = 1.5%)"),  # a quantile of the frame's windows
    "block_seconds": (0, MAX_SECONDS, _SECONDS),  # counted in frames: 1e308 s overflowed
    "frozen_seconds": (0, MAX_SECONDS, _SECONDS),
    "boiling_seconds": (0, MAX_SECONDS, _SECONDS),
}


@dataclass(frozen=True)
class QCConfig:
    max_side: int = 320  # long side of the working copy
    # black / uniform frames and flat clips
    black_luma: float = 12.0  # a frame darker than this on average ...
    black_spread: float = 10.0  # ... and with less luma spread than this is black
    uniform_spread: float = 3.0  # a frame with less luma spread than this is uniform (flat)
    # garbage frames, cuts and general instability (motion-compensated)
    spike_factor: float = 6.0  # a pair's residual this many times the clip's median is a spike ...
    spike_min: float = 12.0  # ... and at least this large
    min_pair_ssim: float = 0.5  # any compensated pair below this is broken
    # block corruption: a grid cell whose residual jumps above its own temporal context
    block_jump: float = 1.8  # (region - context) / (context + block_floor) above this, at onset and at end
    block_floor: float = 2.0
    block_min: float = 5.0  # and the region's residual itself at least this
    block_seconds: float = 1.0  # damage lasting up to this long is paired (onset, then end)
    block_concentration: float = 4.0  # a spike whose worst region is this many times the frame's is local
    # flicker: mean luma alternating up and down
    flicker_luma: float = 2.5  # swings larger than this ...
    flicker_pairs: int = 3  # ... alternating at least this many times in a row
    # frozen stretches inside a moving clip
    moving_flow: float = 0.2  # the clip moves if its 75th-percentile flow is above this
    frozen_diff: float = 0.1  # a pair this close is a duplicate frame (mean |difference|, luma) ...
    frozen_change: float = 3.0  # ... unless some cell changed more than this (a small slow object at 60 fps);
    # a clip whose flow reads still moves when half its pairs change a cell this much
    frozen_flow_ratio: float = 0.1  # ... as is one whose flow is below this share of that percentile
    frozen_seconds: float = 0.2  # a frozen stretch at least this long is a defect
    # progressive over-exposure or colour blow-out: the same content (motion-compensated) gets
    # brighter or more saturated over the clip
    exposure_luma: float = 20.0  # summed compensated luma rise above this ...
    exposure_clip: float = 0.03  # ... with the clipped-pixel fraction growing by this (first vs last quarter)
    exposure_saturation: float = 0.10  # or summed compensated saturation rise (0..1) above this
    # boiling texture: texture re-rolls every frame, so compensation cannot explain it
    boiling_ssim: float = 0.72  # strong boiling: median compensated SSIM below this ...
    boiling_hp: float = 0.7  # ... with a high-frequency residual ratio above this
    # faint boiling (a few luma levels above the grain, over a region or on a moving object only):
    # fine texture 1-3 px across in the compensated residual, above the noise floor the clip's own
    # grain sets (see metrics.boiling_map). Sensor and film grain is white, so it stays under it.
    boiling_excess: float = 1.5  # luma^2 of band-pass residual above the floor (texture re-rolling by about 1.5 luma std) ...
    boiling_area: float = 0.015  # ... over at least this share of the frame (a small moving object) ...
    # ... in the median sampled frame, compared with the frames this long before and after: 3 frames
    # at 24 fps, so an 8 fps render interpolated to 24 fps shows its whole re-roll, not a third of it
    boiling_seconds: float = 0.125
    # collapse into blur or smear
    blur_ratio: float = 0.6  # sharpness of the same content, last quarter / first quarter, below this
    # anything else: a clip that compensation cannot explain at all
    min_median_ssim: float = 0.6
    # a line along the frame's edges (a decoder's zero padding, amplified: latents decoded at the
    # wrong VAE scale): the outermost line standing this many levels apart from the picture inside
    # it (metrics.frame_border_line, median over the frames) ...
    border_line: float = 6.0
    border_sides: int = 3  # ... along at least this many of the frame's 4 sides

    def __post_init__(self):
        for f in fields(self):  # a NaN limit compares false with everything: its check would never fire
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{f.name} = {v!r}: allowed a finite number")
            if isinstance(v, float) and not math.isfinite(v):  # an int is finite (and may be too large for a float)
                raise ValueError(f"{f.name} = {v!r}: allowed a finite number")
            if f.name in RANGES:
                lo, hi, what = RANGES[f.name]
                if not lo <= v <= hi:
                    raise ValueError(f"{f.name} = {v!r}: allowed {lo:g} to {hi:g}, {what}")
            elif "ssim" in f.name:  # an SSIM runs from -1 to 1: any limit (below -1 its check never
                pass  # fires, above 1 it always does: how tests reject every clip)
            elif v < 0:
                raise ValueError(f"{f.name} = {v!r}: allowed a finite number of 0 or more")
        if not 1 <= self.border_sides <= 4:
            raise ValueError(f"border_sides = {self.border_sides}: allowed 1-4 (a frame has 4 sides)")
        if self.max_side < MIN_SIDE:
            raise ValueError(f"max_side = {self.max_side}: allowed {MIN_SIDE} px or more (QC's smallest working size)")

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, str] | None = None,
             name: str = "--qc-config") -> QCConfig:
        """Defaults, then a TOML file (top-level keys and a [qc] table), then ``overrides`` (the
        text of ``--set KEY=VALUE``). ``name`` is where ``path`` came from (an option or a
        variable), for the error message; each error names the file or ``--set``."""
        if path is not None:
            where = f"{name} {str(path)!r}"
            try:
                data = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))  # a byte-order mark too
            except FileNotFoundError:
                raise ValueError(f"{where}: no such file")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text")
            except OSError as e:
                raise ValueError(f"{where}: cannot be read ({e.strerror or e})")
            except tomllib.TOMLDecodeError as e:
                raise ValueError(f"{where}: not valid TOML ({e})")
            except ValueError:  # an integer of more than 4300 digits (Python's limit on reading one)
                raise ValueError(f"{where}: holds a number of more than 4300 digits; no setting takes one")
            table = data.pop("qc", {})
            if not isinstance(table, dict):
                raise ValueError(f"{where}: qc = {table!r}; give [qc] as a table of QC settings")
            both = sorted(set(data) & set(table))
            if both:
                raise ValueError(f"{where}: {both[0]} is set both at the top and in [qc]; set it once")
            cfg = cls.from_dict({**data, **table}, where)
        else:
            cfg = cls()
        typed = cls._typed(overrides or {}, "--set", from_text=True)
        try:
            return dataclasses.replace(cfg, **typed)
        except ValueError as e:  # a value outside what a setting allows (__post_init__)
            raise ValueError(f"--set: {e}") from None

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> QCConfig:
        typed = cls._typed(values, source, from_text=False)
        try:
            return dataclasses.replace(cls(), **typed)
        except ValueError as e:  # a value outside what a setting allows (__post_init__)
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def _typed(cls, values: dict, source: str, from_text: bool) -> dict:
        """``values`` checked against the settings' names and types: TOML values as TOML typed
        them (an integer setting takes an integer, a number setting an integer or a float; no
        booleans or strings), ``--set`` values parsed from their text."""
        known = {f.name: f for f in fields(cls)}
        out = {}
        for k, v in values.items():
            if k not in known:
                raise ValueError(f"{source}: unknown QC setting {k!r}; known: {', '.join(known)}")
            typ = int if known[k].type in ("int", int) else float
            what = "an integer" if typ is int else "a number"
            if from_text:
                try:
                    out[k] = typ(str(v))
                except ValueError:
                    raise ValueError(f"{source}: {k} = {v!r} is not {what}") from None
            elif isinstance(v, bool) or not isinstance(v, (int, float) if typ is float else int):
                raise ValueError(f"{source}: {k} = {v!r} is not {what}")
            else:
                out[k] = typ(v)
        return out


@dataclass
class QCResult:
    verdict: str  # "pass" | "reject"
    reasons: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _ranges(items: list[tuple[int, int]], limit: int = 4) -> str:
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in items[:limit]]
    return ", ".join(parts) + (" ..." if len(items) > limit else "")


def _quarters(x: np.ndarray) -> tuple[float, float]:
    k = max(1, len(x) // 4)
    return float(np.mean(x[:k])), float(np.mean(x[-k:]))


def pool2(cells: np.ndarray) -> np.ndarray:
    """Mean over each 2x2 window of grid cells: a damaged region rarely sits inside one cell."""
    return (cells[:, :-1, :-1] + cells[:, 1:, :-1] + cells[:, :-1, 1:] + cells[:, 1:, 1:]) / 4


def block_events(cells: np.ndarray, floor: float, jump: float, min_value: float, max_pairs: int) -> list[tuple]:
    """Regions whose residual jumps up at once (onset) and falls back at once (end) within
    ``max_pairs``: damage that appears and disappears in place. A flow failure on a fast pan
    makes a lone jump; it is not paired.

    A region's context for the onset is the larger of its two previous pairs, for the end the
    larger of its two next pairs; a jump is (value - context) / (context + floor).
    Returns (first pair, last pair, value, jump) per event.
    """
    m = len(cells)
    if m < 2:
        return []
    flat = cells.reshape(m, -1).astype(np.float64)  # float64: any finite jump limit compares without overflow
    pad = np.concatenate([flat[:1], flat[:1], flat, flat[-1:], flat[-1:]])
    past = np.maximum(pad[:m], pad[1 : m + 1])
    future = np.maximum(pad[3 : m + 3], pad[4 : m + 4])
    with np.errstate(divide="ignore", invalid="ignore"):  # floor 0 on a still region: a jump from 0 is infinite
        onset = (flat - past) / (past + floor)
        end = (flat - future) / (future + floor)
    on = (onset > jump) & (flat > min_value)
    off = (end > jump) & (flat > min_value)
    events = []
    for c in np.flatnonzero(on.any(axis=0) & off.any(axis=0)):
        ons, offs = np.flatnonzero(on[:, c]), np.flatnonzero(off[:, c])
        for i in ons:
            # a damaged frame touches two pairs (into it, out of it): the end is a later pair
            later = offs[(offs > i) & (offs <= i + max_pairs)]
            if len(later):
                events.append((int(i), int(later[0]), float(flat[i, c]), float(onset[i, c])))
    return events


def _num(value: float, op: str, limit: float, digits: int, pct: bool = False, fixed_limit: bool = False,
         sign: str = "") -> tuple[str, str]:
    """``value`` and ``limit`` as text, with as many decimals (from ``digits`` up) as make the
    shown numbers compare the way the real ones do: never '0.72 < 0.72'. A configured limit is
    shown as given (``:g``); a computed one (``fixed_limit``) with the same decimals as the value."""
    value, limit = float(value), float(limit)
    scale = 100.0 if pct else 1.0
    holds = (lambda a, b: a < b) if op == "<" else (lambda a, b: a > b)
    for d in range(digits, digits + 8):
        v = f"{value * scale:{sign}.{d}f}"
        lim = f"{limit * scale:.{d}f}" if fixed_limit else f"{limit * scale:g}"
        if holds(float(v), float(lim)):
            break
    else:  # the numbers do not compare that way at all: show them at the usual precision
        v = f"{value * scale:{sign}.{digits}f}"
        lim = f"{limit * scale:.{digits}f}" if fixed_limit else f"{limit * scale:g}"
    unit = "%" if pct else ""
    return v + unit, lim + unit


def _cmp(value: float, op: str, limit: float, digits: int, **kw) -> str:
    """'value < limit' (or '>'), shown so that the comparison reads true (see _num)."""
    v, lim = _num(value, op, limit, digits, **kw)
    return f"{v} {op} {lim}"


def spike_mask(s: Series, cfg: QCConfig, flat_frames: np.ndarray | None = None) -> np.ndarray:
    """Pairs (frame i, i+1) whose motion-compensated residual spikes above the clip's median (or
    whose compensated SSIM falls below ``min_pair_ssim``): a cut where one pair stands alone,
    garbage frames where they run on. Pairs touching a black or flat frame (``flat_frames``) are
    left out, as already explained, and a clip bad in most pairs has no spikes (it is unstable
    or boiling throughout, not cut)."""
    med = float(np.median(s.residual))
    spike = (s.residual > max(cfg.spike_min, cfg.spike_factor * med)) | (s.ssim < cfg.min_pair_ssim)
    if flat_frames is not None:
        spike &= ~(flat_frames[:-1] | flat_frames[1:])
    if spike.mean() > 0.5:
        spike[:] = False
    return spike


def border_by_side(s: Series) -> np.ndarray:
    """The 4 sides' border line (the median over the frames, the largest colour channel), levels,
    strongest first."""
    return np.sort(np.median(s.border_line, axis=0).max(axis=-1))[::-1]


def verdict(s: Series, fps: float, cfg: QCConfig = QCConfig()) -> QCResult:
    reasons: list[str] = []
    n = len(s.luma)
    fps = fps if fps and fps > 0 else 24.0

    # 1. black and uniform frames; a clip that is flat throughout
    black = (s.luma < cfg.black_luma) & (s.spread < cfg.black_spread)
    uniform = (s.spread < cfg.uniform_spread) & ~black
    if black.all() or uniform.all() or (black | uniform).all():
        if black.all():
            why = f"black throughout: mean luma at most {_cmp(s.luma.max(), '<', cfg.black_luma, 1)}"
        elif uniform.all():
            why = f"luma spread at most {_cmp(s.spread.max(), '<', cfg.uniform_spread, 2)}"
        else:
            why = f"black or uniform throughout: mean luma up to {s.luma.max():.1f}, luma spread up to {s.spread.max():.2f}"
        reasons.append(f"flat: frames 0-{n - 1} ({why})")
    else:
        if black.any():
            reasons.append(
                f"black: frames {_ranges(runs(black))} (mean luma {_cmp(s.luma[black].min(), '<', cfg.black_luma, 1)})"
            )
        if uniform.any():
            reasons.append(
                f"uniform: frames {_ranges(runs(uniform))} (luma spread "
                f"{_cmp(s.spread[uniform].min(), '<', cfg.uniform_spread, 2)})"
            )
    if n < 2:
        return _result(reasons, s, fps)
    flat_frames = black | uniform

    # 2. residual spikes: garbage frames (bad on both sides) or a cut (one bad pair)
    med = float(np.median(s.residual))
    spike = spike_mask(s, cfg, flat_frames)
    pooled = pool2(s.cells)
    concentrated = pooled.reshape(len(pooled), -1).max(axis=1) > cfg.block_concentration * (s.residual + 1.0)
    limit = max(cfg.spike_min, cfg.spike_factor * med)
    found: dict[str, list[tuple[int, int]]] = {"block": [], "jump": [], "garbage": []}
    for a, b in runs(spike):
        if concentrated[a : b + 1].all():
            found["block"].append((a, b + 1))
        elif a == b and 0 < a < n - 2:
            found["jump"].append((a, a + 1))  # one bad pair between two good stretches: a cut
        else:
            found["garbage"].append((a + 1, b) if b > a else (a, a + 1))
    why = {  # which test made each kind of spike, with its worst value
        k: (f"compensated residual up to {_cmp(max(s.residual[x:y].max() for x, y in v), '>', limit, 1, fixed_limit=True)}"
            if max(s.residual[x:y].max() for x, y in v) > limit
            else f"compensated SSIM down to {_cmp(min(s.ssim[x:y].min() for x, y in v), '<', cfg.min_pair_ssim, 2)}")
        for k, v in ((k, [(x, max(y, x + 1)) for x, y in v]) for k, v in found.items()) if v
    }
    if found["block"]:
        i = max(range(len(pooled)), key=lambda j: pooled[j].max() if spike[j] else -1)
        reasons.append(
            f"block: frames {_ranges(found['block'])} (one region's compensated residual {pooled[i].max():.1f} "
            f"against {s.residual[i]:.1f} for the whole frame)"
        )
    if found["jump"]:
        reasons.append(f"jump: frames {_ranges(found['jump'])} ({why['jump']}): a cut or scene change")
    if found["garbage"]:
        reasons.append(f"garbage: frames {_ranges(found['garbage'])} ({why['garbage']})")

    # 3. block corruption: a region's residual jumps at once above its own recent past (onset)
    #    or its near future (end), while the frame as a whole stays explained
    if not spike.any():
        events = block_events(pool2(s.cells), cfg.block_floor, cfg.block_jump, cfg.block_min,
                              max(2, int(round(cfg.block_seconds * fps))))
        events = [e for e in events if not flat_frames[e[0] : e[1] + 2].any()]
        if events:
            worst = max(events, key=lambda e: e[3])
            spans = sorted({(e[0] + 1, max(e[0] + 1, e[1])) for e in events})
            reasons.append(
                f"block: frames {_ranges(spans)} (a region's compensated residual jumps to {worst[2]:.1f}, "
                f"{_num(worst[3] + 1, '>', cfg.block_jump + 1, 1)[0]}x its level in the frames around > {cfg.block_jump + 1:g}x, "
                f"then drops back)"
            )

    # 4. flicker: mean luma alternating up and down
    d = np.diff(s.luma)
    big = np.abs(d) > cfg.flicker_luma
    alt = big[1:] & big[:-1] & (np.sign(d[1:]) != np.sign(d[:-1]))
    flick = [(a, b + 2) for a, b in runs(alt) if b - a + 1 >= cfg.flicker_pairs]
    if flick:
        reasons.append(
            f"flicker: frames {_ranges(flick)} (mean luma swings up to "
            f"{_cmp(np.abs(d).max(), '>', cfg.flicker_luma, 1)}, alternating)"
        )

    # 5. frozen stretch inside a moving clip. A clip moves when its flow says so, or when half its
    # pairs change some cell by frozen_change or more (an object the luma flow does not follow:
    # small, slow, about its background's luma); in the second case only duplicates count
    med_flow = float(np.percentile(s.flow, 75))
    med_change = float(np.median(s.change)) if len(s.change) else 0.0
    duplicate = (s.diff < cfg.frozen_diff) & (s.change < cfg.frozen_change)
    still = None
    if med_flow > cfg.moving_flow:
        still = duplicate | (s.flow < cfg.frozen_flow_ratio * med_flow)
        moving = f"in a clip moving {med_flow:.2f} px/frame"
    elif med_change >= cfg.frozen_change:
        still = duplicate
        moving = f"in a clip whose frames change by {med_change:.1f} in places, moving {med_flow:.2f} px/frame"
    if still is not None:
        still &= ~(flat_frames[:-1] | flat_frames[1:])
        min_pairs = max(2, int(round(cfg.frozen_seconds * fps)))
        frozen = [(a, b + 1) for a, b in runs(still) if b - a + 1 >= min_pairs]
        if frozen:
            longest = max(b - a + 1 for a, b in frozen)
            reasons.append(f"frozen: frames {_ranges(frozen)} ({longest} frames, {longest / fps:.2f} s, {moving})")

    # 6. progressive over-exposure or colour blow-out
    c0, c1 = _quarters(s.clipped)
    ok = ~spike  # drift across a cut or garbage frame means nothing
    lum_up = float(s.luma_drift[ok].sum())
    sat_up = float(s.sat_drift[ok].sum())
    if (lum_up > cfg.exposure_luma and c1 - c0 > cfg.exposure_clip) or sat_up > cfg.exposure_saturation:
        reasons.append(
            f"exposure: frames 0-{n - 1} (the same content gains {lum_up:+.0f} luma and {sat_up:+.2f} saturation; "
            f"clipped pixels {c0:.0%} -> {c1:.0%}; limits +{cfg.exposure_luma:g} luma with clipping, "
            f"+{cfg.exposure_saturation:g} saturation)"
        )

    # 7. boiling texture
    ssim_med = float(np.median(s.ssim))
    hp_med = float(np.median(s.hp_ratio))
    boil_med = float(np.median(s.boil)) if len(s.boil) else 0.0
    if ssim_med < cfg.boiling_ssim and hp_med > cfg.boiling_hp and not flick:
        reasons.append(
            f"boiling: frames 0-{n - 1} (median compensated SSIM {_cmp(ssim_med, '<', cfg.boiling_ssim, 2)}, "
            f"texture residual ratio {_cmp(hp_med, '>', cfg.boiling_hp, 2)})"
        )
    elif boil_med > cfg.boiling_excess and not flick:
        reasons.append(
            f"boiling: frames 0-{n - 1} (fine texture re-rolls over {cfg.boiling_area:.1%} of the frame or more: "
            f"band-pass residual {_cmp(boil_med, '>', cfg.boiling_excess, 1)} above the clip's noise floor)"
        )
    elif ssim_med < cfg.min_median_ssim and not flick:
        reasons.append(f"unstable: frames 0-{n - 1} (median compensated SSIM {_cmp(ssim_med, '<', cfg.min_median_ssim, 2)})")

    # 8. a line along the frame's edges, in the same place in every frame
    per_side = border_by_side(s)
    k = cfg.border_sides
    if float(per_side[k - 1]) > cfg.border_line:
        reasons.append(
            f"border: frames 0-{n - 1} (a line along {k} of the frame's 4 sides stands apart from the picture "
            f"inside it by {_cmp(per_side[k - 1], '>', cfg.border_line, 1)} levels: a decoder's edge artefact, "
            f"as from latents decoded at the wrong VAE scale)"
        )

    # 9. collapse into blur or smear
    sh0, sh1 = _quarters(s.sharpness)
    if sh0 > 0 and sh1 / sh0 < cfg.blur_ratio and not flat_frames.any():
        reasons.append(
            f"blur: frames {3 * n // 4}-{n - 1} (sharpness {sh1:.2f} is "
            f"{_cmp(sh1 / sh0, '<', cfg.blur_ratio, 0, pct=True)} of frames 0-{n // 4 - 1}'s {sh0:.2f})"
        )
    return _result(reasons, s, fps)


def _result(reasons: list[str], s: Series, fps: float) -> QCResult:
    n = len(s.luma)
    pair = n > 1

    def r(x, k=3):
        return round(float(x), k)

    metrics = {
        "frames": n,
        "fps": r(fps),
        "luma_mean": r(s.luma.mean()),
        "luma_min": r(s.luma.min()),
        "spread_min": r(s.spread.min()),
        "ssim_mean": r(s.ssim.mean(), 4) if pair else None,
        "ssim_min": r(s.ssim.min(), 4) if pair else None,
        "residual_median": r(np.median(s.residual)) if pair else None,
        "residual_max": r(s.residual.max()) if pair else None,
        "diff_mean": r(s.diff.mean()) if pair else None,
        "flow_median": r(np.median(s.flow)) if pair else None,
        "texture_residual": r(np.median(s.hp_ratio)) if pair else None,
        "boiling": r(np.median(s.boil)) if len(s.boil) else None,
        "clipped_max": r(s.clipped.max(), 4),
        "border_line": [r(x, 2) for x in border_by_side(s)],
        "sharpness_ratio": r(_quarters(s.sharpness)[1] / max(_quarters(s.sharpness)[0], 1e-6)),
    }
    return QCResult("reject" if reasons else "pass", reasons, metrics)


def check_frames(frames: np.ndarray, fps: float, cfg: QCConfig = QCConfig()) -> QCResult:
    """QC over (F, H, W, 3) uint8 RGB frames."""
    return check_frames_with_series(frames, fps, cfg)[0]




# Memory: QC holds the whole clip, decoded (3 bytes a pixel), and its working copy with the
# metrics' per-frame arrays, about this many bytes per working-copy pixel (measured peak RSS:
# 1.92 MB more per 320x180 frame, 600 frames against 120; README "QC")
WORKING_BYTES_PER_PX = 30
BASE_BYTES = 130e6  # the process itself, with its libraries: peak RSS less the frames' share


def memory_needed(frames: int, h: int, w: int, max_side: int) -> tuple[float, int, int]:
    """(bytes QC needs for ``frames`` frames of ``w`` x ``h``, bytes decoded a frame, bytes of
    working copy and metrics a frame)."""
    ws, hs, _ = working_size(h, w, max_side)
    decoded, working = h * w * 3, ws * hs * WORKING_BYTES_PER_PX
    return BASE_BYTES + frames * (decoded + working), decoded, working


class FrameTooSmall(ValueError):
    """The frames are too small (or too narrow) for QC to measure."""


def check_frames_with_series(frames: np.ndarray, fps: float, cfg: QCConfig = QCConfig()) -> tuple[QCResult, Series]:
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames: expected (F, H, W, 3) uint8 with F >= 1, got {frames.shape} {frames.dtype}")
    h, w = frames.shape[1:3]
    ws, hs, k = working_size(h, w, cfg.max_side)
    if min(ws, hs) < MIN_SIDE:
        shrunk = f", {ws}x{hs} once shrunk to at most max_side {cfg.max_side} px" if k > 1 else ""
        fix = ""
        if min(h, w) >= MIN_SIDE:  # a strip: shrunk less, its short side keeps 32 px
            need = -(-max(h, w) // (min(h, w) // MIN_SIDE))  # the smallest max_side that shrinks it little enough
            nws, nhs, _ = working_size(h, w, need)
            fix = f"; --set max_side={need} measures it at {nws}x{nhs}"
        raise FrameTooSmall(f"frames of {w}x{h} px{shrunk}: QC needs at least {MIN_SIDE} px a side "
                            f"(its optical flow cannot follow less){fix}")
    t0 = time.perf_counter()
    try:
        series = measure(frames, cfg.max_side, fps if fps and fps > 0 else 24.0, cfg.boiling_seconds, cfg.boiling_area)
    except cv2.error as e:  # OpenCV's failed allocation is its own error: make it Python's
        if e.code == cv2.Error.StsNoMem:
            raise MemoryError(str(e)) from e
        raise
    result = verdict(series, fps, cfg)
    result.metrics["width"], result.metrics["height"] = int(frames.shape[2]), int(frames.shape[1])
    result.metrics["qc_s"] = round(time.perf_counter() - t0, 4)
    return result, series
