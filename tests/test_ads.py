"""Finished ads (issue 12), the library half: templates and their errors, rows checked against a
template before anything renders, and one format of an ad assembled from footage (timeline,
texts, logo, end card, music, delivery settings) into a real H.264 + AAC file, checked by the
ad-level QC and by independent measurements here."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import cv2
import numpy as np
import pytest

from clipmill.jobs.ads import build, rows, template
from clipmill.jobs.bench.ads import generator_footage
from clipmill.pipeline import assemble, audio, i420
from clipmill.pipeline.models import model_info
from clipmill.pipeline.overlay import missing_glyphs
from clipmill.qc import ad as ad_qc
from services import CJK_FONT

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ad" / "local-life.toml"
LATIN_FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")

needs_cjk = pytest.mark.usefixtures("cjk_font")


def _count(text: str) -> int:  # the shapes model's byte-level tokenizer: one token a UTF-8 byte, plus 2
    return len(text.encode()) + 2


@pytest.fixture(scope="module")
def info():
    return model_info("shapes")


def _write(tmp_path: Path, body: str, name: str = "t.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body), encoding="utf-8")
    return p


MINIMAL = """
    fps = 30
    [[formats]]
    name = "sq"
    size = [256, 256]
    method = "crop"
    [[shots]]
    prompt = "a {colour} circle moves right on a black background, static shot"
    seconds = 1.0
