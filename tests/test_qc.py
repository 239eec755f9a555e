"""QC, first version, on synthetic good and broken clips written as real H.264 files."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
from click.testing import CliRunner
from skimage import data

from jobs.cli import main
from pipeline.video import encode_h264
from qc import check_frames


def photo(h=144, w=256):
    img = data.astronaut()  # a real photograph shipped with scikit-image
    return cv2.resize(img, (w * 2, h * 2), interpolation=cv2.INTER_AREA)


def pan(n=48, step=3, h=144, w=256):
    big = photo(h, w)
    return np.stack([big[h // 2 : h // 2 + h, i * step : i * step + w] for i in range(n)])


def good_clips():
    base = pan()
    static = np.repeat(base[:1], 48, axis=0)  # a static product shot is legitimate
    rng = np.random.default_rng(1)
    noisy = np.clip(base.astype(int) + rng.normal(0, 2, base.shape), 0, 255).astype(np.uint8)
    return {"pan": base, "static": static, "sensor-noise": noisy}


def bad_clips():
    base = pan()
    black = base.copy()
    black[20:26] = 0
    frozen = base.copy()
    frozen[10:34] = frozen[10]
    flicker = base.astype(int)
    flicker[::2] += 40
    garbage = base.copy()
    garbage[30] = np.random.default_rng(0).integers(0, 256, garbage[30].shape, dtype=np.uint8)
    flat = np.full_like(base, 128)
    return {
        "black": (black, "black"),
        "frozen": (frozen, "frozen"),
        "flicker": (np.clip(flicker, 0, 255).astype(np.uint8), "flicker"),
        "garbage": (garbage, "jump"),
        "flat": (flat, "uniform"),
    }


@pytest.mark.parametrize("name", list(good_clips()))
def test_good_clips_pass(name):
    res = check_frames(good_clips()[name], 24)
    assert res.verdict == "pass", res.reasons


@pytest.mark.parametrize("name", list(bad_clips()))
def test_broken_clips_rejected_with_a_reason_naming_frames(name):
    frames, code = bad_clips()[name]
    res = check_frames(frames, 24)
    assert res.verdict == "reject"
    assert any(r.startswith(f"{code}: frame") for r in res.reasons), res.reasons


def test_reason_names_the_frame_range_and_value():
    frames, _ = bad_clips()["black"]
    res = check_frames(frames, 24)
    assert "black: frames 20-25 (mean luma 0.0 < 16)" in res.reasons
    frames, _ = bad_clips()["frozen"]
    assert "frozen: frames 10-33 (24 identical frames, 1.00 s >= 0.5 s in a moving clip)" in check_frames(frames, 24).reasons


def test_qc_cli_json_lines_on_real_h264_files(tmp_path):
    paths = {}
    for name, frames in good_clips().items():
        paths[name] = tmp_path / f"good-{name}.mp4"
        encode_h264(frames, 24, paths[name])
    for name, (frames, _) in bad_clips().items():
        paths[name] = tmp_path / f"bad-{name}.mp4"
        encode_h264(frames, 24, paths[name])
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    args = [str(p) for p in paths.values()] + [str(tmp_path / "broken.mp4")]
    res = CliRunner().invoke(main, ["qc", "--json", *args])
    assert res.exit_code == 1  # one unreadable file
    lines = [json.loads(line) for line in res.output.splitlines()]
    assert [line["path"] for line in lines] == args
    for line in lines:
        assert set(line) == {"path", "verdict", "reasons", "metrics"}
        assert line["verdict"] in ("pass", "reject")
        name = line["path"].rsplit("/", 1)[-1]
        if name.startswith("good-"):
            assert line["verdict"] == "pass", line
            assert line["metrics"]["frames"] == 48 and line["metrics"]["fps"] == 24
        else:
            assert line["verdict"] == "reject", line
    assert lines[-1]["reasons"][0].startswith("unreadable: ")
