"""Local storage writes atomically and refuses escaping keys; retiming keeps the duration."""

from __future__ import annotations

import os

import numpy as np
import pytest

from clipmill.pipeline.retime import output_count, retime_linear
from clipmill.pipeline.video import VideoError, decode, encode_h264, probe
from clipmill.storage import LocalStorage, StorageError, open_storage


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


def _mpeg_ts(frames: np.ndarray, path) -> None:
    """An MPEG-2 transport stream: a format whose files can be joined byte for byte."""
    import av

    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg2video", rate=24)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def test_a_stream_whose_frame_size_changes_is_refused_by_name(tmp_path):
    """Two clips of different sizes joined into one stream: a clear error, not a numpy crash."""
    rng = np.random.default_rng(0)
    _mpeg_ts(rng.integers(0, 255, (10, 64, 96, 3), dtype=np.uint8), tmp_path / "a.ts")
    _mpeg_ts(rng.integers(0, 255, (10, 80, 128, 3), dtype=np.uint8), tmp_path / "b.ts")
    joined = tmp_path / "ab.ts"
    joined.write_bytes((tmp_path / "a.ts").read_bytes() + (tmp_path / "b.ts").read_bytes())
    first, _ = decode(tmp_path / "a.ts")
    assert first.shape[1:] == (64, 96, 3)
    with pytest.raises(VideoError) as e:
        decode(joined)
    msg = str(e.value)
    assert msg.startswith(f"{joined}: frame ") and "is 128x80 but frame 0 is 96x64; a clip must keep one frame size" in msg