"""


# -- templates ----------------------------------------------------------------------------------


@needs_cjk
def test_the_example_template_loads_with_its_formats_shots_and_placeholders():
    tpl = template.load(EXAMPLE)
    assert [(f.name, f.width, f.height, f.method, f.aspect) for f in tpl.formats] == [
        ("9x16", 720, 1280, "crop", "9:16"), ("1x1", 720, 720, "crop", "1:1"), ("16x9", 1280, 720, "pad", "16:9")]
    assert tpl.formats[0].delivery.max_bytes == 8_000_000 and tpl.formats[0].delivery.max_kbps == 6000
    assert tpl.formats[2].delivery.over_size == "refuse"
    assert [s.transition for s in tpl.shots] == ["cut", "crossfade", "cut"]
    assert tpl.footage_seconds == 7.0 and tpl.seconds == 9.0  # 3 x 2.5 s less a 0.5 s crossfade, + 2 s end card
    assert tpl.placeholders() == ["colour", "shape", "merchant", "price", "cta"]


@pytest.mark.parametrize("body, message", [
    ("", "formats is missing; give at least one [[formats]] table with a size"),
    ("[[formats]]\nsize = [721, 1280]\n", "formats[0].size = [721, 1280]: allowed: [width, height], even integers from 64 to 3840"),
    ("[[formats]]\nsize = [720, 720]\nmethod = 'stretch'\n", "formats[0].method = 'stretch': allowed: render, crop, pad"),
    ("[[formats]]\nsize = [720, 720]\n[formats.delivery]\nlevel = '6.2'\n",
     "formats[0].delivery.level = '6.2': allowed: 3.0, 3.1, 3.2, 4.0, 4.1, 4.2, 5.0, 5.1"),
    ("[[formats]]\nsize = [720, 720]\n[formats.delivery]\nmax_size = 'huge'\n",
     "formats[0].delivery.max_size = 'huge': give a size such as '8MB', '500kB' or a number of bytes, at least 10kB"),
    ("[[formats]]\nsize = [720, 720]\n", "shots is missing; give at least one [[shots]] table with a prompt and seconds"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\n", "shots[0].seconds is missing; give a number from 0.25 to 30"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\ntransition = 'crossfade'\n",
     "shots[0].transition = 'crossfade': the first shot has no shot before it to fade from; use 'cut'"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x {a b}'\nseconds = 2\n",
     "shots[0].prompt = 'x {a b}': placeholder {a b} must be a plain column name like {merchant}"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\n[[texts]]\ntext = 'hi'\nfont = 'f.ttf'\nanchor = 'middle'\n",
     "texts[0].anchor = 'middle': allowed: top-left, top, top-right, left, center, right, bottom-left, bottom, bottom-right"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\n[[texts]]\ntext = 'hi'\nfont = 'f.ttf'\ncolour = 'red'\n",
     "texts[0].colour = 'red': give a colour as #RRGGBB, for example #ffcc00"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\n[[texts]]\ntext = 'hi'\nfont = 'f.ttf'\nstart = 1.5\nend = 1.0\n",
     "texts[0].end = 1.0: must be after start (1.5 s), at most 2 s"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\n[music]\nfile = 'm.wav'\nvolume = 3\n",
     "music.volume = 3: allowed: a number from 0 to 2"),
    ("[[formats]]\nsize = [720, 720]\nshape = 'round'\n", "formats[0].shape: unknown setting; allowed: name, size, method, pad_colour, delivery"),
    ("fps = 120\n[[formats]]\nsize = [720, 720]\n", "fps = 120: allowed: an integer from 8 to 60"),
    # TOML has nan: it passed every range check, then crashed the check or the assembly
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = nan\n",
     "shots[0].seconds = nan: allowed: a number from 0.25 to 30"),
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\n[music]\nfile = 'm.wav'\nvolume = nan\n",
     "music.volume = nan: allowed: a number from 0 to 2"),
    # a file labelled below its frame size: 720p is over level 3.0's 1620 macroblocks
    ("[[formats]]\nsize = [1280, 720]\n[formats.delivery]\nlevel = '3.0'\n",
     "formats[0].delivery.level = '3.0': 1280x720 is over H.264 level 3.0's frame size; allowed: 3.1 or above"),
    # the name is the ad's file name: '9/16' made every ad fail after its shots had rendered
    ("[[formats]]\nname = '9/16'\nsize = [720, 720]\n",
     "formats[0].name = '9/16': allowed: 1-32 letters, digits, '.', '_' or '-', starting with a letter or digit"),
    # each shot is cut to whole frames: 2.5 s at 25 fps made every ad 1.5 frames short, and QC rejected it
    ("fps = 25\n[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2.5\n",
     "shots[0].seconds = 2.5: allowed: a whole number of frames at the template's 25 fps (a multiple of 0.04 s, "
     "such as 2.48)"),
    # each was ignored silently: a cut has no crossfade, and a size of 0 read as "no limit"
    ("[[formats]]\nsize = [720, 720]\n[[shots]]\nprompt = 'x'\nseconds = 2\n[[shots]]\nprompt = 'y'\nseconds = 2\n"
     "crossfade = 0.5\n",
     "shots[1].crossfade = 0.5: set only with transition = 'crossfade'; this shot cuts in (transition = 'cut', the default)"),
    ("[[formats]]\nsize = [720, 720]\n[formats.delivery]\nmax_size = 0\n",
     "formats[0].delivery.max_size = 0: give a size such as '8MB', '500kB' or a number of bytes, at least 10kB"),
])
def test_a_bad_template_is_refused_naming_the_file_field_value_and_what_is_allowed(tmp_path, body, message):
    p = _write(tmp_path, body)
    with pytest.raises(template.TemplateError) as e:
        template.load(p)
    assert str(e.value) == f"{p}: {message}"


def test_a_template_that_is_not_toml_or_not_there_is_named(tmp_path):
    with pytest.raises(template.TemplateError, match=r"^--ad .*nope.toml: no such file$"):
        template.load(tmp_path / "nope.toml")
    p = _write(tmp_path, "fps = = 3\n")
    with pytest.raises(template.TemplateError, match=r"^--ad .*t.toml: not valid TOML \("):
        template.load(p)


# -- rows ---------------------------------------------------------------------------------------


@needs_cjk
def test_every_row_of_the_example_becomes_an_ad_with_its_shots(info):
    tpl = template.load(EXAMPLE)
    batch = rows.read_ads(ROOT / "examples" / "ad" / "ads.csv", tpl, info, _count)
    assert batch.ok and batch.warnings == [] and len(batch.ads) == 3
    ad = batch.ads[0]
    assert ad.client_id == "laowang-noodles" and ad.texts["merchant"] == "老王面馆"
    assert [s.row.prompt for s in ad.shots] == [
        "a red circle moves right on a beige background, pan right",
        "a red circle stays still on a grey background, zoom in",
        "a red circle moves up on a black background, static shot"]
    assert [s.row.tier for s in ad.shots] == ["quality", "fast", "fast"]
    assert all(s.row.frames == 21 and s.row.fps == 30 for s in ad.shots)  # 2.5 s at the model's 8 fps, and one more
    assert len({s.row.seed for s in ad.shots}) == 3
    assert ad.shots[0].sizes == {"9x16": (64, 64), "1x1": (64, 64), "16x9": (64, 64)}
    again = rows.read_ads(ROOT / "examples" / "ad" / "ads.csv", tpl, info, _count)
    assert [s.row.seed for s in again.ads[0].shots] == [s.row.seed for s in ad.shots]  # the same file, the same ads


@needs_cjk
def test_bad_rows_are_refused_before_any_render_each_naming_its_line_and_field(tmp_path, info):
    folder = tmp_path / "ad"
    shutil.copytree(ROOT / "examples" / "ad", folder)
    tpl_path = folder / "local-life.toml"
    text = tpl_path.read_text().replace('file = "logo.png"', 'file = "logos/{id}.png"')
    tpl_path.write_text(text)
    (folder / "logos").mkdir()
    for i in ("a", "b", "c", "e"):
        shutil.copy(folder / "logo.png", folder / "logos" / f"{i}.png")
    csv = folder / "bad.csv"
    csv.write_text(
        "id,merchant,price,cta,colour,shape\n"
        "a,老王面馆,¥ 29.9,立即下单,red,circle\n"                          # good
        "b,,¥ 29.9,Order now,red,circle\n"                                 # empty merchant
        "c," + "Extraordinarily Long Merchant Name Noodle House" * 3 + ",¥ 1,Go,red,circle\n"  # does not fit
        "d,Golden Lotus,$ 8,Order now,red,circle\n"                         # no logo file for d
        "e,Golden Lotus,$ 8,Order now,green,circle\n",                      # good
        encoding="utf-8")
    tpl = template.load(tpl_path)
    batch = rows.read_ads(csv, tpl, info, _count)
    msgs = [str(p) for p in batch.errors]
    assert [a.line for a in batch.ads] == [2, 6]
    assert msgs[0] == (f"{csv}:3: merchant: '' is missing or empty; the template local-life.toml fills {{merchant}} from it "
                       "(its placeholders: colour, shape, merchant, price, cta, id)")
    assert msgs[1].startswith(f"{csv}:4: text merchant: 'Extraordinarily Long Merchant Name Noodle House")
    assert msgs[1].endswith("does not fit its box in format 9x16 (720x1280) even at its min_size 0.035 (45 px); shorten "
                            "it, or lower min_size or the margins in the template")
    assert msgs[2].startswith(f"{csv}:4: text end_merchant:")  # each text of the row is checked
    assert msgs[3] == f"{csv}:5: logo: {str(folder / 'logos' / 'd.png')!r} no such file ({folder / 'logos' / 'd.png'})"
    assert len(msgs) == 4


@needs_cjk
def test_characters_the_font_has_no_glyph_for_are_named(tmp_path, info):
    p = _write(tmp_path, MINIMAL + f"""
    [[texts]]
    name = "merchant"
    text = "{{merchant}}"
    font = "{LATIN_FONT}"
    """)
    csv = tmp_path / "ads.csv"
    csv.write_text("merchant,colour\nCafé 老王,red\nCafé Lao,blue\n", encoding="utf-8")
    batch = rows.read_ads(csv, template.load(p), info, _count)
    assert [str(e) for e in batch.errors] == [
        f"{csv}:2: text merchant: 'Café 老王' has characters its font DejaVuSans.ttf has no glyph for: '老' (U+8001), "
        "'王' (U+738B); pick a font that covers them (for Chinese, for example WenQuanYi Micro Hei)"]
    assert len(batch.ads) == 1 and missing_glyphs(CJK_FONT, "Café 老王") == []


def test_a_missing_column_and_a_missing_font_are_row_errors(tmp_path, info):
    p = _write(tmp_path, MINIMAL + """
    [[texts]]
    name = "price"
    text = "{price}"
    font = "fonts/none.ttf"
    """)
    csv = tmp_path / "ads.csv"
    csv.write_text("colour\nred\n", encoding="utf-8")
    batch = rows.read_ads(csv, template.load(p), info, _count)
    assert [str(e) for e in batch.errors] == [
        f"{csv}:2: price: '' is missing or empty; the template t.toml fills {{price}} from it (its placeholders: colour, price)"]
    csv.write_text("colour,price\nred,9\n", encoding="utf-8")
    batch = rows.read_ads(csv, template.load(p), info, _count)
    font = tmp_path / "fonts" / "none.ttf"
    assert [str(e) for e in batch.errors] == [f"{csv}:2: font of text price: {str(font)!r} no such file ({font})"]


def test_a_music_file_that_would_fail_the_build_is_a_row_error(tmp_path, info):
    """Music is read at submit as the build reads it (pipeline.audio.load): float PCM with a NaN
    sample (a damaged WAV: the AAC encoder refuses it, and the build failed with FFmpeg's
    "Invalid argument") and a file with no audio are refused on their row, naming the file,
    where and why; a good one passes."""
    import av

    p = _write(tmp_path, MINIMAL + """
    [music]
    file = "music/{colour}.wav"
    """)
    (tmp_path / "music").mkdir()
    for name, poison in (("red", False), ("blue", True)):
        tone = audio.tone(1.0)
        if poison:
            tone[:, 30000] = np.nan  # at 0.625 s
        with av.open(str(tmp_path / "music" / f"{name}.wav"), "w") as c:
            a = c.add_stream("pcm_f32le", rate=audio.RATE, layout="stereo")
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(tone.T.reshape(1, -1)), format="flt", layout="stereo")
            f.sample_rate = audio.RATE
            for packet in [*a.encode(f), *a.encode()]:
                c.mux(packet)
    (tmp_path / "music" / "green.wav").write_text("not sound")
    csv = tmp_path / "ads.csv"
    csv.write_text("colour\nred\nblue\ngreen\n", encoding="utf-8")
    batch = rows.read_ads(csv, template.load(p), info, _count)
    blue, green = tmp_path / "music" / "blue.wav", tmp_path / "music" / "green.wav"
    assert [a.line for a in batch.ads] == [2]
    msgs = [str(e) for e in batch.errors]
    assert msgs[0] == (f"{csv}:3: music: {str(blue)!r} the audio is damaged at 0.597 s (samples that are not sound: NaN "
                       f"or huge); re-export or re-encode it ({blue})"), msgs
    assert msgs[1].startswith(f"{csv}:4: music: {str(green)!r} not a readable audio file ("), msgs
    assert len(msgs) == 2


# -- assembly -----------------------------------------------------------------------------------


def _footage(ad: rows.AdRow, fmt: template.Format, fps: int) -> dict[int, np.ndarray]:
    """Each shot's frames from the shapes world's own generator at the format's render size,
    held to the ad's fps (a stand-in for rendered, interpolated footage)."""
    return generator_footage(ad, fmt, fps)


