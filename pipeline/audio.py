"""Sound: read a file's first audio track to PCM (all of it, or placed against a clip's
picture), fit it to a video's exact length (looped when shorter, trimmed when longer, its
volume set, faded out), and write it into an MP4 as AAC interleaved with the video.

PCM here is float32 (channels, samples) in [-1, 1]. Music for finished ads is stereo at
:data:`RATE`. Nothing here knows about templates or jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .video import local, reason, video_stream

RATE = 48000
CHANNELS = 2
AAC, AAC_BITRATE = "aac", 192_000
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)
AAC_FRAME = 1024  # samples per AAC frame
FOLLOW_ON_S = 0.005  # an audio frame stated this close to where the one before ends follows on (MKV's ms times)
MAX_SAMPLE = 16.0  # float PCM beyond +-16 (+24 dBFS) is damage, not sound
LAYOUTS = {1: "mono", 2: "stereo"}  # a clip's sound keeps mono or stereo; more channels are mixed down to stereo


class AudioError(ValueError):
    """A file that cannot be read as audio."""


@dataclass
class Sound:
    """A clip's sound: float32 PCM (channels, samples) at ``rate``, channel ``layout``; sample 0
    plays with the first frame. ``damaged``: packets of the source that did not decode, or
    decoded to samples that are not sound (silent here)."""

    pcm: np.ndarray
    rate: int
    layout: str
    damaged: int = 0

    def writer(self, out, bit_rate: int = AAC_BITRATE) -> AacWriter:
        """Add this sound's AAC stream to ``out`` (an ``av`` container open for writing; before
        its first packet) and return what writes it."""
        return AacWriter(out, self, bit_rate)


class AacWriter:
    """A :class:`Sound` written as AAC into a container as its video is written: ``until(t)``
    after each video frame (whole AAC frames up to ``t`` seconds, so that the streams
    interleave), ``close()`` after the video (the rest of the sound, and the encoder's flush)."""

    def __init__(self, out, sound: Sound, bit_rate: int = AAC_BITRATE):
        self.out, self.sound, self.done = out, sound, 0
        self.stream = out.add_stream(AAC, rate=sound.rate, layout=sound.layout)
        self.stream.bit_rate = bit_rate

    def until(self, seconds: float) -> None:
        upto = round(seconds * self.sound.rate)
        if upto < self.sound.pcm.shape[1]:
            self._encode(upto - (upto - self.done) % AAC_FRAME)

    def close(self) -> None:
        self._encode(self.sound.pcm.shape[1])
        for packet in self.stream.encode():
            self.out.mux(packet)

    def _encode(self, upto: int) -> None:
        import av

        pcm, rate, layout = self.sound.pcm, self.sound.rate, self.sound.layout
        for i in range(self.done, upto, AAC_FRAME):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, i:min(i + AAC_FRAME, upto)]),
                                               format="fltp", layout=layout)
            frame.sample_rate, frame.pts = rate, i
            for packet in self.stream.encode(frame):
                self.out.mux(packet)
        self.done = max(self.done, upto)


def _check_decoder(stream, path) -> None:
    """``AudioError`` when this FFmpeg has no decoder for ``stream``'s codec (PyAV gives it no
    codec context)."""
    if stream.codec_context is None:
        raise AudioError(f"{path}: its audio's codec cannot be decoded here (this FFmpeg has no decoder for it)")


