"""QC's boiling test on the independent boiling set (qc/boil_set.py): grainy good footage against
faint boiling, through real H.264, on seeds the thresholds were never looked at with."""

from __future__ import annotations

import pytest
import numpy as np

from clipmill.pipeline.synthetic import camera_move, photo
from clipmill.qc import QCConfig, check_frames
from clipmill.qc.bench import boiling_confusion
from clipmill.qc.boil_set import TEST_SEEDS, TUNE_SEEDS, bandpass_noise, make_boil_set


def _h264(frames: np.ndarray, fps: float) -> np.ndarray:
    """Float frames through H.264 and back, as viewers get them."""
    import os
    import tempfile

    from clipmill.pipeline.video import decode, encode_h264

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "clip.mp4")
        encode_h264(np.clip(frames, 0, 255).astype(np.uint8), fps, path)
        return decode(path)[0]


def _shape_boiling(spec, seed: int, noise: float, level: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """A shapes-world clip (64 px, 8 frames at 8 fps) with sensor noise, and its twin whose shape
    re-rolls band-pass texture (``level`` luma std, ``scale`` px) every frame: both through H.264."""
    from clipmill.pipeline import shapes

    clip = shapes.render(spec, seed, frames=8, size=64)
    rng = np.random.default_rng(5)
    base = clip.frames.astype(np.float32) + rng.normal(0, noise, clip.frames.shape)
    boiling = base.copy()
    for i in range(len(boiling)):
        boiling[i] += (level * clip.alpha[i] * bandpass_noise((64, 64), scale, rng))[..., None]
    return _h264(base, 8.0), _h264(boiling, 8.0)


@pytest.mark.slow
def test_boiling_set_on_unseen_seeds():
    """On TEST_SEEDS (20 scenes, a good and a boiling clip each): at most 5% of grainy good clips
    rejected, at least 90% of boiling clips caught, where the old test caught almost none.
    (On the larger held-out range 13000-13079 the catch rate is 90%: boiling on a moving object
    only is the weak spot; see README.)"""
    assert not set(TEST_SEEDS) & set(TUNE_SEEDS)
    clips = make_boil_set(TEST_SEEDS)
    conf = boiling_confusion(seeds=TEST_SEEDS, clips=clips)
    assert conf["good_false_reject"] <= 0.05, conf["misses"]
    assert conf["catch_rate"] >= 0.9, conf["misses"]
    old = boiling_confusion(QCConfig(boiling_excess=1e9), seeds=TEST_SEEDS, clips=clips)
    assert old["catch_rate"] <= 0.2


def test_band_energy_at_an_edge_counts_what_does_not_follow_it():
    """A residual that varies across an edge only (the same edge placed 0.4 px apart: sub-pixel
    placement, an interpolation ghost) hardly counts at the edge; texture that re-rolls there
    (band-pass noise, varying every way) keeps its energy; away from edges nothing changes.
    The edge is slanted (30 degrees) and coloured, and its direction comes from luma and the
    three colour channels, as in ``boiling_map``."""
    import cv2

    from clipmill.qc import metrics

    def band(r):
        return cv2.GaussianBlur(r, (0, 0), metrics.BOIL_FINE) - cv2.GaussianBlur(r, (0, 0), metrics.BOIL_COARSE)

    yy, xx = np.mgrid[0:128, 0:128].astype(np.float32)
    across = (xx - 64) * np.cos(np.pi / 6) + (yy - 64) * np.sin(np.pi / 6)  # distance from the edge, px

    def frame(offset):  # a red-on-blue edge, as RGB float32
        s = np.clip(across - offset, -1, 1)
        return np.dstack([128 + 80 * s, 100 + 10 * s, 140 - 60 * s]).astype(np.float32)

    to_luma = np.array([0.299, 0.587, 0.114], np.float32)
    rgb = frame(0.0)
    luma = rgb @ to_luma
    tensor = tuple(t + c for t, c in zip(metrics.structure_tensor(cv2.GaussianBlur(luma, (0, 0), 3.0)),
                                         metrics.colour_gradients(rgb).tensor))
    box = (metrics.BOIL_WINDOW, metrics.BOIL_WINDOW)
    near = (np.abs(across) < 3) & (np.abs(xx - 64) < 30) & (np.abs(yy - 64) < 30)
    far = (across < -25) & (xx > 8) & (yy > 8)
    misplaced = band(luma - frame(0.4) @ to_luma)
    plain, iso = cv2.blur(misplaced**2, box), metrics._isotropic_band(misplaced, tensor, box)
    assert iso[near].mean() < 0.1 * plain[near].mean()
    texture = band(4.0 * bandpass_noise((128, 128), 1.5, np.random.default_rng(3)))
    plain, iso = cv2.blur(texture**2, box), metrics._isotropic_band(texture, tensor, box)
    assert iso[near].mean() > 0.7 * plain[near].mean()
    assert np.allclose(iso[far], plain[far], rtol=0.02)


def test_heavy_grain_passes_and_faint_boiling_in_a_region_is_named():
    rng = np.random.default_rng(11)
    clean = camera_move(photo("coffee"), "static", 24, (256, 144), rng).astype(np.float32)
    grainy = np.clip(clean + rng.normal(0, 6.0, clean.shape), 0, 255).astype(np.uint8)  # heavy grain
    assert check_frames(grainy, 24).verdict == "pass"
    boiling = clean + rng.normal(0, 1.0, clean.shape)
    yy, xx = np.mgrid[0:144, 0:256]
    region = (((yy - 60) / 40) ** 2 + ((xx - 150) / 60) ** 2 < 1).astype(np.float32)  # about 20% of the frame
    for i in range(len(boiling)):
        boiling[i] += (5.0 * region * bandpass_noise((144, 256), 1.5, rng))[..., None]
    res = check_frames(np.clip(boiling, 0, 255).astype(np.uint8), 24)
    assert res.verdict == "reject"
    assert res.reasons[0].startswith("boiling: frames 0-23 (fine texture re-rolls"), res.reasons
    assert res.metrics["boiling"] > QCConfig().boiling_excess


def test_a_small_shape_boiling_inside_is_caught_though_its_outline_is_near(monkeypatch):
    """A yellow square 15 px across, still in a static shot over black stripes (64 px, 8 fps, H.264),
    its inside re-rolling by 10 levels every frame. Every window over it also holds its strong
    outline, whose edge allowance excused the whole inside: the measure read -0.06. The same
    measure over the pixels away from strong edges (metrics.BOIL_STRONG_EDGE) finds it; the clip
    without the boiling passes."""
    from clipmill.pipeline import shapes
    from clipmill.qc import metrics

    good, bad = _shape_boiling(shapes.Spec("yellow", "square", "stays still", "black", "static shot"), 31,
                               noise=2.5, level=10.0, scale=2.0)
    assert check_frames(good, 8).verdict == "pass"
    res = check_frames(bad, 8)
    assert res.verdict == "reject" and res.reasons[0].startswith("boiling: frames 0-7 (fine texture"), res.reasons
    assert res.metrics["boiling"] > 2.5
    monkeypatch.setattr(metrics, "BOIL_INSIDE_SHARE", 2.0)  # the inside never measured: the test before
    monkeypatch.setattr(metrics, "BOIL_INSIDE_MIN_PX", 10**9)  # nor any interior whole
    assert check_frames(bad, 8).metrics["boiling"] < 0.5


def test_a_small_coloured_shape_boiling_is_not_excused_by_its_colour_edges(monkeypatch):
    """A blue triangle moving left on black under a zoom in (64 px, 8 fps, H.264: the boil set's
    seed 41069), its inside re-rolling by 9 levels every frame. Its colour edges (blue on black:
    a strong colour edge, a weak luma one), counted whole and averaged over the window, excused
    nearly the whole shape: it read 0.2-1.7 (by x264's run) against the limit 1.5. Counted at
    BOIL_COLOUR_EDGE (half) it reads about 7; the clip without the boiling still passes."""
    from clipmill.pipeline import shapes
    from clipmill.qc import metrics

    good, bad = _shape_boiling(shapes.Spec("blue", "triangle", "moves left", "black", "zoom in"), 7,
                               noise=1.5, level=9.0, scale=1.7)
    assert check_frames(good, 8).verdict == "pass"
    res = check_frames(bad, 8)
    assert res.verdict == "reject" and res.reasons[0].startswith("boiling: frames 0-7 (fine texture"), res.reasons
    assert res.metrics["boiling"] > 4
    monkeypatch.setattr(metrics, "BOIL_COLOUR_EDGE", 1.0)  # the colour edges counted whole: the test before
    assert check_frames(bad, 8).metrics["boiling"] < res.metrics["boiling"] / 3


def test_a_small_shapes_interior_is_measured_whole(monkeypatch):
    """The boil set's seed 61058 (a 64 px shape moving up under a zoom in, 24 fps, CRF 23), its
    inside re-rolling by about 7 levels every frame. Its interior away from strong edges is a
    few px across, under BOIL_INSIDE_SHARE of every window, so neither window measure counted it
    (0.2-0.3 against the limit 1.5). Each interior is now also measured whole (``_interiors``):
    about 3.7. The clip without the boiling, with grain, still passes."""
    from clipmill.qc import metrics
    from clipmill.qc.boil_set import make_pair

    good, bad = make_pair(61058)
    assert (bad.label, bad.meta["region"]) == ("boiling", "object")
    assert check_frames(good.frames, good.fps).verdict == "pass"
    res = check_frames(bad.frames, bad.fps)
    assert res.verdict == "reject" and res.reasons[0].startswith("boiling: frames"), res.reasons
    assert res.metrics["boiling"] > 2.5
    monkeypatch.setattr(metrics, "BOIL_INSIDE_MIN_PX", 10**9)  # no interior measured whole: the test before
    assert check_frames(bad.frames, bad.fps).metrics["boiling"] < 1.0


def test_an_object_luma_does_not_show_is_not_boiling():
    """A green circle on mid-grey checks has about the grey's luma: the luma flow cannot follow
    it, and the frames interpolated to 30 fps leave a faint residual at its edge. Colour edges
    excuse it (before they did, this clip read 3.8 against the limit 2.6)."""
    from clipmill.pipeline import shapes
    from clipmill.pipeline.interpolate import interpolate

    clip = shapes.render(shapes.Spec("green", "circle", "moves down", "grey", "static shot"), 5023)
    res = check_frames(interpolate(clip.frames, shapes.FPS, 30), 30, QCConfig())
    assert res.verdict == "pass", res.reasons
    assert res.metrics["boiling"] < QCConfig().boiling_excess


def test_the_boiling_flow_follows_a_shape_of_its_backgrounds_luma(tmp_path, monkeypatch):
    """A green square on mid-grey checks under a zoom in, 8 -> 30 fps and H.264, as the post stage
    makes it: the luma flow does not follow the square, and its edges read as boiling (7.0
    against the limit 2.6 when found; 5 of 96 of the generator's clips were rejected so). The
    boiling flow now also follows the chroma where that explains the frames better
    (pipeline.flow.colour_flow): it read 0.1-0.7 by x264's run, 0.9-1.3 since the colour edges'
    allowance counts half (metrics.BOIL_COLOUR_EDGE; a quarter: 2.1). The same clip with texture
    re-rolling on the square is caught (7.6; with the luma flow alone the clean clip and a twin
    with 6 levels of such texture read alike, 7.0 and 6.8)."""
    from clipmill.jobs.runner.stages import decode, encode_h264
    from clipmill.pipeline import shapes
    from clipmill.pipeline.interpolate import interpolate
    from clipmill.qc import metrics

    spec = shapes.Spec("green", "square", "moves down", "grey", "zoom in")
    clip = shapes.render(spec, 1033)

    def post(frames, name):
        path = str(tmp_path / name)
        encode_h264(interpolate(frames, shapes.FPS, 30), 30, path)
        return check_frames(*decode(path), QCConfig())

    res = post(clip.frames, "good.mp4")
    assert res.verdict == "pass", res.reasons
    with monkeypatch.context() as m:
        m.setattr(metrics, "BOIL_CHROMA_FLOW", False)
        assert post(clip.frames, "luma.mp4").metrics["boiling"] > QCConfig().boiling_excess
    rng = np.random.default_rng(5)
    boiling = clip.frames.astype(np.float32)
    for i in range(len(boiling)):  # 8 luma levels (std) of fine texture re-drawn on the square every frame
        boiling[i] += (8.0 * clip.alpha[i] * bandpass_noise(clip.alpha[i].shape, 1.0, rng))[..., None]
    res = post(np.clip(boiling, 0, 255).astype(np.uint8), "boiling.mp4")
    assert res.verdict == "reject" and any(r.startswith("boiling") for r in res.reasons), res.reasons


def test_the_other_frames_colour_edges_are_warped_onto_the_first(monkeypatch):
    """Under a camera move the allowance for the second frame's colour edges lies where its
    content lies in the residual, not where it sat in its own frame. A pan of 16 px, and an edge
    map of the second frame over the content of a patch that boils in the first: the patch is
    excused, and the place those edges held in the second frame's own coordinates is left as
    it was (before the fifteenth session the allowance landed there instead). The allowance is
    the window measure's; the measure away from strong edges (step 5 of ``boiling_map``, which
    takes no edge maps) is left out here."""
    from clipmill.pipeline.flow import FlowEstimator
    from clipmill.qc import metrics
    from clipmill.qc.metrics import boiling_map

    monkeypatch.setattr(metrics, "BOIL_INSIDE_SHARE", 2.0)
    monkeypatch.setattr(metrics, "BOIL_INSIDE_MIN_PX", 10**9)  # nor shapes' interiors whole

    rng = np.random.default_rng(5)
    scene = photo("coffee")[:144, :272].astype(np.float32)
    gray = scene @ np.array([0.299, 0.587, 0.114], np.float32)
    a, b = gray[:, 16:272].copy(), gray[:, 0:256].copy()  # b(x + 16) = a(x): the view moved left
    a[40:80, 100:140] += 6.0 * bandpass_noise((40, 40), 1.5, rng)  # texture that is not in b
    edges_b = np.zeros_like(a)
    edges_b[40:80, 116:156] = 400.0 / metrics.BOIL_COLOUR_EDGE  # b's edges over that patch's content, in b's coordinates
    flow = FlowEstimator("fast")
    none = boiling_map(a, b, flow, (np.zeros_like(a), np.zeros_like(a)))
    warped = boiling_map(a, b, flow, (np.zeros_like(a), edges_b))
    patch, own_place = (slice(50, 70), slice(102, 112)), (slice(50, 70), slice(148, 156))
    assert np.nanmean(none[patch]) > QCConfig().boiling_excess
    assert np.nanmean(warped[patch]) < np.nanmean(none[patch]) - 10
    assert np.allclose(warped[own_place], none[own_place], equal_nan=True)


def _fast_pan(px_per_frame: int, n: int = 24, size: int = 256) -> np.ndarray:
    """Gravel (fine texture everywhere) magnified 1.5x, the view sliding ``px_per_frame`` a frame."""
    import cv2

    img = cv2.resize(photo("gravel"), None, fx=1.5, fy=1.5, interpolation=cv2.INTER_LINEAR)
    return np.stack([img[100:100 + size, 10 + px_per_frame * i:10 + px_per_frame * i + size] for i in range(n)])


def test_a_fast_pan_over_fine_texture_is_not_boiling():
    """At 10 px/frame the boiling pair (3 frames apart at 24 fps) would be 30 px apart, further
    than the flow holds fine texture: its residual read 7.0 against the limit 2.6. Under a fast
    move the pair is taken nearer (BOIL_MAX_SHIFT), and fresh band-pass texture in a region of
    the same pan is still caught."""
    from clipmill.qc.metrics import BOIL_MAX_SHIFT, measure

    frames = _fast_pan(10)
    s = measure(frames, fps=24)
    assert s.boil_gap.tolist() == [1] * len(s.boil_gap)  # 10 px a frame: 16 // 10
    assert BOIL_MAX_SHIFT == 16.0
    res = check_frames(frames, 24)
    assert res.verdict == "pass", res.reasons
    assert measure(_fast_pan(4), fps=24).boil_gap.tolist() == [3] * 12  # slow enough: 0.125 s apart

    rng = np.random.default_rng(5)
    boiling = frames.astype(np.float32)
    yy, xx = np.mgrid[0:256, 0:256]
    region = (((yy - 120) / 60) ** 2 + ((xx - 130) / 70) ** 2 < 1).astype(np.float32)
    for i in range(len(boiling)):
        boiling[i] += (6.0 * region * bandpass_noise((256, 256), 1.5, rng))[..., None]
    res = check_frames(np.clip(boiling, 0, 255).astype(np.uint8), 24)
    assert res.verdict == "reject" and res.reasons[0].startswith("boiling:"), res.reasons


def test_the_chroma_image_is_centred_on_the_pairs_own_colour():
    """A tinted pair (an iso-luminant square on a green-tinted background, moved 4 px) keeps its
    square in the chroma image the colour flow follows; stretched about neutral grey it clipped
    to one level, and the flow had nothing to follow. The chroma flow then explains the move."""
    import cv2

    from clipmill.pipeline.flow import FlowEstimator, chroma_pair, colour_flow, warp

    rng = np.random.default_rng(5)

    def frame(x0: int) -> np.ndarray:
        f = np.empty((72, 128, 3), np.float32)
        f[:] = (70, 150, 70)
        f[28:48, x0:x0 + 20] = (92, 140, 70)  # about the background's luma, another chroma
        f += rng.normal(0, 2, (72, 128, 1))  # luma grain: the luma flow has nothing else to follow
        return np.clip(f, 0, 255).astype(np.uint8)

    a, b = frame(40), frame(44)
    la, lb, ca, cb = chroma_pair(a, b)
    assert ca.min() < 100 and ca.max() > 110 and abs(float(np.median(ca)) - 128) < 30  # two levels, not one clipped
    fl = FlowEstimator("fast")
    luma = fl(cv2.cvtColor(a, cv2.COLOR_RGB2GRAY), cv2.cvtColor(b, cv2.COLOR_RGB2GRAY))
    both = colour_flow(fl, a, b, luma)
    ring = np.zeros((72, 128), bool)
    ring[24:52, 36:68] = True
    res = lambda f: float(np.abs(la - warp(lb, f))[..., 1:].sum(-1)[ring].mean())  # noqa: E731
    assert res(both) < 0.5 * res(luma)
    with pytest.raises(ValueError, match="must be uint8 RGB"):
        chroma_pair(a.astype(np.float32), b)
