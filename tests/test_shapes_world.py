"""The shapes world keeps its conventions, and the adherence analyzer reads its clips."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from clipmill.pipeline import shapes
from clipmill.qc import adherence


def _clips(n: int, seed: int, split: str = "all"):
    rng = np.random.default_rng(seed)
    specs = shapes.sample_specs(rng, n, split)  # type: ignore[arg-type]
    return [(s, shapes.render(s, int(rng.integers(2**31)))) for s in specs]


def test_grammar_and_split():
    assert len(shapes.all_specs()) == 900
    assert len(shapes.HELD_OUT) == 20  # of 100 (colour, motion, camera) combinations
    assert len(shapes.split_specs("train")) + len(shapes.split_specs("heldout")) == 900
    held = shapes.split_specs("heldout")
    for attr in ("colour", "motion", "camera"):  # every value is still seen in training
        assert {getattr(s, attr) for s in shapes.split_specs("train")} == set(shapes.VOCAB[attr])
    assert all(shapes.is_held_out(s) for s in held)
    spec = shapes.Spec("red", "circle", "moves left", "black", "pan right")
    assert shapes.caption_en(spec) == "a red circle moves left on a black background, pan right"
    assert shapes.caption_zh(spec) == "红色圆形向左移动，黑色背景，右摇"
    with pytest.raises(ValueError):
        shapes.Spec("purple", "circle", "moves left", "black", "pan right")


def test_render_is_deterministic_and_shaped():
    spec = shapes.Spec("blue", "triangle", "stays still", "beige", "zoom in")
    a, b = shapes.render_clip(spec, 3), shapes.render_clip(spec, 3)
    assert a.shape == (shapes.FRAMES, shapes.SIZE, shapes.SIZE, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, shapes.render_clip(spec, 4))


def test_motion_conventions():
    side = shapes.SIZE
    for spec, clip in _clips(120, 1):
        c = clip.centres
        _, _, z = shapes.view_path(spec.camera, shapes.FRAMES, abs(clip.layout.pan), clip.layout.zoom)
        half = (clip.layout.size * z / 2)[:, None]
        assert (c - half >= 0).all() and (c + half <= side).all(), spec  # stays in frame
        assert clip.alpha.sum(axis=(1, 2)).min() > 20  # the shape is visible in every frame
        if spec.motion != "stays still":
            assert clip.layout.travel >= 0.10 * side
            d = np.array(shapes._DIRECTION[spec.motion])
            assert (c[-1] - c[0]) @ d >= 0.10 * side, spec  # on screen, the same way
        if spec.camera.startswith("pan"):
            assert abs(clip.layout.pan) >= 0.05 * side
            # per frame the background moves less than half the texture's period
            assert abs(clip.layout.pan) / (shapes.FRAMES - 1) < clip.layout.period / 2


def test_pan_right_drifts_background_left_and_zoom_pushes_outward():
    spec = shapes.Spec("red", "square", "stays still", "grey", "pan right")
    clip = shapes.render(spec, 11)
    assert clip.centres[-1, 0] < clip.centres[0, 0] - 0.05 * shapes.SIZE  # fixed to the background
    a = adherence.analyze(clip.frames)
    assert a.pan < -0.05 and a.camera == "pan right"
    spec = shapes.Spec("red", "square", "stays still", "grey", "zoom in")
    for seed in range(20):
        clip = shapes.render(spec, seed)
        off = clip.centres[0] - shapes.SIZE / 2
        if np.abs(off).max() > 8:
            assert np.linalg.norm(clip.centres[-1] - shapes.SIZE / 2) > np.linalg.norm(off) + 2
            return
    pytest.fail("no off-centre still shape in 20 seeds")


def test_colours_apart():
    lab = adherence._lab(np.array([shapes.BACKGROUND_RGB[b] for b in shapes.BACKGROUNDS], np.float32))
    beige, grey = lab[2], lab[1]
    white = adherence._lab(np.array(shapes.COLOUR_RGB["white"], np.float32))
    assert 30 < beige[0] < 80  # a mid-tone
    assert beige[2] > 15 and abs(grey[2]) < 3  # warm (yellow-ward b*), grey is neutral
    assert np.linalg.norm(beige - white) > 25 and np.linalg.norm(beige - grey) > 20
    assert 45 < grey[0] < 60  # mid grey


@pytest.mark.slow
def test_analyzer_reads_the_world(tmp_path):
    from clipmill.pipeline.video import decode, encode_h264

    clips = _clips(200, 2024)
    raw = [adherence.analyze(c.frames) for _, c in clips]
    specs = [s for s, _ in clips]
    acc = adherence.adherence(raw, specs)
    assert min(acc.values()) >= 0.99, acc
    coded = []
    for i, (_, c) in enumerate(clips[:60]):
        encode_h264(c.frames, shapes.FPS, tmp_path / "c.mp4")
        coded.append(adherence.analyze(decode(tmp_path / "c.mp4")[0]))
    acc = adherence.adherence(coded, specs[:60])
    assert min(acc.values()) >= 0.99, acc


def test_analyzer_takes_more_frames_and_larger_sizes():
    import cv2

    spec = shapes.Spec("yellow", "circle", "moves up", "black", "pan left")
    frames = shapes.render_clip(spec, 5)
    up = np.repeat(frames, 3, axis=0)  # 24 fps, frame-repeated
    up = np.stack([cv2.resize(f, (128, 128), interpolation=cv2.INTER_CUBIC) for f in up])
    assert adherence.analyze(up).label() == spec.as_dict()


def test_parse_reads_every_caption_raw_and_cleaned_and_nothing_else():
    from clipmill.jobs.cli.train import clean_caption

    for spec in shapes.all_specs():
        for lang in ("en", "zh"):
            raw = shapes.caption(spec, lang)
            assert shapes.parse(raw) == spec
            assert shapes.parse(clean_caption(raw)) == spec  # the cleaning turns 左摇 into "pan left"
    assert shapes.parse("A Red circle moves left on a black background, pan right.") == shapes.Spec(
        "red", "circle", "moves left", "black", "pan right")
    for other in ("a bowl of ramen on a table, dolly in", "a red circle moves left on a black background",
                  "a purple circle moves left on a black background, pan right", "红色圆形向左移动，黑色背景"):
        assert shapes.parse(other) is None


def test_frechet_and_read_distances_on_known_sets():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 3))
    assert adherence.frechet_distance(x, x) == pytest.approx(0.0, abs=1e-9)
    shift = np.array([1.0, 2.0, 0.0])
    assert adherence.frechet_distance(x, x + shift) == pytest.approx(5.0, abs=1e-6)  # |mu_x - mu_y|^2
    assert adherence.frechet_distance(x, 2 * x) == pytest.approx(3.0, rel=0.05)  # Tr(S + 4S - 2*2S) = 3
    with pytest.raises(ValueError, match="at least 2"):
        adherence.frechet_distance(x[:1], x)
    a = [adherence.analyze(shapes.render(s, 1).frames) for s in shapes.split_specs("train")[:6]]
    assert set(adherence.read_distance(a, a).values()) == {0.0}
    assert adherence.read_distance(a, a[:3] + a[:3])["shape"] >= 0  # defined, within [0, 1]
    same_words = adherence.read_distance(a, list(reversed(a)))  # a reordering draws the same words
    assert set(same_words.values()) == {0.0}


def test_a_clip_played_backwards_shows_its_reversed_spec():
    """``reversed_spec`` is what the analyzer reads in the frames in reverse order: the motion
    and the pan swap direction; a zoom in has no reverse in the grammar."""
    rng = np.random.default_rng(11)
    specs = [s for s in shapes.all_specs() if s.camera != "zoom in"]
    for k in rng.choice(len(specs), 12, replace=False):
        spec = specs[int(k)]
        back = shapes.reversed_spec(spec)
        clip = shapes.render(spec, int(k))
        assert adherence.analyze(clip.frames[::-1].copy()).label() == back.as_dict(), (spec, back)
    assert shapes.reversed_spec(shapes.Spec("red", "circle", "moves up", "grey", "zoom in")) is None
    assert shapes.reversed_spec(shapes.Spec("red", "circle", "moves up", "grey", "pan left")) == shapes.Spec(
        "red", "circle", "moves down", "grey", "pan right")


def test_a_tilt_moves_the_background_vertically_and_stays_out_of_the_grammar():
    """The training-only tilts: a tilt up moves the view up, so the background (and a shape fixed
    to it) drifts down on screen, by 10-14% of the side; the texture is never vertical stripes
    (which a tilt would not move); no tilt is in the grammar, the held-out split or ``parse``."""
    for k, seed in enumerate(range(30)):
        camera = shapes.TILTS[k % 2]
        spec = shapes.Spec("red", "square", "stays still", ("black", "grey", "beige")[k % 3], camera)
        clip = shapes.render(spec, seed)
        drift = clip.centres[-1] - clip.centres[0]
        assert abs(drift[0]) < 1e-3 and (1 if camera == "tilt up" else -1) * drift[1] >= 0.10 * shapes.SIZE, (spec, drift)
        assert clip.layout.texture in ("checks", "noise")
        # per frame the background moves less than half the texture's period
        assert abs(clip.layout.pan) / (shapes.FRAMES - 1) < clip.layout.period / 2
        # the frames themselves shift vertically, the drift's way (phase correlation of the soft
        # textures reads 0.4-1.0 of the true shift; the noise texture the least)
        g = clip.frames[..., 1].astype(np.float64)
        shift = np.sum([cv2.phaseCorrelate(g[t], g[t + 1])[0] for t in range(shapes.FRAMES - 1)], axis=0)
        assert 0.4 * abs(drift[1]) < np.sign(drift[1]) * shift[1] < 1.2 * abs(drift[1]) and abs(shift[0]) < 1.0, \
            (spec, shift, drift)
    mover = shapes.render(shapes.Spec("red", "circle", "moves up", "grey", "tilt down"), 9)
    assert (mover.centres[-1] - mover.centres[0])[1] <= -0.10 * shapes.SIZE  # up on screen, the tilt notwithstanding
    assert len(shapes.tilt_specs()) == 450 and not any(shapes.is_held_out(s) for s in shapes.tilt_specs())
    assert not {s.camera for s in shapes.all_specs()} & set(shapes.TILTS)
    tilt = shapes.Spec("blue", "circle", "moves up", "grey", "tilt up")
    assert shapes.caption_zh(tilt) == "蓝色圆形向上移动，灰色背景，上摇"
    assert shapes.parse(shapes.caption_en(tilt)) is None and shapes.parse(shapes.caption_zh(tilt)) is None
    assert shapes.reversed_spec(tilt) == shapes.Spec("blue", "circle", "moves down", "grey", "tilt down")
    with pytest.raises(ValueError, match=r"allowed: static shot, pan left, pan right, zoom in \(or, in training only, tilt up, tilt down\)$"):
        shapes.Spec("blue", "circle", "moves up", "grey", "tilt left")


def test_the_worlds_own_clips_read_clearly():
    # the margins draws keep clips by (qc.adherence.clear) hold on every clip of the world itself
    clips = _clips(120, 77)
    for spec, c in clips:
        got = adherence.clear(adherence.analyze(c.frames), spec)
        assert all(got.values()), (spec, got)


def _analysis(motion="stays still", camera="static shot", travel=(0.0, 0.0), pan=0.0, zoom=1.0):
    return adherence.Analysis(colour="red", shape="circle", motion=motion, background="grey", camera=camera,
                              travel=travel, pan=pan, zoom=zoom, top=0.5, bottom=0.5, found=1.0)


def test_clear_refuses_readings_near_a_boundary():
    spec = shapes.Spec("red", "circle", "stays still", "grey", "static shot")
    assert all(adherence.clear(_analysis(), spec).values())
    # read right, but a reader with its still/moving boundary at half the world's 10% disagrees
    assert adherence.clear(_analysis(travel=(0.07, 0.0)), spec)["motion"] is False
    assert adherence.clear(_analysis(pan=0.03), spec)["camera"] is False  # drifts half a pan's minimum
    assert adherence.clear(_analysis(zoom=1.07), spec)["camera"] is False
    left = shapes.Spec("red", "circle", "moves left", "grey", "pan right")
    ok = _analysis("moves left", "pan right", travel=(-0.2, 0.05), pan=-0.08)
    assert all(adherence.clear(ok, left).values())
    assert adherence.clear(_analysis("moves left", "pan right", (-0.13, 0.1), -0.08), left)["motion"] is False  # diagonal
    assert adherence.clear(_analysis("moves left", "pan right", (-0.2, 0.0), -0.04), left)["camera"] is False
    # a wrong word is never clear
    assert adherence.clear(_analysis("moves right", "pan right", (0.2, 0.0), -0.08), left)["motion"] is False


@pytest.mark.slow
def test_the_second_reader_reads_the_world(tmp_path):
    # qc.second_reader shares no code with the analyzer; on the world's own clips, raw and after
    # the post stage's interpolation to 30 fps and H.264, it reads what they were made from
    from clipmill.jobs.runner.stages import convert_and_check
    from clipmill.qc import QCConfig, second_reader

    clips = _clips(100, 4242)
    reads = [(s, second_reader.read(c.frames)) for s, c in clips]
    wrong = [(s, got) for s, got in reads if got != s.as_dict()]
    assert len(wrong) <= 1, wrong
    for i, (s, c) in enumerate(clips[:24]):
        decoded, _, _, _ = convert_and_check(c.frames, shapes.FPS, 30, str(tmp_path / f"{i}.mp4"), QCConfig())
        assert len(decoded) > 3 * len(c.frames)
        assert second_reader.read(decoded) == s.as_dict(), s