def _cuts_by_histogram(path: Path) -> list[int]:
    """An independent cut detector: frames whose grey-level histogram differs from the frame
    before by a lot, and by far more than the frames around it do (a crossfade changes the
    histogram over many frames, a cut at one)."""
    from clipmill.pipeline.video import decode

    frames, _ = decode(path)
    hists = [cv2.calcHist([cv2.cvtColor(f, cv2.COLOR_RGB2GRAY)], [0], None, [32], [0, 256]).ravel() / f[..., 0].size
             for f in frames]
    d = np.array([0.5 * np.abs(a - b).sum() for a, b in zip(hists, hists[1:])])
    near = [max(np.concatenate([d[max(0, i - 2):i], d[i + 1:i + 3]]), default=0.0) for i in range(len(d))]
    return [int(i) + 1 for i in range(len(d)) if d[i] > 0.25 and d[i] > 3 * near[i]]


@pytest.fixture(scope="module")
def example_ad(info, cjk_font):
    tpl = template.load(EXAMPLE)
    batch = rows.read_ads(ROOT / "examples" / "ad" / "ads.csv", tpl, info, _count)
    return tpl, batch.ads[0]


@pytest.mark.parametrize("fmt_name", ["9x16", "1x1", "16x9"])
def test_an_ad_format_is_assembled_exactly_and_passes_ad_qc(example_ad, tmp_path, fmt_name):
    tpl, ad = example_ad
    fmt = next(f for f in tpl.formats if f.name == fmt_name)
    footage = _footage(ad, fmt, tpl.fps)
    out = build.make_format(tpl, ad, fmt, footage, tmp_path / f"{fmt_name}.mp4")
    info = assemble.probe_av(out.path)
    assert (info["width"], info["height"]) == (fmt.width, fmt.height)
    assert abs(info["seconds"] - tpl.seconds) <= 1 / tpl.fps and info["frames"] == 270
    assert info["audio"]["codec"] == "aac" and abs(info["audio"]["seconds"] - info["seconds"]) < 0.05
    assert info["profile"].lower() == fmt.delivery.profile and info["bytes"] <= fmt.delivery.max_bytes
    assert out.qc.verdict == "pass", out.qc.reasons
    assert out.boundaries == [135, 210]  # the cut into shot 3 and into the end card (the crossfade is no cut)
    found = _cuts_by_histogram(out.path)
    assert found == [135, 210], found  # exactly the template's cuts: into shot 3 and into the end card
    # the layers are there, at their times: the merchant's box differs from the footage under it
    from clipmill.pipeline.video import decode

    frames, _ = decode(out.path)
    tl, _ = build.timeline(tpl, ad, fmt, footage)
    bare = [i420.to_rgb(f) for f in assemble.frames(assemble.Timeline(tl.shots, tl.fps, tl.end_card, []),
                                                     (fmt.width, fmt.height), fmt.method, fmt.pad_colour)]
    for lay in tl.layers:
        h, w = lay.rgba.shape[:2]
        inside = round((lay.start + lay.end) / 2 * tpl.fps)
        outside = round(lay.end * tpl.fps) + 3
        region = (slice(lay.y, lay.y + h), slice(lay.x, lay.x + w))
        on = np.abs(frames[inside][region].astype(int) - bare[inside][region]).mean()
        assert on > 20, (lay.name, on)
        def overlaps(o):  # another layer shown over this one's box at that time
            oh, ow = o.rgba.shape[:2]
            return (o is not lay and o.opacity(outside / tpl.fps) > 0 and o.x < lay.x + w and lay.x < o.x + ow
                    and o.y < lay.y + h and lay.y < o.y + oh)

        if outside < len(frames) and not any(overlaps(o) for o in tl.layers):
            off = np.abs(frames[outside][region].astype(int) - bare[outside][region]).mean()
            assert off < 6, (lay.name, off)


