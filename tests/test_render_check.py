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


def test_the_record_carries_a_finite_peak_and_the_models_range_and_judges_from_them_alone():
    assert decode_check(1.0312345, 1.25) == {"decode_peak": 1.0312, "decode_range": 1.25}
    assert decode_check(float("nan"), 1.25) == {"decode_range": 1.25}  # NaN frames: QC's black and flat
    assert decode_check(None, 1.25) == {"decode_range": 1.25}  # the tiny decoder: its range is its own
    assert decode_check(3.1, None) == {"decode_peak": 3.1}  # a model that states no range
    assert render_reasons({"decode_peak": 1.25, "decode_range": 1.25}) == []
    assert render_reasons({"decode_peak": 3.1}) == [] and render_reasons({}) == []
    assert render_reasons({"decode_peak": 3.104, "decode_range": 1.25}) == [
        "decode: the VAE's output reached 3.10 before clipping to [-1, 1]; this model's good decodes stay within "
        "1.25 (clipmill.json decode_range); latents decoded at the wrong scale, or diverged"]
    passed = QCResult("pass", [], {"flicker": 0.1})
    assert with_render_check(passed, {"decode_peak": 1.1, "decode_range": 1.25}) is passed
    judged = with_render_check(QCResult("reject", ["flat: frames 0-3 (...)"]), {"decode_peak": 2, "decode_range": 1.25})
    assert judged.verdict == "reject" and [r.split(":")[0] for r in judged.reasons] == ["flat", "decode"]
    # the review page filters by it like by QC's kinds
    assert "decode" in VERDICT_KINDS and View(filter="rejected", reason="decode").check().reason == "decode"
    with pytest.raises(ReviewError, match=r"reason 'range': allowed flat, .*, blur, decode$"):
        View(filter="rejected", reason="range").check()


def test_a_model_folder_states_its_decode_range_and_a_bad_value_is_refused(tmp_path):
    shipped = model_info("shapes")
    teacher = model_info(str(shipped.teacher))
    assert shipped.decode_range is not None and 1.0 < shipped.decode_range < 1.5
    assert teacher.decode_range == shipped.decode_range  # the same VAE
    assert model_info("tiny").decode_range is None  # random weights: no range to state
    folder = tmp_path / "shapes"
    shutil.copytree(SHAPES_DIR, folder, ignore=shutil.ignore_patterns("teacher", "*.safetensors"))
    meta = json.loads((folder / "clipmill.json").read_text())
    meta.pop("teacher")
    for value in (0.9, 1, "wide", True, math.inf):
        (folder / "clipmill.json").write_text(json.dumps({**meta, "decode_range": value}))
        with pytest.raises(ModelError) as e:
            model_info(str(folder))
        assert str(e.value) == (f"{folder / 'clipmill.json'}: decode_range={value!r}: allowed a number above 1 (the "
                                "largest |value| a good clip's VAE decode reaches before it is clipped to [-1, 1]), "
                                "or no entry for no check")
    (folder / "clipmill.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "decode_range"}))
    assert model_info(str(folder)).decode_range is None


@pytest.mark.slow
def test_a_folder_whose_vae_states_another_familys_scaling_factor_is_caught_by_the_render_check(tmp_path, monkeypatch):
    """The same two prompts and seeds on grey through ``clipmill run``: the shipped model's clips
    record a peak within its range; a copy whose vae/config.json says 0.18215 overshoots it, and
    every clip is rejected with the ``decode`` reason (job table, sidecar, review kinds)."""
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
    limit = model_info("shapes").decode_range
    peaks = {}
    for name, model in (("good", "shapes"), ("wrong", str(wrong))):
        url = f"sqlite:///{tmp_path / name}.db"
        monkeypatch.setenv("CLIPMILL_DATABASE_URL", url)
        res = CliRunner().invoke(main, ["run", "b.csv", "--model", model, "--out", name, "--batch", name,
                                        "--max-attempts", "1", "--draws", "1"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        with Database(url).session() as s:
            pairs = list(s.execute(select(Job, Attempt).join(Attempt, Attempt.job_id == Job.id)))
        assert len(pairs) == 2
        for j, a in pairs:
            sidecar = json.loads((tmp_path / name / j.batch_id / str(j.id) / f"a{a.number}.json").read_text())
            assert sidecar["timings"]["decode_range"] == a.timings["decode_range"] == limit
            peaks.setdefault(name, []).append(a.timings["decode_peak"])
            decode = [r for r in a.reasons if r.startswith("decode:")]
            assert decode == [r for r in sidecar["qc"]["reasons"] if r.startswith("decode:")]
            if name == "good":
                assert not decode
            else:
                assert j.state == "rejected" and a.verdict == "reject" and ",decode," in j.qc_kinds
                assert decode[0].startswith(f"decode: the VAE's output reached {a.timings['decode_peak']:.2f} before")
    assert max(peaks["good"]) <= limit < min(peaks["wrong"]), peaks


def test_the_range_is_measured_on_good_renders_at_the_sizes_the_model_takes():
    """``train-model`` writes ``decode_range`` from the exported model's own renders
    (``measure_decode_range``; the shipped one from 32 prompts per size and tier)."""
    from clipmill.jobs.cli.train import clean_caption
    from clipmill.pipeline.train.export import RANGE_SHAPES, measure_decode_range

    shipped = json.loads((SHAPES_DIR / "clipmill.json").read_text())
    assert shipped["decode_range"] == 1.3 and max(shipped["decode_range_measured"]["peaks"].values()) == 1.2439
    value, peaks = measure_decode_range(SHAPES_DIR, clean_caption, clips=2)
    assert sorted(peaks) == sorted(f"{tier} {f} frames {s}x{s}" for f, s in RANGE_SHAPES for tier in ("fast", "quality"))
    assert all(0.5 < p <= max(peaks.values()) < shipped["decode_range"] for p in peaks.values()), peaks
    # the largest peak plus 0.05, rounded up to the next 0.05
    assert value - 0.05 < max(peaks.values()) + 0.05 <= value and round(value / 0.05, 6).is_integer(), (value, peaks)
