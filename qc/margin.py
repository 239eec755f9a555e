"""How close a checked clip came to QC's limits: the review page's risk order.

Each limit a clip's metrics can be compared with gives a relative margin, positive inside the
limit and negative past it (``(limit - value) / limit`` for an upper bound, the other way round
for a lower one). A clip's margin is the smallest: the limit it came nearest to. Operators look
at the borderline survivors first, so a survivor with margin 0.03 sorts before one with 0.6.
Pure: metrics (``QCResult.metrics``) and thresholds in, numbers out.
"""

from __future__ import annotations

from .check import QCConfig

# a reason's first word is its kind: "boiling: frames 0-23 (...)" -> "boiling"
REASON_KINDS = ("flat", "black", "uniform", "block", "jump", "garbage", "flicker", "frozen", "exposure", "boiling",
                "unstable", "border", "blur")


def _upper(value, limit) -> float | None:  # value must stay below limit
    if value is None or not limit:
        return None
    return (limit - value) / abs(limit)


def _lower(value, limit) -> float | None:  # value must stay above limit
    if value is None or not limit:
        return None
    return (value - limit) / abs(limit)


def margins(metrics: dict, cfg: QCConfig = QCConfig()) -> dict[str, float]:
    """The relative margin of each metric to its limit (those the metrics allow)."""
    m = metrics or {}
    spike_limit = max(cfg.spike_min, cfg.spike_factor * (m.get("residual_median") or 0.0))
    sides = m.get("border_line")  # the four sides' values, strongest first
    out = {
        "black": _lower(m.get("luma_min"), cfg.black_luma),
        "uniform": _lower(m.get("spread_min"), cfg.uniform_spread),
        "pair_ssim": _lower(m.get("ssim_min"), cfg.min_pair_ssim),
        "residual": _upper(m.get("residual_max"), spike_limit),
        "boiling": _upper(m.get("boiling"), cfg.boiling_excess),
        "median_ssim": _lower(m.get("ssim_mean"), cfg.min_median_ssim),
        "border": _upper(sides[cfg.border_sides - 1], cfg.border_line) if sides else None,
        "blur": _lower(m.get("sharpness_ratio"), cfg.blur_ratio),
    }
    return {k: round(float(v), 4) for k, v in out.items() if v is not None}


def risk(metrics: dict, cfg: QCConfig = QCConfig()) -> tuple[float | None, str | None]:
    """(the smallest margin, the metric it belongs to); (None, None) without metrics."""
    ms = margins(metrics, cfg)
    if not ms:
        return None, None
    name = min(ms, key=ms.get)
    return ms[name], name


def reason_kinds(reasons: list[str] | None, known: tuple[str, ...] = REASON_KINDS) -> list[str]:
    """The kinds of a verdict's reasons (those in ``known``), in order, once each."""
    out: list[str] = []
    for r in reasons or []:
        kind = r.split(":", 1)[0].strip()
        if kind in known and kind not in out:
            out.append(kind)
    return out
