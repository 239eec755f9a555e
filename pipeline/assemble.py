"""Assembling a finished ad from its shots: the timeline (cuts and crossfades), reframing footage
to a format (render, crop or pad), layers (texts, logo) with their times and fades, an end card,
and the encode: H.264 with an ad platform's delivery settings, muxed with AAC music, into one MP4.

Frames are made one at a time from the shots' own (render-size) frames, so a 15-second
720 x 1280 ad never holds more than a few output frames in memory. Nothing here knows about
templates or jobs: ``jobs`` turns a template and a row into these objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from . import i420
from ..storage.local import replacing
from .audio import Sound
from .video import local, mux_frames

METHODS = ("render", "crop", "pad")
PROFILES = ("baseline", "main", "high")


def _crop(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The centre of ``frame`` at the aspect of ``size`` (width, height)."""
    w, h = size
    fh, fw = frame.shape[:2]
    if fw * h > fh * w:  # wider than the format: crop the sides
        cw = max(1, round(fh * w / h))
        x = (fw - cw) // 2
        return frame[:, x:x + cw]
    ch = max(1, round(fw * h / w))
    y = (fh - ch) // 2
    return frame[y:y + ch]


@dataclass
class Shot:
    """A shot's frames at the ad's fps (render size, any shape) and how the ad enters it:
    ``crossfade`` seconds of blend from the shot before (0: a cut)."""

    frames: np.ndarray
    crossfade: float = 0.0


@dataclass
class EndCard:
    """The last ``seconds``: ``colour`` (RGB) or, with ``blur`` > 0, the ad's last footage frame
    blurred (sigma ``blur`` as a fraction of the frame height) and dimmed to ``dim`` of its
    brightness, so that the end card's texts stand out and its start is a clear cut."""

    seconds: float
    colour: tuple[int, int, int] | None = (0, 0, 0)
    blur: float = 0.0
    dim: float = 0.55


@dataclass
class Layer:
    """An RGBA layer at (x, y) in output pixels, shown from ``start`` to ``end`` seconds (ad
    time), fading in and out over ``fade`` seconds."""

    rgba: np.ndarray
    x: int
    y: int
    start: float
    end: float
    fade: float = 0.0
    name: str = ""

    def opacity(self, t: float) -> float:
        if t < self.start or t >= self.end:
            return 0.0
        if self.fade <= 0:
            return 1.0
        return float(min(1.0, (t - self.start) / self.fade, (self.end - t) / self.fade))


@dataclass
class Timeline:
    """Shots, then an optional end card, at ``fps``; layers on top."""

    shots: Sequence[Shot]
    fps: float
    end_card: EndCard | None = None
    layers: Sequence[Layer] = field(default_factory=list)

    def overlaps(self) -> list[int]:
        """Frames of blend into each shot (0 for the first and for cuts), each at most the
        shorter of the two shots' lengths less one frame."""
        out = [0]
        for prev, shot in zip(self.shots, self.shots[1:]):
            k = round(shot.crossfade * self.fps)
            out.append(max(0, min(k, len(prev.frames) - 1, len(shot.frames) - 1)))
        return out

    def starts(self) -> list[int]:
        """The output frame at which each shot starts (its crossfade included), and then the end
        card's first frame and the total frame count."""
        out, pos = [], 0
        for shot, k in zip(self.shots, self.overlaps()):
            pos -= k
            out.append(pos)
            pos += len(shot.frames)
        out.append(pos)
        if self.end_card is not None:
            out.append(pos + round(self.end_card.seconds * self.fps))
        return out

    def boundaries(self) -> list[tuple[int, str]]:
        """Where the picture changes from one shot to the next: (first output frame of the new
        shot, 'cut' or 'crossfade'), and the end card's start as a cut."""
        starts, kinds = self.starts(), []
        for i, k in enumerate(self.overlaps()[1:], 1):
            kinds.append((starts[i] + k if k else starts[i], "crossfade" if k else "cut"))
        if self.end_card is not None:
            kinds.append((starts[len(self.shots)], "cut"))
        return kinds

    def __len__(self) -> int:
        return self.starts()[-1]

    @property
    def seconds(self) -> float:
        return len(self) / self.fps