def test_a_text_as_light_as_the_footage_under_it_is_illegible_unless_outlined():
    light = np.full((500, 3), 235, np.uint8)
    plain = ad_qc.TextCheck("cta", (0, 0, 10, 10), (255, 255, 255), None, light)
    ratio, why = ad_qc.legibility(plain)
    assert ratio < 1.2 and why == (f"text 'cta': contrast {ratio:.2f}:1 against the footage under it < 4.5:1 (WCAG), "
                                   "and it has no outline or shadow")
    outlined = ad_qc.TextCheck("cta", (0, 0, 10, 10), (255, 255, 255), (0, 0, 0), light)
    assert ad_qc.legibility(outlined)[1] is None
    dark = ad_qc.TextCheck("cta", (0, 0, 10, 10), (255, 255, 255), None, np.full((500, 3), 30, np.uint8))
    assert ad_qc.legibility(dark)[0] > 12 and ad_qc.legibility(dark)[1] is None
    # a textured background is read at its worst part, not its mean
    mixed = np.concatenate([np.full((400, 3), 20, np.uint8), np.full((100, 3), 250, np.uint8)])
    assert ad_qc.legibility(ad_qc.TextCheck("t", (0, 0, 1, 1), (255, 255, 255), None, mixed))[1] is not None


def test_a_box_outside_the_safe_area_and_a_cut_off_a_boundary_are_reasons():
    assert ad_qc.inside("logo", (5, 5, 50, 50), (36, 64, 648, 1152)) == (
        "logo: box x 5-55, y 5-55 is outside the safe area x 36-684, y 64-1216")
    assert ad_qc.inside("logo", (40, 70, 50, 50), (36, 64, 648, 1152)) is None
    assert ad_qc.cut_reasons([135, 200], [135, 210], 30) == [
        "cut: at frame 200 (6.67 s), not at a shot boundary (the template cuts at frames 135, 210)"]
    assert ad_qc.duration_reason(269, 30, 9.0) is None and ad_qc.duration_reason(267, 30, 9.0) == (
        "duration: 8.900 s (267 frames at 30 fps), the template's is 9.000 s (one frame: 0.033 s)")


