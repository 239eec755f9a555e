"""Optical-flow interpolation: exact frame counts, gains over blending, no ghosting at cuts."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from clipmill.jobs.cli import main
from clipmill.pipeline.interpolate import interpolate, psnr
from clipmill.pipeline.retime import output_count, retime_linear, source_times
from clipmill.pipeline.synthetic import camera_move, photo
from clipmill.pipeline.video import decode, encode_h264, probe
from media import write_with_sound


def pan120(n, speed=2.0, size=(320, 192), img="coffee"):
    return camera_move(photo(img), "pan", n, size, np.random.default_rng(0), speed=speed)


@pytest.mark.parametrize("fps_in, fps_out", [(24, 30), (24, 60), (30, 60), (24, 25), (30, 24), (24, 59.94)])
def test_exact_count_and_first_frame(fps_in, fps_out):
    frames = pan120(17)
    out = interpolate(frames, fps_in, fps_out)
    assert len(out) == round((17 - 1) * fps_out / fps_in) + 1 == output_count(17, fps_in, fps_out)
    assert np.array_equal(out[0], frames[0])
    # output times that fall on input frames take them unchanged
    for k, p in enumerate(source_times(17, fps_in, fps_out)):
        if abs(p - round(p)) < 1e-9:
            assert np.array_equal(out[k], frames[int(round(p))])


@pytest.mark.parametrize("fps_in", [24, 30])
def test_pan_gain_over_linear_blending(fps_in):
    """Drop frames from a smooth 120 fps pan, interpolate back to 60 fps, compare with truth."""
    step = 120 // fps_in
    high = pan120(121, speed=2.0)
    low = high[::step]
    flow, lin = interpolate(low, fps_in, 60), retime_linear(low, fps_in, 60)
    pos = source_times(len(low), fps_in, 60)
    new = [k for k, p in enumerate(pos) if abs(p - round(p)) > 1e-6]
    truth = {k: high[int(round(pos[k] * step))] for k in new}
    gain = np.mean([psnr(flow[k], truth[k]) - psnr(lin[k], truth[k]) for k in new])
    assert gain >= 4.0, gain


def test_cut_repeats_nearest_frame_instead_of_blending():
    a = pan120(6, img="coffee")
    b = pan120(6, img="astronaut")
    frames = np.concatenate([a, b])  # a cut between frames 5 and 6
    out = interpolate(frames, 24, 48)
    # output 11 sits at input time 5.5: exactly one of the two neighbours, not a mix
    assert np.array_equal(out[11], frames[5]) or np.array_equal(out[11], frames[6])


def test_interpolate_command_writes_h264_with_exact_count(tmp_path):
    frames = pan120(25)
    encode_h264(frames, 24, tmp_path / "in.mp4")
    res = CliRunner().invoke(main, ["interpolate", str(tmp_path / "in.mp4"), str(tmp_path / "out.mp4"), "--fps", "60"])
    assert res.exit_code == 0, res.output
    info = probe(tmp_path / "out.mp4")
    assert (info["codec"], info["frames"], info["fps"]) == ("h264", round(24 * 60 / 24) + 1, 60.0)
    src, _ = decode(tmp_path / "in.mp4")
    dst, _ = decode(tmp_path / "out.mp4")
    assert psnr(dst[0], src[0]) > 35  # starts on the first input frame (after re-encoding)


def test_interpolate_command_errors(tmp_path):
    res = CliRunner().invoke(main, ["interpolate", str(tmp_path / "missing.mp4"), str(tmp_path / "o.mp4"), "--fps", "60"])
    assert res.exit_code == 2 and f"Error: SRC {tmp_path / 'missing.mp4'}: no such file" in res.output
    res = CliRunner().invoke(main, ["interpolate", "a.mp4"])
    assert res.exit_code == 2 and "give SRC DST --fps N, or --bench" in res.output


def test_interpolate_onto_a_full_disk_is_one_line_and_exit_3(tmp_path, full_disk):
    """Writing DST onto a full disk printed FFmpeg's traceback and exited 1. It is one line
    naming DST and why, with exit 3 (storage that cannot be written, README "Exit codes")."""
    encode_h264(pan120(25), 24, tmp_path / "in.mp4")
    (full_disk / "filler").write_bytes(b"x" * 56 * 1024)  # 8 of its 64 KiB left: DST takes about 60 KiB
    dst = full_disk / "out.mp4"
    res = CliRunner().invoke(main, ["interpolate", str(tmp_path / "in.mp4"), str(dst), "--fps", "60"])
    assert res.exit_code == 3, res.output
    assert res.stderr.splitlines()[-1] == f"Error: DST {dst}: cannot be written (No space left on device)"
    assert "Traceback" not in res.output


def test_the_sound_goes_where_its_own_times_say(tmp_path):
    """``read_sound`` places each audio frame by its own time (the first version laid them end to
    end from the first: a hole in the track made all after it early): a PCM track that starts
    0.25 s after the picture and has a hole at 0.5-0.75 s keeps its tone at 0.75 s. At 4 kHz, a
    rate AAC does not hold (it failed the whole command), it comes back at 48 kHz, exactly as
    long as the picture."""
    import av
    from fractions import Fraction

    from clipmill.pipeline.audio import read_sound

    path, rate = tmp_path / "gap.mkv", 4000
    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=24)
        v.width, v.height, v.pix_fmt = 64, 64, "yuv420p"
        a = c.add_stream("pcm_s16le", rate=rate, layout="mono")
        for f in np.zeros((24, 64, 64, 3), np.uint8):
            for p in v.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        n = np.arange(rate // 4)
        for t0, amp in ((0.25, 0), (0.75, 12000)):  # silence, then a tone a quarter second later
            pcm = (amp * np.sin(2 * np.pi * 440 * n / rate)).astype(np.int16)[None]
            af = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            af.sample_rate, af.pts, af.time_base = rate, int(t0 * rate), Fraction(1, rate)
            for p in a.encode(af):
                c.mux(p)
        for p in a.encode():
            c.mux(p)
    sound = read_sound(path, 1.0)
    assert (sound.rate, sound.layout, sound.pcm.shape) == (48000, "mono", (1, 48000))
    loud = np.abs(sound.pcm[0]) > 0.1
    assert abs(np.argmax(loud) / 48000 - 0.75) < 0.005 and loud[36500:47500].mean() > 0.5


def test_interpolate_carries_the_audio_in_step_with_the_picture(tmp_path):
    """A clip with sound came out silent. Now DST has the video and SRC's audio (AAC), as long as
    the picture, and a tone that starts half way through SRC starts at the same time in DST."""
    import av

    frames = pan120(24)
    n = np.arange(44100)
    tone = np.where((n >= 22050) & (n < 33075), 0.3 * np.sin(2 * np.pi * 440 * n / 44100), 0).astype(np.float32)
    with av.open(str(tmp_path / "in.mp4"), "w") as c:
        v = c.add_stream("libx264", rate=24)
        v.width, v.height, v.pix_fmt = 320, 192, "yuv420p"
        a = c.add_stream("aac", rate=44100)
        a.layout = "stereo"
        for f in frames:
            for p in v.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        af = av.AudioFrame.from_ndarray(np.stack([tone, tone]), format="fltp", layout="stereo")
        af.sample_rate = 44100
        for p in [*a.encode(af), *a.encode()]:
            c.mux(p)

    def sound(path):
        with av.open(str(path)) as c:
            pcm = np.concatenate([f.to_ndarray()[0] for f in c.decode(audio=0)])
            rate = c.streams.audio[0].codec_context.sample_rate
            return [s.type for s in c.streams], len(pcm) / rate, np.argmax(np.abs(pcm) > 0.1) / rate

    res = CliRunner().invoke(main, ["interpolate", "--help"])
    assert "SRC's first audio track goes along" in " ".join(res.output.split())
    res = CliRunner().invoke(main, ["interpolate", str(tmp_path / "in.mp4"), str(tmp_path / "out.mp4"), "--fps", "60"])
    assert res.exit_code == 0, res.output
    streams, seconds, onset = sound(tmp_path / "out.mp4")
    _, _, src_onset = sound(tmp_path / "in.mp4")
    assert streams == ["video", "audio"] and abs(seconds - 1.0) < 0.05, (streams, seconds)
    assert abs(onset - src_onset) < 0.03 and abs(onset - 0.5) < 0.05, (onset, src_onset)
    assert len(decode(tmp_path / "out.mp4")[0]) == 59


def _peak_hz(pcm: np.ndarray, rate: int, at: float) -> float:
    seg = pcm[round(at * rate):round(at * rate) + 4096]
    return float(np.fft.rfftfreq(len(seg), 1 / rate)[np.argmax(np.abs(np.fft.rfft(seg)))])


def test_a_track_joined_from_two_rates_keeps_its_pitch(tmp_path):
    """Two recordings joined byte for byte (MPEG-TS, as cut tools join them): 440 Hz at 44.1 kHz
    for a second, then 880 Hz at 48 kHz. The one converter, set up for the first part, passed
    the second through as if it were 44.1 kHz (880 Hz read about 790 Hz, and ran long); each
    part now gets a converter of its own, and both land where their times say."""
    from clipmill.pipeline.audio import read_sound

    write_with_sound(tmp_path / "a.ts", 0, 44100, 440, container="mpegts")
    write_with_sound(tmp_path / "b.ts", 1, 48000, 880, container="mpegts")
    joined = tmp_path / "joined.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    sound = read_sound(joined, 2.0)
    assert (sound.rate, sound.pcm.shape, sound.damaged) == (44100, (2, 88200), 0)
    hz = [_peak_hz(sound.pcm[0], 44100, t) for t in (0.25, 0.75, 1.1, 1.75)]
    assert all(abs(h - want) < 15 for h, want in zip(hz, (440, 440, 880, 880))), hz
    loud = np.abs(sound.pcm[0]) > 0.1
    assert loud[2000:42000].mean() > 0.5 and loud[46000:86000].mean() > 0.5


def test_interpolate_says_what_it_did_with_a_damaged_track(tmp_path):
    """Audio packets that do not decode: some are silent in DST and the command says how many;
    none decoding is no sound (it wrote a silent track), said on stderr, with the video written.
    One packet the AAC decoder answers with EPERM, not "invalid data", is one damaged packet
    too (it dropped the whole track)."""
    import av

    for name, damage, note, streams in (
            ("some.mp4", 0.3, "17 damaged audio packets (not decodable, or not sound); DST's sound is silent there",
             ["video", "audio"]),
            ("all.mkv", 1.0, "none of its 48 audio packets decodes; DST has the video only", ["video"]),
            ("eperm.mp4", {30: bytes.fromhex("b7210dc7160d")},
             "1 damaged audio packet (not decodable, or not sound); DST's sound is silent there", ["video", "audio"])):
        src, dst = tmp_path / name, tmp_path / f"out-{name.split('.')[0]}.mp4"
        if isinstance(damage, dict):
            write_with_sound(src, 0, 48000, 440, replace=damage)
        else:
            write_with_sound(src, 0, 48000, 440, damage=damage)
        res = CliRunner().invoke(main, ["interpolate", str(src), str(dst), "--fps", "30"])
        assert res.exit_code == 0, res.output
        assert f"SRC {src}: {note}" in res.stderr.splitlines()
        with av.open(str(dst)) as c:
            assert [s.type for s in c.streams] == streams


def test_a_matroska_track_plays_on_without_holes_and_joined_takes_follow_each_other(tmp_path):
    """Matroska stores times to the millisecond and an AAC frame lasts 21.33 ms: placing each
    frame at its stored time left 29 holes of silence in 1.8 s of a steady tone (clicks in 95 of
    360 5 ms windows after interpolate). A frame stated within 5 ms of where the one before
    ended now follows on. Two MPEG-TS takes joined byte for byte, both timed from 0, play one
    after the other, as their pictures do (the second was laid over the first, then silence)."""
    from clipmill.pipeline.audio import read_sound

    write_with_sound(tmp_path / "steady.mkv", 0, 48000, 440, seconds=2.0)
    sound = read_sound(tmp_path / "steady.mkv", 2.0)
    inside = sound.pcm[0, 4800:-4800]
    assert sound.damaged == 0 and np.count_nonzero(inside == 0) == 0

    write_with_sound(tmp_path / "a.ts", 0, 48000, 440, container="mpegts")
    write_with_sound(tmp_path / "b.ts", 0, 48000, 880, container="mpegts")
    joined = tmp_path / "joined.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    assert len(decode(joined)[0]) == 48  # the pictures, in stored order
    sound = read_sound(joined, 2.0)
    hz = [_peak_hz(sound.pcm[0], 48000, t) for t in (0.25, 0.75, 1.25, 1.75)]
    assert all(abs(h - want) < 15 for h, want in zip(hz, (440, 440, 880, 880))), hz
    assert (np.abs(sound.pcm[0, 52000:92000]) > 0.1).mean() > 0.5  # the second take is heard


def test_a_track_whose_clock_runs_fast_stays_in_step(tmp_path):
    """Frames of 1024 samples stated 1000 samples apart (an audio clock 2.4% fast against the
    container's): following each on from the one before slid the sound 456 ms late by 19 s. A
    frame stated more than 5 ms before where the one before ended goes where its time says."""
    import av
    from fractions import Fraction

    from clipmill.pipeline.audio import read_sound

    rate = 48000
    with av.open(str(tmp_path / "fast-sound.mkv"), "w") as c:
        v = c.add_stream("libx264", rate=24)
        v.width, v.height, v.pix_fmt = 64, 64, "yuv420p"
        a = c.add_stream("pcm_s16le", rate=rate, layout="mono")
        for k in range(240):
            f = av.VideoFrame.from_ndarray(np.zeros((64, 64, 3), np.uint8), format="rgb24")
            f.pts, f.time_base = k, Fraction(1, 24)
            for p in v.encode(f):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        for i in range(480):
            x = np.zeros((1, 1024), np.int16)
            x[0, 0] = 20000 if i % 48 == 0 else 0  # a click every 48 frames, stated at i * 1000 samples
            af = av.AudioFrame.from_ndarray(x, format="s16", layout="mono")
            af.sample_rate, af.pts, af.time_base = rate, i * 1000, Fraction(1, rate)
            for p in a.encode(af):
                c.mux(p)
        for p in a.encode():
            c.mux(p)
    sound = read_sound(tmp_path / "fast-sound.mkv", 10.0)
    clicks = np.flatnonzero(sound.pcm[0] > 0.5)
    late_ms = [(clicks[np.argmin(np.abs(clicks - i * 1000))] - i * 1000) / rate * 1000 for i in range(0, 480, 48)]
    assert len(clicks) == 10 and max(abs(ms) for ms in late_ms) < 5, late_ms