def _decoded(container, stream, layout: str, rate: int) -> Iterator[tuple[float | None, np.ndarray | None, bool]]:
    """(time, PCM, damaged) for each decoded piece of ``stream``, converted to float32 ``layout``
    at ``rate``: the time (seconds) of the source frame it starts, None where it follows on from
    the piece before.

    - A packet the decoder refuses (FFmpeg answers damaged bytes with several errors: invalid
      data, EPERM from AAC, "patches welcome" from ALAC) gives (its time or None, None, True).
    - A piece with samples that are not finite or beyond +-``MAX_SAMPLE`` (float PCM has no
      checksum: damaged bytes decode to NaN or 1e30, which the AAC encoder refuses) comes
      silenced, with damaged True.
    - A frame whose sample format, channels or rate differ from the one before (a track joined
      from two recordings) gets a converter of its own: one converter refuses it, or passed
      it through at the first part's rate.
    """
    import av

    def piece(time, out) -> tuple[float | None, np.ndarray, bool]:
        pcm = out.to_ndarray()
        if np.all(np.abs(pcm) <= MAX_SAMPLE):  # False for NaN too
            return time, pcm, False
        return time, np.zeros_like(pcm), True

    convert, made = None, None
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.FFmpegError:
            yield (float(packet.pts * packet.time_base) if packet.pts is not None else None), None, True
            continue
        for frame in frames:
            kind = (frame.format.name, frame.layout.name, frame.sample_rate)
            if kind != made:
                if convert is not None:
                    for out in convert.resample(None):
                        yield piece(None, out)
                convert, made = av.AudioResampler(format="fltp", layout=layout, rate=rate), kind
            for i, out in enumerate(convert.resample(frame)):
                yield piece(frame.time if i == 0 else None, out)
    if convert is not None:
        for out in convert.resample(None):
            yield piece(None, out)


def load(path: str | Path, rate: int = RATE) -> np.ndarray:
    """All of the first audio stream of ``path`` as float32 (2, samples) at ``rate``.
    ``AudioError`` when it has none, has no samples, or a packet does not decode (named by its
    time: a damaged file, not music with a gap)."""
    import av

    try:
        with av.open(local(path)) as container:
            stream = container.streams.audio[0]
            _check_decoder(stream, path)
            chunks = []
            for time, pcm, damaged in _decoded(container, stream, "stereo", rate):
                if damaged:
                    at = f"at {max(time, 0.0):.3f} s" if time is not None else "in a packet"
                    what = "a packet does not decode" if pcm is None else "samples that are not sound: NaN or huge"
                    raise AudioError(f"{path}: the audio is damaged {at} ({what}); re-export or re-encode it")
                chunks.append(pcm)
    except IndexError:
        raise AudioError(f"{path}: it has no audio stream") from None
    except av.error.FFmpegError as e:
        raise AudioError(f"{path}: not a readable audio file ({reason(e)})") from None
    if not chunks or not sum(c.shape[1] for c in chunks):
        raise AudioError(f"{path}: the audio stream has no samples")
    return np.concatenate(chunks, axis=1).astype(np.float32)


def read_sound(src: str | Path, seconds: float) -> Sound | None:
    """``src``'s first audio track for ``seconds`` from the time of its first decoded video frame
    (where its decoded frames start): each audio frame placed by its own time, silence where the
    track has none (a gap, a late start, a packet that does not decode), what lies before or
    after cut off. At its own rate when AAC holds it, else 48 kHz; mono or stereo (more
    channels are mixed down). None when ``src`` has no audio; ``AudioError`` when the track
    cannot be read at all, or none of its packets decodes. A frame whose time lies within
    ``FOLLOW_ON_S`` of the end of the one before follows on from it; in takes joined byte for
    byte whose times start again (the picture's decode times go back), so does one stated
    earlier."""
    import av

    try:
        with av.open(local(src)) as inp:
            if not inp.streams.audio:
                return None
            picture = video_stream(inp, src)
            dts = [p.dts for p in inp.demux(picture) if p.dts is not None]
            # takes joined byte for byte whose times start again: decode() lays their pictures end
            # to end, in stored order, and the sound follows them so
            joined = any(b < a for a, b in zip(dts, dts[1:]))
            inp.seek(0)
            start = next((f.time for f in inp.decode(picture)), None) or 0.0
        with av.open(local(src)) as inp:
            ain = inp.streams.audio[0]
            _check_decoder(ain, src)
            rate = ain.codec_context.sample_rate
            if not rate:
                raise AudioError(f"{src}: its audio states no sample rate")
            layout = LAYOUTS.get(ain.codec_context.channels, "stereo")
            pcm = np.zeros((len(av.AudioLayout(layout).channels), round(seconds * rate)), np.float32)
            damaged, decoded, at = 0, 0, None
            for time, data, bad in _decoded(inp, ain, layout, rate):
                damaged += bad
                if data is None:
                    continue
                if time is not None or at is None:  # a source frame's first piece; the rest follows on
                    stated = round((time - start) * rate) if time is not None else 0  # no times: end to end
                    # A frame stated within FOLLOW_ON_S of where the one before ended (a container's
                    # times rounded to the millisecond) follows on; one further off goes where its
                    # time says: after a gap (silence up to it), or back over an overlap (a clock
                    # that runs fast does not drift the sound later and later). In joined takes
                    # whose times start again, a frame stated earlier follows on, as their pictures do.
                    if at is None or stated - at > FOLLOW_ON_S * rate or (at - stated > FOLLOW_ON_S * rate
                                                                          and not joined):
                        at = stated
                decoded += not bad
                lo, hi = max(at, 0), min(at + data.shape[1], pcm.shape[1])
                if lo < hi:
                    pcm[:, lo:hi] = data[:, lo - at:hi - at]
                at += data.shape[1]
    except av.error.FFmpegError as e:
        raise AudioError(f"{src}: its audio cannot be read ({reason(e)})") from None
    if not decoded and damaged:
        raise AudioError(f"{src}: none of its {damaged} audio packets decodes")
    if rate not in AAC_RATES:
        rate, pcm = 48000, _resample(pcm, rate, 48000, layout)
    return Sound(pcm, rate, layout, damaged)