def test_audio_is_fitted_to_the_exact_length_and_silence_and_clipping_are_caught():
    music = audio.tone(2.0)
    long = audio.fit(music, 5.0, volume=0.5, fade_out=1.0)
    assert long.shape == (2, 5 * audio.RATE) and abs(long[:, -1]).max() < 1e-3  # looped, faded to nothing
    assert np.allclose(long[:, audio.RATE:audio.RATE + 100], 0.5 * music[:, audio.RATE:audio.RATE + 100])
    assert audio.fit(music, 1.0).shape == (2, audio.RATE)  # trimmed
    assert ad_qc.audio_reasons(long, audio.RATE, 5.0, 30) == []
    assert ad_qc.audio_reasons(np.zeros((2, 5 * audio.RATE), np.float32), audio.RATE, 5.0, 30) == [
        "audio: silent (RMS -200.0 dBFS < -50 dBFS)"]
    loud = np.clip(music * 8, -1, 1)
    assert ad_qc.audio_reasons(loud, audio.RATE, 2.0, 30)[0].startswith("audio: clipping (")
    assert ad_qc.audio_reasons(long, audio.RATE, 4.0, 30) == ["audio: 5.000 s long, the video 4.000 s"]
    assert ad_qc.audio_reasons(None, audio.RATE, 4.0, 30) == ["audio: no audio stream"]


