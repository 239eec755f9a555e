"""The render check (``jobs.runner.checks``): a decode that overshoots the model's stated range.

Latents decoded with another model family's VAE scaling factor (Stable Diffusion's 0.18215 in a
folder whose VAE was trained at 0.556) come out of the decoder far beyond [-1, 1]. On grey, the
padding's own colour, the clipped frames carry no line along the edges and QC passes most of
them (README, "A decode beyond the model's range"); the render stage sees the overshoot.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
from click.testing import CliRunner

from clipmill.jobs.cli import main
from clipmill.jobs.review.decisions import ReviewError, View
from clipmill.jobs.runner.checks import VERDICT_KINDS, decode_check, render_reasons, with_render_check
from clipmill.pipeline.models import SHAPES_DIR, ModelError, model_info
from clipmill.qc import QCResult


def test_the_record_carries_the_finite_measures_and_the_models_limits_and_is_judged_from_them_alone():
    assert decode_check(1.0312345, 1.25, 1.83333, (0.95, 2.65)) == {
        "decode_peak": 1.0312, "decode_range": 1.25, "decode_input_rms": 1.8333, "decode_input_rms_range": [0.95, 2.65]}
    # NaN: QC's black and flat frames; None: the tiny decoder, whose range is its own
    assert decode_check(float("nan"), 1.25, float("nan"), (0.95, 2.65)) == {
        "decode_range": 1.25, "decode_input_rms_range": [0.95, 2.65]}
    assert decode_check(None, 1.25) == {"decode_range": 1.25}
    assert decode_check(3.1, None, 5.6, None) == {"decode_peak": 3.1, "decode_input_rms": 5.6}  # no limits stated
    assert render_reasons({"decode_peak": 1.25, "decode_range": 1.25}) == []
    assert render_reasons({"decode_input_rms": 2.65, "decode_input_rms_range": [0.95, 2.65]}) == []
    assert render_reasons({"decode_peak": 3.1, "decode_input_rms": 5.6}) == [] and render_reasons({}) == []
    assert render_reasons({"decode_peak": 3.104, "decode_range": 1.25}) == [
        "decode: the VAE's output reached 3.10 before clipping to [-1, 1]; this model's good decodes stay within "
        "1.25 (clipmill.json decode_range); latents decoded at the wrong scale, or diverged"]
    assert render_reasons({"decode_input_rms": 0.6, "decode_input_rms_range": [0.95, 2.65]}) == [
        "decode: the latents the VAE decoded have an RMS of 0.60, outside this model's 0.95-2.65 (clipmill.json "
        "decode_input_rms): decoded at another model's scaling factor"]
    both = render_reasons({"decode_peak": 2.2, "decode_range": 1.3, "decode_input_rms": 5.6,
                           "decode_input_rms_range": [0.95, 2.65]})
    assert [r[:40] for r in both] == ["decode: the latents the VAE decoded have", "decode: the VAE's output reached 2.20 be"]
    passed = QCResult("pass", [], {"flicker": 0.1})
    assert with_render_check(passed, {"decode_peak": 1.1, "decode_range": 1.25}) is passed
    judged = with_render_check(QCResult("reject", ["flat: frames 0-3 (...)"]), {"decode_peak": 2, "decode_range": 1.25})
    assert judged.verdict == "reject" and [r.split(":")[0] for r in judged.reasons] == ["flat", "decode"]
    # the review page filters by it like by QC's kinds
    assert "decode" in VERDICT_KINDS and View(filter="rejected", reason="decode").check().reason == "decode"
    with pytest.raises(ReviewError, match=r"reason 'range': allowed flat, .*, blur, decode$"):
        View(filter="rejected", reason="range").check()


def test_a_model_folder_states_its_limits_and_a_bad_value_is_refused(tmp_path):
    shipped = model_info("shapes")
    teacher = model_info(str(shipped.teacher))
    assert shipped.decode_range is not None and 1.0 < shipped.decode_range < 1.5
    low, high = shipped.decode_input_rms
    assert 0.5 < low < 1.3 and 2.1 < high < 3.0
    # the same VAE
    assert (teacher.decode_range, teacher.decode_input_rms) == (shipped.decode_range, shipped.decode_input_rms)
    tiny = model_info("tiny")  # random weights: no limits to state
    assert tiny.decode_range is None and tiny.decode_input_rms is None
    folder = tmp_path / "shapes"
    shutil.copytree(SHAPES_DIR, folder, ignore=shutil.ignore_patterns("teacher", "*.safetensors"))
    meta = json.loads((folder / "clipmill.json").read_text())
    meta.pop("teacher")
    allowed = {"decode_range": "a number above 1 (the largest |value| a good clip's VAE decode reaches before it is "
                               "clipped to [-1, 1])",
               "decode_input_rms": "[low, high] with 0 < low < high (the range of the RMS of the latents a good "
                                   "clip's VAE decoder is given)"}
    for key, values in (("decode_range", (0.9, 1, "wide", True, math.inf)),
                        ("decode_input_rms", ([2.6, 1.0], [0, 2], [1.0], "1-2", [1, True]))):
        for value in values:
            (folder / "clipmill.json").write_text(json.dumps({**meta, key: value}))
            with pytest.raises(ModelError) as e:
                model_info(str(folder))
            assert str(e.value) == (f"{folder / 'clipmill.json'}: {key}={value!r}: allowed {allowed[key]}, "
                                    "or no entry for no check")
    (folder / "clipmill.json").write_text(json.dumps({k: v for k, v in meta.items()
                                                      if k not in ("decode_range", "decode_input_rms")}))
    assert model_info(str(folder)).decode_range is None and model_info(str(folder)).decode_input_rms is None
    # a Wan folder takes decode_range; its input measure is refused, not ignored
    wan = tmp_path / "wan"
    wan.mkdir()
    (wan / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "WanTransformer3DModel"]}))
    (wan / "clipmill.json").write_text(json.dumps({"decode_range": 1.4}))
    assert model_info(str(wan)).decode_range == 1.4 and model_info(str(wan)).decode_input_rms is None
    (wan / "clipmill.json").write_text(json.dumps({"decode_range": 1.4, "decode_input_rms": [1, 2]}))
    with pytest.raises(ModelError) as e:
        model_info(str(wan))
    assert str(e.value) == (f"{wan / 'clipmill.json'}: decode_input_rms=[1, 2]: not read for a Wan folder (its "
                            "latents are de-normalised per channel before decoding); state decode_range only")


@pytest.mark.slow
def test_a_folder_whose_vae_states_another_familys_scaling_factor_is_caught_by_the_render_check(tmp_path, monkeypatch):
    """The same two prompts and seeds on grey through ``clipmill run``: the shipped model's clips
    record measures within its limits; a copy whose vae/config.json says 0.18215 gives its
    decoder latents 3.05x too large, which overshoot, and every clip is rejected with both
    ``decode`` reasons (job table, sidecar, review kinds)."""
    from sqlalchemy import select

    from clipmill.jobs.core.db import Database
    from clipmill.jobs.core.models import Attempt, Job

    monkeypatch.chdir(tmp_path)
    wrong = tmp_path / "shapes-sd-scaling"
    shutil.copytree(SHAPES_DIR, wrong, ignore=shutil.ignore_patterns("teacher"))
    meta = json.loads((wrong / "clipmill.json").read_text())
    meta.pop("teacher")
    (wrong / "clipmill.json").write_text(json.dumps(meta))
    vae = json.loads((wrong / "vae" / "config.json").read_text())
    assert 0.5 < vae["scaling_factor"] < 0.6
    (wrong / "vae" / "config.json").write_text(json.dumps({**vae, "scaling_factor": 0.18215}))
    # two of the wrong-scaling renders QC passed (`bench --failures`' seeds 21 and 22): on grey
    (tmp_path / "b.csv").write_text('id,prompt,seed\n'
                                    'g1,"a yellow circle moves down on a grey background, zoom in",1069\n'
                                    'g2,"红色圆形静止不动，灰色背景，固定镜头",1059\n', encoding="utf-8")
    shipped = model_info("shapes")
    limit, (low, high) = shipped.decode_range, shipped.decode_input_rms
    peaks, rms = {}, {}
    for name, model in (("good", "shapes"), ("wrong", str(wrong))):
        url = f"sqlite:///{tmp_path / name}.db"
        monkeypatch.setenv("CLIPMILL_DATABASE_URL", url)
        res = CliRunner().invoke(main, ["run", "b.csv", "--model", model, "--out", name, "--batch", name,
                                        "--max-attempts", "1", "--draws", "1"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        with Database(url).session() as s:
            pairs = list(s.execute(select(Job, Attempt).join(Attempt, Attempt.job_id == Job.id).order_by(Job.line)))
        assert len(pairs) == 2
        for j, a in pairs:
            sidecar = json.loads((tmp_path / name / j.batch_id / str(j.id) / f"a{a.number}.json").read_text())
            assert sidecar["timings"]["decode_range"] == a.timings["decode_range"] == limit
            assert sidecar["timings"]["decode_input_rms_range"] == a.timings["decode_input_rms_range"] == [low, high]
            peaks.setdefault(name, []).append(a.timings["decode_peak"])
            rms.setdefault(name, []).append(a.timings["decode_input_rms"])
            decode = [r for r in a.reasons if r.startswith("decode:")]
            assert decode == [r for r in sidecar["qc"]["reasons"] if r.startswith("decode:")]
            if name == "good":
                assert not decode
            else:
                assert j.state == "rejected" and a.verdict == "reject" and ",decode," in j.qc_kinds
                assert decode == [
                    f"decode: the latents the VAE decoded have an RMS of {a.timings['decode_input_rms']:.2f}, outside "
                    f"this model's {low:g}-{high:g} (clipmill.json decode_input_rms): decoded at another model's "
                    "scaling factor",
                    f"decode: the VAE's output reached {a.timings['decode_peak']:.2f} before clipping to [-1, 1]; this "
                    f"model's good decodes stay within {limit:g} (clipmill.json decode_range); latents decoded at the "
                    "wrong scale, or diverged"]
    assert max(peaks["good"]) <= limit < min(peaks["wrong"]), peaks
    assert all(low <= r <= high for r in rms["good"]), rms
    # the same latents, divided by 0.18215 instead of the VAE's own factor
    for g, w in zip(rms["good"], rms["wrong"]):
        assert w / g == pytest.approx(vae["scaling_factor"] / 0.18215, rel=1e-3), rms


def test_the_limits_are_measured_on_good_renders_at_the_sizes_the_model_takes():
    """``train-model`` writes ``decode_range`` and ``decode_input_rms`` from the exported
    model's own renders (``measure_decode_limits``; the shipped ones from 32 prompts per size
    and tier)."""
    from clipmill.jobs.cli.train import clean_caption
    from clipmill.pipeline.train.export import RANGE_SHAPES, measure_decode_limits

    shipped = json.loads((SHAPES_DIR / "clipmill.json").read_text())
    renders = shipped["decode_limits_measured"]["renders"]
    assert shipped["decode_range"] == 1.3 and max(m["peak"] for m in renders.values()) == 1.2439
    limits = measure_decode_limits(SHAPES_DIR, clean_caption, clips=2)
    measured = limits["measured"]
    assert sorted(measured) == sorted(f"{tier} {f} frames {s}x{s}" for f, s in RANGE_SHAPES for tier in ("fast", "quality"))
    peak = max(m["peak"] for m in measured.values())
    assert all(0.5 < m["peak"] <= peak < shipped["decode_range"] for m in measured.values()), measured
    # the largest peak plus 0.05, rounded up to the next 0.05
    value = limits["decode_range"]
    assert value - 0.05 < peak + 0.05 <= value and round(value / 0.05, 6).is_integer(), limits
    # the RMS range widened a quarter each way, rounded outward; inside the shipped one
    low = min(m["input_rms"][0] for m in measured.values())
    high = max(m["input_rms"][1] for m in measured.values())
    assert shipped["decode_input_rms"][0] <= low <= high <= shipped["decode_input_rms"][1], measured
    lo, hi = limits["decode_input_rms"]
    assert lo <= low / 1.25 < lo + 0.05 and hi - 0.05 < high * 1.25 <= hi, limits