def frames(tl: Timeline, size: tuple[int, int], method: str, pad_colour=(0, 0, 0),
           observe: Callable[[int, np.ndarray], None] | None = None) -> Iterator[np.ndarray]:
    """The ad's output frames, one at a time, as I420 (``pipeline.i420``; ``size`` is width,
    height, both even). ``observe(i, frame)`` sees each frame before the layers are drawn on it
    (to measure the footage under a text)."""
    import cv2

    w, h = i420.check_size(size)
    starts, overlaps = tl.starts(), tl.overlaps()
    n_foot = starts[len(tl.shots)]
    overlays = [i420.Overlay.prepare(layer.rgba, layer.x, layer.y) for layer in tl.layers]
    last = end = None
    for i in range(len(tl)):
        if i < n_foot:
            # the shot this frame belongs to, and the one it crossfades from
            j = max(s for s in range(len(tl.shots)) if starts[s] <= i)
            frame = reframe_i420(tl.shots[j].frames[i - starts[j]], size, method, pad_colour)
            k, into = overlaps[j], i - starts[j]
            if into < k:
                prev = tl.shots[j - 1].frames[len(tl.shots[j - 1].frames) - k + into]
                a = (into + 1) / (k + 1)
                frame = cv2.addWeighted(frame, a, reframe_i420(prev, size, method, pad_colour), 1 - a, 0)
            if i == n_foot - 1:
                last = frame.copy()  # the end card's blur reads the footage, not the layers on it
        else:
            if end is None:
                end = i420.from_rgb(_end_card(tl.end_card, None if last is None else i420.to_rgb(last), size))
            frame = end.copy()
        if observe is not None:
            observe(i, frame)
        t = i / tl.fps
        for layer, ov in zip(tl.layers, overlays):
            ov.blend(frame, layer.opacity(t))
        yield frame