def test_a_file_over_its_max_size_is_encoded_again_to_fit_or_refused(tmp_path):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (60, 240, 320, 3), dtype=np.uint8)  # noise: expensive to encode
    music = audio.fit(audio.tone(2.0), 2.0)
    cap = 150_000
    made = assemble.encode(lambda: iter(frames), 60, 30, (320, 240), tmp_path / "fit.mp4",
                           assemble.Delivery(crf=18, max_bytes=cap), music)
    assert made["reencoded"] and made["bytes"] <= cap and (tmp_path / "fit.mp4").stat().st_size == made["bytes"]
    with pytest.raises(assemble.DeliveryError) as e:
        assemble.encode(lambda: iter(frames), 60, 30, (320, 240), tmp_path / "no.mp4",
                        assemble.Delivery(crf=18, max_bytes=cap, over_size="refuse"), music)
    assert str(e.value).startswith("no.mp4: ") and str(e.value).endswith(
        f"bytes, over the format's max_size of {cap:,} bytes (over_size = 'refuse')")
    assert not (tmp_path / "no.mp4").exists() and not list(tmp_path.glob(".no.mp4*"))  # nothing half-written


def test_i420_composition_matches_composing_in_rgb_then_converting():
    """The ad is composed in I420 (half the bytes of RGB, no conversion before the encoder):
    footage scaled by its planes, and layers at odd positions or partly off the frame, come
    out as composing in RGB and converting would make them, to within a few levels."""
    import cv2

    rng = np.random.default_rng(5)
    small = cv2.resize(rng.integers(0, 256, (9, 16, 3), dtype=np.uint8), (32, 18), interpolation=cv2.INTER_LINEAR)
    size = (160, 90)
    buf = assemble.reframe_i420(small, size, "render")
    want = cv2.resize(small, size, interpolation=cv2.INTER_LINEAR)
    # as close as converting the scaled RGB frame (both lose what 4:2:0 chroma cannot hold)
    via_rgb = np.abs(i420.to_rgb(i420.from_rgb(want)).astype(int) - want).mean()
    assert np.abs(i420.to_rgb(buf).astype(int) - want).mean() <= via_rgb + 0.5
    # a layer with soft alpha at an odd position, half off the right edge, at 60% opacity
    layer = np.zeros((21, 41, 4), np.uint8)
    layer[..., :3] = (250, 30, 40)
    layer[..., 3] = np.linspace(0, 255, 41, dtype=np.uint8)[None, :]
    x, y, op = 137, 33, 0.6
    ov = i420.Overlay.prepare(layer, x, y)
    ov.blend(buf, op)
    ref = want.astype(np.float64)
    w = min(41, size[0] - x)
    a = layer[:, :w, 3:4] / 255.0 * op
    ref[y:y + 21, x:x + w] = ref[y:y + 21, x:x + w] * (1 - a) + layer[:, :w, :3] * a
    got = i420.to_rgb(buf).astype(int)
    region = (slice(y, y + 21), slice(x, x + w))
    assert np.abs(got[region] - ref[region]).mean() < 6  # chroma at half resolution, as in any 4:2:0 video
    # the pixels under a box read back as RGB, and a blank frame is its colour
    under = i420.region_rgb(i420.from_rgb(want), (10, 10, 20, 20), step=3)
    assert under.shape == (49, 3) and np.abs(under.astype(int) - want[10:30:3, 10:30:3].reshape(-1, 3)).mean() < 4
    assert np.abs(i420.to_rgb(i420.blank((8, 8), (200, 40, 90))).astype(int) - (200, 40, 90)).max() <= 2


