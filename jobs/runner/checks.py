"""The render check: what the render stage knows about a clip that its frames cannot show.

QC judges frames and is blind to how a clip was made. One failure of a real model is easier to
see before the frames exist: latents decoded at the wrong scale (a VAE's ``scaling_factor`` from
another model family) reach the decoder too large or too small, and its output mostly
overshoots the [-1, 1] it is clipped to. On a background of the padding's own colour the
clipped frames look merely contrasty, and QC lets most of them through; the decoder's input is
unmistakable.

A model folder states how far its good decodes go (``clipmill.json`` ``"decode_range"``,
``ModelInfo.decode_range``), and the range of the RMS of the latents its decoder is given on
good clips (``"decode_input_rms"``): a scaling factor that is not the model's own moves every
clip's latents by the same ratio, which the decoder's normalisations partly hide in its output
but not in its input. The render stage stores each clip's two measures beside those limits in
the attempt's record (``decode_check``), so the post stage, which may run on a host without the
model, judges it from the record alone (``render_reasons``). A model that states no limits is
not checked; nor is a clip decoded by the tiny decoder (its range is not the VAE's), nor one
whose decode went NaN (it has no measures; QC rejects its black frames).
"""

from __future__ import annotations

import math
from dataclasses import replace

from clipmill.qc import QCResult
from clipmill.qc.margin import REASON_KINDS

RENDER_KINDS = ("decode",)
VERDICT_KINDS = REASON_KINDS + RENDER_KINDS  # every reason kind a verdict can carry (review filter)


def decode_check(peak: float | None, limit: float | None, rms: float | None = None,
                 rms_range: tuple[float, float] | None = None) -> dict:
    """The record of one clip's decode for the post stage: ``decode_peak`` and
    ``decode_input_rms`` (each when it is a finite number) and the model's ``decode_range`` and
    ``decode_input_rms_range`` (when it states them)."""
    out = {}
    if peak is not None and math.isfinite(peak):
        out["decode_peak"] = round(float(peak), 4)
    if limit is not None:
        out["decode_range"] = float(limit)
    if rms is not None and math.isfinite(rms):
        out["decode_input_rms"] = round(float(rms), 4)
    if rms_range is not None:
        out["decode_input_rms_range"] = [float(rms_range[0]), float(rms_range[1])]
    return out


def clip_decode_check(result, info) -> dict:
    """:func:`decode_check` of a rendered clip (a ``ClipResult``) against its model's
    ``ModelInfo``."""
    return decode_check(result.decode_peak, info.decode_range, result.decode_input_rms, info.decode_input_rms)


def render_reasons(record: dict) -> list[str]:
    """The render check's reasons for a clip, from its record (``decode_check``'s keys)."""
    reasons = []
    rms, (low, high) = record.get("decode_input_rms"), record.get("decode_input_rms_range") or (None, None)
    if rms is not None and low is not None and not low <= rms <= high:
        reasons.append(f"decode: the latents the VAE decoded have an RMS of {rms:.2f}, outside this model's {low:g}-"
                       f"{high:g} (clipmill.json decode_input_rms): decoded at another model's scaling factor")
    peak, limit = record.get("decode_peak"), record.get("decode_range")
    if peak is not None and limit is not None and peak > limit:
        reasons.append(f"decode: the VAE's output reached {peak:.2f} before clipping to [-1, 1]; this model's good "
                       f"decodes stay within {limit:g} (clipmill.json decode_range); latents decoded at the wrong "
                       "scale, or diverged")
    return reasons


def with_render_check(result: QCResult, record: dict) -> QCResult:
    """``result`` with the render check's reasons added; rejected when there are any."""
    reasons = render_reasons(record)
    if not reasons:
        return result
    return replace(result, verdict="reject", reasons=[*result.reasons, *reasons])