def reframe_i420(frame: np.ndarray, size: tuple[int, int], method: str, pad_colour=(0, 0, 0)) -> np.ndarray:
    """One footage frame (RGB, any size) as an I420 frame of ``size`` (width, height).
    ``render``: footage already of that shape, scaled; ``crop``: the centre of the footage at
    the format's aspect, scaled; ``pad``: all of the footage, scaled to fit, on ``pad_colour``
    bars. Footage smaller than the output is converted at its own size and only its planes are
    scaled up (bilinear; see ``i420.put``), larger footage is scaled down by area averaging."""
    w, h = size
    fh, fw = frame.shape[:2]
    if method == "pad":
        k = min(w / fw, h / fh)
        iw, ih = max(2, round(fw * k / 2) * 2), max(2, round(fh * k / 2) * 2)
        out = i420.blank(size, pad_colour)
        i420.put(out, frame, ((w - iw) // 2 // 2 * 2, (h - ih) // 2 // 2 * 2, min(iw, w), min(ih, h)))
        return out
    if method == "crop":
        frame = _crop(frame, size)
    elif method != "render":
        raise ValueError(f"method {method!r} is not known; allowed: {', '.join(METHODS)}")
    out = np.empty((h * 3 // 2, w), np.uint8)
    i420.put(out, frame, (0, 0, w, h))
    return out


def _end_card(card: EndCard, last: np.ndarray | None, size: tuple[int, int]) -> np.ndarray:
    """The end card's picture (before its texts): a colour, or the last footage frame blurred."""
    import cv2

    w, h = size
    if card.blur > 0 and last is not None:
        small = cv2.resize(last, (max(1, w // 4), max(1, h // 4)), interpolation=cv2.INTER_AREA)
        blurred = cv2.GaussianBlur(small, (0, 0), max(0.5, card.blur * h / 4))
        return cv2.convertScaleAbs(cv2.resize(blurred, (w, h), interpolation=cv2.INTER_LINEAR), alpha=card.dim)
    img = np.empty((h, w, 3), np.uint8)
    img[...] = card.colour or (0, 0, 0)
    return img


@dataclass(frozen=True)
class Delivery:
    """An ad platform's encoding rules for one format. ``crf`` sets the quality; ``max_kbps``
    caps the video bitrate (VBV, buffer of 2 s); ``max_bytes`` caps the file: a file over it is
    encoded again at the bitrate that fits (``over_size='reencode'``) or refused ('refuse')."""

    profile: str = "high"
    level: str = "4.0"
    crf: int = 20
    max_kbps: int | None = None
    audio_kbps: int = 128
    max_bytes: int | None = None
    over_size: str = "reencode"
    preset: str = "veryfast"


class DeliveryError(ValueError):
    """A file that cannot meet its delivery settings."""


def encode(source: Callable[[], Iterator[np.ndarray]], n_frames: int, fps: float, size: tuple[int, int],
           path: str | Path, delivery: Delivery = Delivery(), audio: np.ndarray | None = None, rate: int = 48000) -> dict:
    """Encode frames (``source()`` makes them, one at a time; it is called again for a second pass)
    and float PCM ``audio`` (2, samples) into an H.264 + AAC MP4 at ``path``.

    The file is written beside ``path`` and renamed into place, so ``path`` is either absent or
    complete. Returns what was made: bytes, the video bitrate cap used and whether the file was
    encoded again to fit ``max_bytes``. Raises DeliveryError when it cannot fit."""
    path = Path(path)
    with replacing(path) as tmp:
        _encode_once(source(), fps, size, tmp, delivery, delivery.max_kbps, audio, rate)
        made = {"bytes": tmp.stat().st_size, "max_kbps": delivery.max_kbps, "reencoded": False}
        if delivery.max_bytes and made["bytes"] > delivery.max_bytes:
            seconds = n_frames / fps
            if delivery.over_size != "reencode":
                raise DeliveryError(f"{path.name}: {made['bytes']:,} bytes, over the format's max_size of "
                                    f"{delivery.max_bytes:,} bytes (over_size = 'refuse')")
            # the video bitrate that fits, less the audio and 3% for the container
            kbps = int((delivery.max_bytes * 8 * 0.97 / seconds - (delivery.audio_kbps * 1000 if audio is not None else 0)) / 1000)
            if kbps < 50:
                raise DeliveryError(f"{path.name}: max_size {delivery.max_bytes:,} bytes leaves {kbps} kbit/s for "
                                    f"{seconds:.2f} s of video; at least 50 kbit/s is needed")
            # a bitrate target (not CRF) held by a one-second buffer; x264 can overshoot a short
            # file's target, so it steps down twice before refusing
            for k in (1.0, 0.8, 0.6):
                target = max(50, int(kbps * k))
                _encode_once(source(), fps, size, tmp, delivery, target, audio, rate, abr=True)
                made = {"bytes": tmp.stat().st_size, "max_kbps": target, "reencoded": True}
                if made["bytes"] <= delivery.max_bytes:
                    break
            else:
                raise DeliveryError(f"{path.name}: {made['bytes']:,} bytes at {target} kbit/s, still over max_size "
                                    f"{delivery.max_bytes:,} bytes")
        return made


def _encode_once(frame_iter, fps, size, path, d: Delivery, kbps, audio, rate, abr: bool = False) -> None:
    """One encode. ``kbps`` caps the video bitrate (VBV, a 2 s buffer) on top of the CRF; with
    ``abr`` it is the target instead (a 1 s buffer), to fit a file size."""
    import av
    import cv2

    w, h = i420.check_size(size)
    with av.open(local(path), mode="w", format="mp4", container_options={"movflags": "+faststart"}) as out:
        video_rate = Fraction(fps).limit_denominator(1001)  # one clock for the video and the music's interleaving
        vs = out.add_stream("libx264", rate=video_rate)
        vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
        opts = {"preset": d.preset, "profile": d.profile, "level": d.level}
        if abr:
            vs.bit_rate = kbps * 1000
            opts.update(maxrate=f"{kbps}k", bufsize=f"{kbps}k")
        else:
            opts["crf"] = str(d.crf)
            if kbps:
                opts.update(maxrate=f"{kbps}k", bufsize=f"{2 * kbps}k")
        vs.options = opts
        aus = None
        if audio is not None:
            aus = Sound(np.asarray(audio, dtype=np.float32), rate, "stereo").writer(out, d.audio_kbps * 1000)
        # I420 as frames() makes them, or RGB
        yuv = (f if f.ndim == 2 else cv2.cvtColor(f, cv2.COLOR_RGB2YUV_I420) for f in frame_iter)
        mux_frames(out, vs, (av.VideoFrame.from_ndarray(f, format="yuv420p") for f in yuv), video_rate, aus)


def probe_av(path: str | Path) -> dict:
    """Size, fps, frame count and duration of an MP4's video, and its audio's codec, duration
    and samples, as stored (for delivery checks and ad QC)."""
    import av

    with av.open(local(path)) as c:
        v = c.streams.video[0]
        fps = float(v.average_rate or v.guessed_rate or 0)
        n = sum(1 for p in c.demux(v) if p.size)
        info = {"width": v.codec_context.width, "height": v.codec_context.height, "fps": fps, "frames": n,
                "seconds": n / fps if fps else 0.0, "profile": v.codec_context.profile, "bytes": os.path.getsize(path)}
    with av.open(local(path)) as c:
        if c.streams.audio:
            a = c.streams.audio[0]
            samples, chunks = 0, []
            for fr in c.decode(a):
                arr = fr.to_ndarray()
                chunks.append(arr if arr.ndim == 2 else arr[None])
                samples += fr.samples
            info["audio"] = {"codec": a.codec_context.name, "rate": a.codec_context.sample_rate,
                             "samples": samples, "seconds": samples / (a.codec_context.sample_rate or 1)}
            info["_pcm"] = np.concatenate(chunks, axis=1) if chunks else np.zeros((2, 0), np.float32)
        else:
            info["audio"] = None
    return info