def test_an_ads_texts_keep_the_rows_own_characters():
    """The prompt cleaning rewrote them: "Acme™ ½" became "AcmeTM 1⁄2", "好吃，不贵！" lost its
    full-width punctuation, and a Persian word lost its zero-width non-joiner (another spelling)."""
    from clipmill.jobs.ads.rows import shown_text

    assert shown_text("  Acme™ ½ ") == "Acme™ ½"
    assert shown_text("好吃，不贵！") == "好吃，不贵！"
    assert shown_text("می\u200cخواهم") == "می\u200cخواهم"
    assert shown_text("two  spaces\tand a bell\x07\nsecond line ") == "two spaces and a bell\nsecond line"


def test_a_logo_too_tall_for_its_box_is_refused_per_format(tmp_path, info):
    from PIL import Image

    Image.new("RGBA", (40, 400), (255, 0, 0, 255)).save(tmp_path / "tall.png")
    Image.new("RGBA", (400, 40), (255, 0, 0, 255)).save(tmp_path / "wide.png")
    body = MINIMAL + """
    [[formats]]
    name = "wide"
    size = [512, 256]
    method = "crop"
    [logo]
    file = "{id}.png"
    width = 0.2
    """
    tpl = template.load(_write(tmp_path, body))
    csv = tmp_path / "ads.csv"
    csv.write_text("id,colour\ntall,red\nwide,red\n", encoding="utf-8")
    batch = rows.read_ads(csv, tpl, info, _count)
    assert [a.client_id for a in batch.ads] == ["wide"]
    # 0.2 of 256 px is 51 px wide, so 510 px tall; 0.2 of 512 is 102 px wide, so 1020 px tall: the
    # safe area's default margins (5%) leave 256 - 2 x 13 = 230 px
    assert [str(p) for p in batch.errors] == [
        f"{csv}:2: logo: {str(tmp_path / 'tall.png')!r} is 40x400; drawn {w} px wide in format {name} ({size}) it is "
        f"{h} px tall, taller than the 230 px the safe area and margins leave; lower logo.width in the template, "
        "or use a wider logo" for name, size, w, h in (("sq", "256x256", 51, 510), ("wide", "512x256", 102, 1020))]


