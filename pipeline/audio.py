"""Music for finished ads: decode an audio file to PCM, fit it to a video's exact length (looped
when shorter, trimmed when longer), set its volume and fade it out.

PCM here is float32 (channels, samples) in [-1, 1] at :data:`RATE`, stereo. Nothing here knows
about templates or jobs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .video import local

RATE = 48000
CHANNELS = 2


class AudioError(ValueError):
    """A file that cannot be read as audio."""


def load(path: str | Path, rate: int = RATE) -> np.ndarray:
    """All of the first audio stream of ``path`` as float32 (2, samples) at ``rate``."""
    import av

    try:
        with av.open(local(path)) as container:
            stream = container.streams.audio[0]
            resampler = av.AudioResampler(format="fltp", layout="stereo", rate=rate)
            chunks = []
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray())
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray())
    except IndexError:
        raise AudioError(f"{path}: it has no audio stream") from None
    except av.error.FFmpegError as e:
        raise AudioError(f"{path}: not a readable audio file ({getattr(e, 'strerror', None) or e})") from None
    if not chunks:
        raise AudioError(f"{path}: the audio stream has no samples")
    return np.concatenate(chunks, axis=1).astype(np.float32)


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
