"""Local storage writes atomically and refuses escaping keys; retiming keeps the duration."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from clipmill.pipeline.retime import output_count, retime_linear
from clipmill.pipeline.video import VideoError, constant_rate, decode, encode_h264, probe
from clipmill.storage import LocalStorage, StorageError, open_storage
from media import write_video


def test_put_get_delete_and_no_temp_files_left(tmp_path):
    st = LocalStorage(tmp_path)
    loc = st.put_bytes("b/1/a1.json", b"{}")
    assert loc == str(tmp_path / "b" / "1" / "a1.json")
    assert st.get_bytes("b/1/a1.json") == b"{}" and st.exists("b/1/a1.json")
    st.put_bytes("b/1/a1.json", b"{\"v\": 2}")  # overwrite in place
    assert st.get_bytes("b/1/a1.json") == b"{\"v\": 2}"
    assert os.listdir(tmp_path / "b" / "1") == ["a1.json"]
    st.delete("b/1/a1.json")
    st.delete("b/1/a1.json")  # missing is fine
    assert not st.exists("b/1/a1.json")


def test_failed_write_leaves_old_file_and_no_temp(tmp_path):
    st = LocalStorage(tmp_path)
    st.put_bytes("k/x.bin", b"old")

    def boom(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        st._write("k/x.bin", boom)
    assert st.get_bytes("k/x.bin") == b"old"
    assert os.listdir(tmp_path / "k") == ["x.bin"]


def test_atomic_writes_keep_links_modes_and_long_names(tmp_path):
    """One mechanism (``replacing``) writes clips, sidecars, sheets and checkpoints: a name near
    the 255-byte limit writes (``write_atomic``'s temporary name was the target's plus 13
    characters: ENAMETOOLONG), a link keeps linking to the file it names, which is replaced,
    and the file gets the mode a plain ``open`` gives it (the umask's), not ``mkstemp``'s 0600.
    ``write_atomic`` (storage keys, sheets, markers) replaces a link instead, as it did."""
    from clipmill.storage.local import replacing, write_atomic

    long = tmp_path / ("n" * 250 + ".json")
    write_atomic(long, lambda f: f.write(b"{}"))
    assert long.read_bytes() == b"{}" and os.listdir(tmp_path) == [long.name]

    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "x.mp4").write_bytes(b"old")
    link = tmp_path / "x.mp4"
    link.symlink_to(tmp_path / "real" / "x.mp4")
    old = os.umask(0o027)
    try:
        with replacing(link) as tmp:
            assert tmp.parent == tmp_path / "real" and len(tmp.name) < 80
            tmp.write_bytes(b"new")
    finally:
        os.umask(old)
    assert link.is_symlink() and link.read_bytes() == b"new"
    assert (tmp_path / "real" / "x.mp4").stat().st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path / "real")) == ["x.mp4"]
    with pytest.raises(FileNotFoundError):  # a block that wrote nothing replaces nothing
        with replacing(link):
            pass
    assert link.read_bytes() == b"new"
    write_atomic(link, lambda f: f.write(b"stored"))  # storage replaces a link, never writes through it
    assert not link.is_symlink() and link.read_bytes() == b"stored"
    assert (tmp_path / "real" / "x.mp4").read_bytes() == b"new"


@pytest.mark.parametrize("key", ["../etc/passwd", "/abs", "a//b", "a/./b", "", "a\\b"])
def test_bad_keys_are_refused(tmp_path, key):
    with pytest.raises(StorageError):
        LocalStorage(tmp_path).put_bytes(key, b"x")


def test_unknown_url_scheme_is_refused():
    with pytest.raises(StorageError, match="ftp:// storage is not supported; give a local folder or s3://bucket/prefix"):
        open_storage("ftp://host/x")


@pytest.mark.parametrize("n, fin, fout, want", [(16, 24, 30, 20), (16, 24, 60, 39), (16, 30, 60, 31), (10, 24, 25, 10), (16, 24, 24, 16)])
def test_retime_frame_count_and_endpoints(n, fin, fout, want):
    frames = (np.arange(n)[:, None, None, None] * 10 + np.zeros((1, 4, 4, 3))).astype(np.uint8)
    out = retime_linear(frames, fin, fout)
    assert len(out) == want == output_count(n, fin, fout)
    assert np.array_equal(out[0], frames[0])
    if ((n - 1) * fout) % fin == 0:  # the last output time falls on the last input frame
        assert np.array_equal(out[-1], frames[-1])
    assert np.all(np.diff(out[:, 0, 0, 0].astype(int)) >= 0)


def test_h264_round_trip(tmp_path):
    frames = np.random.default_rng(0).integers(0, 255, (12, 64, 96, 3), dtype=np.uint8)
    encode_h264(frames, 30, tmp_path / "x.mp4")
    info = probe(tmp_path / "x.mp4")
    assert (info["codec"], info["pix_fmt"], info["frames"], info["width"], info["height"]) == ("h264", "yuv420p", 12, 96, 64)
    back, fps = decode(tmp_path / "x.mp4")
    assert back.shape == frames.shape and fps == 30
    with pytest.raises(ValueError, match="odd side"):
        encode_h264(frames[:, :63], 30, tmp_path / "odd.mp4")


def test_a_stream_whose_frame_size_changes_is_refused_by_name(tmp_path):
    """Two clips of different sizes joined into one stream: a clear error, not a numpy crash."""
    rng = np.random.default_rng(0)
    write_video(tmp_path / "a.ts", rng.integers(0, 255, (10, 64, 96, 3), dtype=np.uint8), codec="mpeg2video")
    write_video(tmp_path / "b.ts", rng.integers(0, 255, (10, 80, 128, 3), dtype=np.uint8), codec="mpeg2video")
    joined = tmp_path / "ab.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    first, _ = decode(tmp_path / "a.ts")
    assert first.shape[1:] == (64, 96, 3)
    with pytest.raises(VideoError) as e:
        decode(joined)
    msg = str(e.value)
    assert msg.startswith(f"{joined}: frame ") and "is 128x80 but frame 0 is 96x64; a clip must keep one frame size" in msg


def _mp4(path, frames: np.ndarray, pts_ms: list[int] | None = None, rate: int = 30, container: str = "mp4",
         codec: str = "libx264") -> None:
    """H.264 in MP4 (or ``codec`` in ``container``) with the given timestamps in milliseconds
    (by default one frame a tick)."""
    write_video(path, frames, rate, codec, container, pts_ms=pts_ms or [round(i * 1000 / rate) for i in range(len(frames))])


def _numbered(n: int, h: int = 64, w: int = 96) -> np.ndarray:
    """Frames whose mean level says which they are: frame i is flat at 20 + 10 i."""
    return np.stack([np.full((h, w, 3), 20 + 10 * i, np.uint8) for i in range(n)])


def test_a_variable_rate_hold_decodes_as_the_repeated_frames_a_viewer_sees(tmp_path):
    """A variable-rate file stores a held picture once, shown until the next timestamp (screen and
    phone recorders, ffmpeg -vsync vfr). Decoded, it repeats on the grid of the rate its other
    frames keep, as the same hold stored frame by frame does: QC reads the freeze, and
    interpolation keeps the timing. A constant-rate file comes back exactly as stored."""
    frames = _numbered(10)
    pts = [round(i * 1000 / 30) for i in range(5)] + [round((i + 15) * 1000 / 30) for i in range(5, 10)]  # frame 4 held 0.5 s
    _mp4(tmp_path / "vfr.mp4", frames, pts)
    got, fps = decode(tmp_path / "vfr.mp4")
    assert fps == 30 and len(got) == 25, (fps, len(got))
    levels = [round(float(f.mean()) / 10) * 10 - 20 for f in got]
    assert levels == [0, 10, 20, 30] + [40] * 16 + [50, 60, 70, 80, 90], levels
    _mp4(tmp_path / "cfr.mp4", frames)
    got, fps = decode(tmp_path / "cfr.mp4")
    assert len(got) == 10 and abs(fps - 30) < 0.01  # the average rate, as before (millisecond timestamps)
    assert [round(float(f.mean()) / 10) * 10 - 20 for f in got] == list(range(0, 100, 10))
    # the pure part: no times, or one frame a tick (within half a tick), is left alone
    assert constant_rate([None, None, None]) is None
    assert constant_rate([0.0, 0.034, 0.066, 0.1], (30.0,)) is None
    assert constant_rate([0.0, 1 / 30, 2 / 30, 4 / 30], (30.0,)) == ([0, 1, 2, 2, 3], 30.0)


def test_qc_reads_a_variable_rate_freeze_as_frozen(tmp_path):
    """The same 2.5 s pan that stops for 1 s, stored frame by frame and as one held frame: QC
    rejects both as frozen (it passed the held one, reading its average rate as the clip's)."""
    from clipmill.pipeline.synthetic import camera_move, photo
    from clipmill.qc import QCConfig, check_frames

    pan = camera_move(photo("astronaut"), "pan", 45, (192, 128), np.random.default_rng(1), speed=2.0)
    stored = np.concatenate([pan[:20], np.repeat(pan[19:20], 30, axis=0), pan[20:]])
    _mp4(tmp_path / "cfr.mp4", stored)
    _mp4(tmp_path / "vfr.mp4", pan, [round(i * 1000 / 30) for i in range(20)] + [round((i + 30) * 1000 / 30)
                                                                                  for i in range(20, 45)])
    for name in ("cfr.mp4", "vfr.mp4"):
        got, fps = decode(tmp_path / name)
        assert len(got) == 75 and abs(fps - 30) < 0.01, (name, len(got), fps)
        v = check_frames(got, fps, QCConfig())
        assert v.verdict == "reject" and any(r.startswith("frozen: frames 19-") for r in v.reasons), (name, v.reasons)


def test_what_is_not_a_clip_is_refused_by_name(tmp_path):
    """A still picture renamed .mp4, an audio file's cover picture, and a clip of one frame when
    frames are to be compared: VideoError naming the file and why (QC passed all three)."""
    import av
    import cv2

    png = tmp_path / "photo.mp4"
    png.write_bytes(cv2.imencode(".png", _numbered(1)[0])[1].tobytes())
    with pytest.raises(VideoError, match=rf"^{png}: a still picture \(png_pipe\), not a video$"):
        decode(png)
    song = tmp_path / "song.mp4"
    with av.open(str(song), "w", format="mp4") as c:
        a = c.add_stream("aac", rate=44100)
        cover = c.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 64, 64, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        for p in cover.encode(av.VideoFrame.from_ndarray(_numbered(1, 64, 64)[0], format="rgb24")):
            c.mux(p)
        for p in cover.encode():
            c.mux(p)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 44100
        for p in a.encode(frame):
            c.mux(p)
        for p in a.encode():
            c.mux(p)
    with pytest.raises(VideoError, match=rf"^{song}: it has no video stream, only a cover picture$"):
        decode(song)
    _mp4(tmp_path / "one.mp4", _numbered(1))
    assert len(decode(tmp_path / "one.mp4")[0]) == 1
    with pytest.raises(VideoError, match=r"one.mp4: it has 1 frame; at least 2 are needed \(frames are compared"):
        decode(tmp_path / "one.mp4", min_frames=2)


def test_a_portrait_clip_stored_on_its_side_decodes_upright(tmp_path):
    """A phone stores a portrait clip as landscape frames and a 90-degree display matrix; players
    turn it upright, and so does decode (QC's sheet and interpolation's output were sideways)."""
    frames = np.zeros((4, 64, 96, 3), np.uint8)
    frames[:, :16, :16] = (255, 0, 0)  # a red corner at the stored frame's top left
    _mp4(tmp_path / "side.mp4", frames)
    data = bytearray((tmp_path / "side.mp4").read_bytes())
    i = data.find(b"tkhd")
    version = data[i + 4]
    matrix = i + 4 + 4 + (8 if version == 0 else 16) + 4 + 4 + (4 if version == 0 else 8) + 8 + 2 + 2 + 2 + 2
    data[matrix:matrix + 36] = struct.pack(">9I", 0, 0x10000, 0, (-0x10000) & 0xFFFFFFFF, 0, 0, 0, 0, 0x40000000)
    (tmp_path / "side.mp4").write_bytes(bytes(data))  # QuickTime's "rotate 90 clockwise", as iPhones write
    got, _ = decode(tmp_path / "side.mp4")
    assert got.shape == (4, 96, 64, 3)
    assert got[0, :16, -16:, 0].mean() > 200 and got[0, :16, :16, 0].mean() < 50  # the corner is now top right


def test_local_names_with_a_colon_and_the_index_first(tmp_path):
    """A file named like an ISO time is a file, not a URL (FFmpeg read 'take1:' as a protocol);
    encode_h264 writes the index (moov) before the media (mdat), so a browser plays at once."""
    path = tmp_path / "2024-05-01T12:30:00.mp4"
    encode_h264(_numbered(6), 24, path)
    assert len(decode(path)[0]) == 6 and probe(path)["frames"] == 6
    data = path.read_bytes()
    assert 0 < data.find(b"moov") < data.find(b"mdat"), "the index is not at the start"


FULL_DISK = """
import resource, signal, sys
import numpy as np
from clipmill.pipeline.video import encode_h264
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
frames = np.random.default_rng(0).integers(0, 255, (24, 128, 128, 3), dtype=np.uint8)
try:
    encode_h264(frames, 24, sys.argv[1])
except OSError as e:
    print("OSError", e.errno)
"""


def test_a_failed_encode_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    """encode_h264 writes through a temporary file renamed over the target: a write that fails
    part way (a file-size limit standing in for a full disk) raises OSError, and the old clip
    is as it was, with nothing else left in the folder; through a link, the link's target is
    what is replaced; a name near the 255-byte limit still has room for the temporary one."""
    import subprocess
    import sys

    path = tmp_path / "clip.mp4"
    encode_h264(_numbered(4), 24, path)
    old = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "OSError 27", proc.stdout + proc.stderr  # EFBIG
    assert path.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]
    link = tmp_path / "latest.mp4"
    link.symlink_to(path)
    encode_h264(_numbered(6), 24, link)
    assert link.is_symlink() and len(decode(path)[0]) == 6
    long = tmp_path / ("x" * 250 + ".mp4")
    encode_h264(_numbered(4), 24, long)
    assert len(decode(long)[0]) == 4


@pytest.mark.parametrize("rate", [60, 75, 120, 240])
def test_constant_rate_files_with_millisecond_timestamps_read_as_stored(tmp_path, rate):
    """Rounded timestamps are one frame a tick of the stated rate: nothing repeated or dropped
    (the first check repeated frames of 120 fps Matroska and dropped one of 60 fps)."""
    frames = _numbered(23)
    _mp4(tmp_path / "c.mkv", frames, rate=rate, container="matroska", codec="ffv1")  # whole milliseconds: 8 and 9 ms at 120 fps
    got, fps = decode(tmp_path / "c.mkv")
    assert len(got) == 23 and round(fps) == rate, (len(got), fps)
    assert [round(float(f.mean()) / 10) * 10 - 20 for f in got] == list(range(0, 230, 10))


def test_times_that_go_back_and_a_long_hold_and_an_animated_gif(tmp_path):
    """Two transport streams joined byte for byte (how HLS downloads are saved) go back in time
    half way: read as stored, every frame (the first check dropped half). A hold that would grow
    a file past 4x its frames and 2 GiB is refused by name, not a MemoryError. An animated GIF
    is a clip (a still picture is not)."""
    rng = np.random.default_rng(0)
    write_video(tmp_path / "a.ts", rng.integers(0, 255, (10, 64, 96, 3), dtype=np.uint8), codec="mpeg2video")
    joined = tmp_path / "ab.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() * 2)
    assert len(decode(joined)[0]) == 20
    times = [0.0, 1 / 30, 2 / 30, 3 / 30, 3600.0]  # an hour's hold at 30 fps of 1280x720: 290 GiB
    assert len(constant_rate(times, (30.0,))[0]) == 108_001
    hold = tmp_path / "hold.mp4"
    _mp4(hold, _numbered(5, 720, 1280), [0, 33, 67, 100, 3_600_000])
    with pytest.raises(VideoError, match=r"hold.mp4: a variable-rate file of 5 frames that plays as 10\d{4} at [\d.]+ "
                                         r"fps \(2\d\d\.\d GiB of 1280x720 frames; a long held picture"):
        decode(hold)
    gif = tmp_path / "anim.gif"
    write_video(gif, _numbered(6), rate=10, codec="gif", container="gif", pix_fmt="rgb8")
    assert len(decode(gif, min_frames=2)[0]) == 6


def test_qc_on_a_terminal_that_cannot_show_a_file_name_escapes_it(tmp_path):
    """An ASCII-only terminal (PYTHONIOENCODING=ascii, LANG=C on an old system) and a clip named
    in Chinese: the verdict (flat frames: reject) is printed with the name escaped (it was a UnicodeEncodeError
    traceback, exit 1)."""
    import subprocess
    import sys

    path = tmp_path / "ünï 名前.mp4"
    encode_h264(_numbered(4), 8, path)
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "qc", str(path)], capture_output=True,
                          env=dict(os.environ, PYTHONIOENCODING="ascii"), timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stdout.startswith(b"reject ") and b"\\xfcn\\xef \\u540d\\u524d.mp4\n    flat: " in proc.stdout, proc.stdout