def test_an_ad_batch_keeps_its_template_and_files_as_they_were_at_submit(tmp_path, sqlite_url):
    """Before, a batch kept its template's path alone: an edit after submit changed the ads still
    to be assembled, and a farm's post workers needed the template, fonts, logos and music at the
    submitting host's paths. Real SQLite, real local storage."""
    import os
    import wave

    from PIL import Image

    from clipmill.jobs.ads.assembly import batch_template
    from clipmill.jobs.ads.submit import submit_ads
    from clipmill.jobs.core.batches import SubmitOptions
    from clipmill.jobs.core.db import Database
    from clipmill.jobs.core.models import Ad, Batch
    from clipmill.storage import LocalStorage

    folder = tmp_path / "tpl"
    (folder / "logos").mkdir(parents=True)
    Image.new("RGBA", (40, 40), (255, 0, 0, 200)).save(folder / "logos" / "a.png")
    Image.new("RGBA", (40, 20), (0, 0, 255, 200)).save(folder / "logos" / "b.png")
    with wave.open(str(folder / "m.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000)
        w.writeframes((np.sin(np.arange(4000) * 0.3) * 8000).astype("<i2").tobytes())
    body = MINIMAL + """
    [logo]
    file = "logos/{id}.png"
    [music]
    file = "m.wav"
    """
    tpl_path = _write(folder, body)
    before = {n: (folder / n).read_bytes() for n in ("logos/a.png", "logos/b.png", "m.wav")}
    (tmp_path / "ads.csv").write_text("id,colour\na,red\nb,blue\n", encoding="utf-8")
    db = Database(sqlite_url)
    out = tmp_path / "out"
    submit_ads(db, tmp_path / "ads.csv", tpl_path, SubmitOptions(model="shapes", batch="kept", out=str(out)))

    # after submit the template is edited and its files are gone (another host has none of them)
    tpl_path.write_text(textwrap.dedent(body).replace("fps = 30", "fps = 25"), encoding="utf-8")
    for n in before:
        os.remove(folder / n)
    with db.session() as s:
        batch = s.get(Batch, "kept")
        values = [a.values for a in s.query(Ad).order_by(Ad.id)]
    assert sorted(batch.ad_assets) == ["logos/a.png", "logos/b.png", "m.wav"]
    assert all(k.startswith("_assets/") and (out / k).is_file() for k in batch.ad_assets.values())
    for v in values:
        work = tmp_path / f"work-{v['id']}"
        work.mkdir()
        tpl = batch_template(batch, v, LocalStorage(str(out)), str(work))
        assert tpl.fps == 30 and tpl.path == Path(batch.ad_template)
        assert sorted(p.name for p in (work / "assets").iterdir()) == sorted(  # only the files this ad uses
            k.rsplit("/", 1)[-1] for n, k in batch.ad_assets.items() if n in (f"logos/{v['id']}.png", "m.wav"))
        _, files, _, errs = rows.layout(tpl, v, stored=True)
        assert errs == []
        assert Path(files["logo"]).read_bytes() == before[f"logos/{v['id']}.png"]
        assert Path(files["music"]).read_bytes() == before["m.wav"]
    db.dispose()


def test_a_stored_template_is_read_as_it_was_accepted_not_refused_by_a_later_rule(tmp_path):
    """A batch keeps its template's text; its assembly reads it with ``stored=True``. Rules added
    after a batch was accepted (a crossfade length on a cut, max_size under 10 kB, the logo's
    fit) must not fail its ads for good: before, they would have."""
    body = ("[[formats]]\nsize = [720, 720]\n[formats.delivery]\nmax_size = 0\n[[shots]]\nprompt = 'x'\nseconds = 2\n"
            "[[shots]]\nprompt = 'y'\nseconds = 2\ncrossfade = 0.5\n")
    with pytest.raises(template.TemplateError, match="max_size = 0: give a size"):
        template.loads(body, tmp_path / "t.toml")
    with pytest.raises(template.TemplateError, match="crossfade = 0.5: set only with transition = 'crossfade'"):
        template.loads(body.replace("max_size = 0", "max_size = '8MB'"), tmp_path / "t.toml")
    tpl = template.loads(body, tmp_path / "t.toml", stored=True)
    assert [(s.transition, s.crossfade) for s in tpl.shots] == [("cut", 0.0), ("cut", 0.0)]
    assert tpl.formats[0].delivery.max_bytes == 0  # "no limit", as it was read when the batch was accepted
