"""Frame markers: a per-frame prompt that tells each frame where it lies in the clip.

An AnimateDiff UNet reads the text only in its spatial layers, which work frame by frame and
see the same text states in every frame; only its temporal layers know a frame's place in the
clip, and they never see the text. A direction asked in words ("moves up") must then be carried
from one kind of layer to the other, which the small shapes model learnt for left and right but
hardly for up and down (README, "Why the motion fails").

A model trained with frame markers is given one prompt per frame instead (AnimateDiff's
per-frame prompts, "prompt travel"): the clip's own tokens, with the last position of the padded
sequence (a padding token for any prompt shorter than the tokenizer's length) replaced by the
marker of that frame's place in the clip. The text encoder is causal, so every state before that
position is what it is without the marker, and the marker's state, which has attended to the
whole prompt, is where the caption and the time meet: each frame's spatial layers can draw "the
shape, a little higher than in the frames before" directly.

- Markers are token ids (a model folder's ``clipmill.json`` lists them, ``"frame_markers"``);
  frame ``f`` of ``n`` gets marker ``round((count - 1) * f / (n - 1))``, so the markers span the
  clip whatever its length (a long shot's frames share them, as its motion spreads over more
  frames).
- A clip rendered without markers (the streaming preview, whose frames have no fixed place) is
  the plain prompt repeated per frame, which such a model is also trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

MAX_MARKERS = 64


def check_markers(value, where: str = "frame_markers") -> tuple[int, ...]:
    """A model folder's marker token ids as a tuple (empty: the model has none). Raises
    ValueError naming the value and what is allowed."""
    if value is None or value == []:
        return ()
    if (not isinstance(value, list) or not 2 <= len(value) <= MAX_MARKERS
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            or len(set(value)) != len(value)):
        raise ValueError(f"{where}={value!r}: must be a list of 2 to {MAX_MARKERS} distinct token ids (integers >= 0)")
    return tuple(value)


def marker_index(frame: int, frames: int, count: int) -> int:
    """Which of ``count`` markers frame ``frame`` (0-based) of a ``frames``-frame clip gets."""
    if not 0 <= frame < frames:
        raise ValueError(f"marker_index: frame={frame} is outside a clip of {frames} frames")
    return round((count - 1) * frame / max(1, frames - 1))


def frame_indices(frames: int, count: int) -> torch.Tensor:
    """The marker index of every frame of a ``frames``-frame clip, (frames,) long."""
    import torch

    return torch.tensor([marker_index(f, frames, count) for f in range(frames)], dtype=torch.long)


def mark(ids: torch.Tensor, frames: int, markers: Sequence[int], on: Sequence[bool] | None = None) -> torch.Tensor:
    """Token ids (B, L) to per-frame token ids (B * frames, L), clip-major (a clip's frames are
    consecutive rows, as AnimateDiff's ``encoder_hidden_states``): each clip's row once per
    frame, its last position replaced by the frame's marker. A clip whose ``on`` is False keeps
    its plain tokens in every frame."""
    import torch  # here, not at the top: model folders' configs are read without torch (clipmill --help)

    rows = ids.repeat_interleave(frames, dim=0).clone()
    if not markers:
        return rows
    which = frame_indices(frames, len(markers))
    marker_ids = torch.tensor(markers, dtype=ids.dtype)[which].repeat(len(ids))
    keep = torch.ones(len(ids), dtype=torch.bool) if on is None else torch.tensor(list(on), dtype=torch.bool)
    if len(keep) != len(ids):
        raise ValueError(f"mark: {len(keep)} 'on' flags for {len(ids)} clips")
    sel = keep.repeat_interleave(frames)
    rows[sel, -1] = marker_ids[sel].to(rows.device)
    return rows


def per_frame(states: torch.Tensor, clips: int, frames: int) -> torch.Tensor:
    """Text states as AnimateDiff's ``encoder_hidden_states`` (clips * frames, L, D): ``states``
    already per frame are returned as they are, one row per clip is repeated per frame."""
    if states.shape[0] == clips * frames:
        return states
    if states.shape[0] != clips:
        raise ValueError(f"per_frame: {states.shape[0]} rows of text states for {clips} clips of {frames} frames "
                         f"(allowed: {clips} or {clips * frames})")
    return states.repeat_interleave(frames, dim=0)