def _resample(pcm: np.ndarray, rate: int, to: int, layout: str) -> np.ndarray:
    """``pcm`` at ``rate`` resampled to ``to``, as many samples as the same duration holds."""
    import av

    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm), format="fltp", layout=layout)
    frame.sample_rate = rate
    r = av.AudioResampler(format="fltp", layout=layout, rate=to)
    out = np.concatenate([f.to_ndarray() for f in [*r.resample(frame), *r.resample(None)]], axis=1)
    n = round(pcm.shape[1] * to / rate)
    return np.pad(out, ((0, 0), (0, max(0, n - out.shape[1]))))[:, :n].astype(np.float32)


def fit(pcm: np.ndarray, seconds: float, volume: float = 1.0, fade_out: float = 0.0, rate: int = RATE,
        fade_in: float = 0.01) -> np.ndarray:
    """``pcm`` made exactly ``seconds`` long (looped or trimmed), times ``volume``, with a linear
    fade-out over its last ``fade_out`` seconds (and a 10 ms fade-in, so it starts without a click)."""
    n = max(1, round(seconds * rate))
    if pcm.shape[1] < n:
        pcm = np.tile(pcm, (1, -(-n // pcm.shape[1])))
    out = pcm[:, :n] * np.float32(volume)
    ramp = np.ones(n, np.float32)
    k_in = min(n, round(fade_in * rate))
    if k_in:
        ramp[:k_in] = np.linspace(0.0, 1.0, k_in, dtype=np.float32)
    k_out = min(n, round(fade_out * rate))
    if k_out:
        ramp[n - k_out:] *= np.linspace(1.0, 0.0, k_out, dtype=np.float32)
    return np.clip(out * ramp, -1.0, 1.0).astype(np.float32)


def tone(seconds: float, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """A short, varied stereo melody (sine notes with soft attacks): a music stand-in for examples
    and tests, made without any file."""
    rng = np.random.default_rng(seed)
    n = round(seconds * rate)
    t = np.arange(n) / rate
    out = np.zeros((2, n), np.float32)
    note = 0.25
    scale = np.array([0, 2, 4, 7, 9, 12, 14, 16])
    for i in range(int(np.ceil(seconds / note))):
        a, b = round(i * note * rate), min(n, round((i + 1) * note * rate))
        f = 220.0 * 2 ** (scale[rng.integers(len(scale))] / 12)
        seg = t[a:b] - t[a]
        env = np.minimum(seg / 0.02, 1.0) * np.exp(-seg * 4.0)
        wave = 0.3 * np.sin(2 * np.pi * f * seg) + 0.1 * np.sin(4 * np.pi * f * seg)
        out[0, a:b] = wave * env
        out[1, a:b] = wave * env * 0.9
    return out
