"""`clipmill run --ad` end to end (issue 12): rows are ads, shots are jobs rendered by the built-in
shapes model (long shots over FreeNoise windows), each ad assembled in every format of the
example template; a kill -9 during assembly, then a resume, leaves one file per ad and format,
the same file a clean run makes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, Job
from clipmill.pipeline.assemble import probe_av

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "examples" / "ad" / "local-life.toml"
# the shots' own QC is not under test here: boiling (the shapes model's known fault) is let through
QC = ("--set", "boiling_excess=1000")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cjk_font")]


def _cmd(*args, db: str, cwd: Path) -> list[str]:
    return [sys.executable, "-m", "clipmill.jobs.cli", *args]


def _env(db: str) -> dict:
    return dict(os.environ, CLIPMILL_DATABASE_URL=db, OMP_NUM_THREADS="1")


def _run(*args, db: str, cwd: Path, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(*args, db=db, cwd=cwd), cwd=cwd, env=_env(db), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc


def _files(out: Path, batch: str) -> dict[str, list[str]]:
    return {p.name: sorted(x.name for x in p.iterdir()) for p in sorted((out / batch / "ads").iterdir())}


def test_run_ad_makes_every_format_of_every_ad(tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    out = tmp_path / "out"
    proc = _run("run", str(ROOT / "examples" / "ad" / "ads.csv"), "--ad", str(TEMPLATE), "--model", "shapes",
                "--batch", "ads", "--out", str(out), *QC, db=db, cwd=tmp_path)
    assert "batch ads: 3 ad(s), 9 shot job(s) queued" in proc.stderr
    assert "ads (3): done 3" in proc.stdout
    with Database(db).session() as s:
        ads = s.scalars(select(Ad).order_by(Ad.id)).all()
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
    assert [a.state for a in ads] == ["done"] * 3 and all(j.state == "passed" for j in jobs)
    assert [(j.ad_id, j.shot, j.frames, j.fps, j.formats) for j in jobs[:3]] == [
        (1, i, 21, 30, ["9x16", "1x1", "16x9"]) for i in range(3)]
    assert _files(out, "ads") == {str(a.id): ["16x9.jpg", "16x9.mp4", "1x1.jpg", "1x1.mp4", "9x16.jpg", "9x16.mp4",
                                              "ad.json"] for a in ads}
    for a in ads:
        side = json.loads((out / "ads" / "ads" / str(a.id) / "ad.json").read_text())
        assert side["values"]["merchant"] == a.values["merchant"] and side["seconds"] == 9.0
        for name, (w, h) in {"9x16": (720, 1280), "1x1": (720, 720), "16x9": (1280, 720)}.items():
            f = a.outputs["formats"][name]
            info = probe_av(out / "ads" / "ads" / str(a.id) / f"{name}.mp4")
            assert (info["width"], info["height"]) == (w, h) and abs(info["seconds"] - 9.0) <= 1 / 30
            assert info["audio"]["codec"] == "aac" and abs(info["audio"]["seconds"] - 9.0) < 0.05
            assert f["qc"]["verdict"] == "pass" and f["bytes"] == info["bytes"]
            assert sorted(u["shot"] for u in f["shots"]) == [0, 1, 2]
            assert side["formats"][name]["sha256"] == f["sha256"]


def test_a_kill_during_assembly_then_a_resume_leaves_one_file_per_ad_and_format(tmp_path):
    csv = tmp_path / "one.csv"
    csv.write_text("id,merchant,price,cta,colour,shape\nlaowang,老王面馆,¥ 29.9,立即下单,green,square\n",
                   encoding="utf-8")
    folder = tmp_path / "ad"  # a copy of the example: it is taken away before the resume
    shutil.copytree(TEMPLATE.parent, folder)
    args = ("--ad", str(folder / TEMPLATE.name), "--model", "shapes", "--batch", "one", *QC)
    # a clean run, for the file a kill must not change
    clean_db, clean_out = f"sqlite:///{tmp_path / 'clean.db'}", tmp_path / "clean"
    _run("run", str(csv), *args, "--out", str(clean_out), db=clean_db, cwd=tmp_path)
    with Database(clean_db).session() as s:
        want = sorted(s.scalars(select(Ad)).one().outputs["formats"])

    db, out = f"sqlite:///{tmp_path / 'k.db'}", tmp_path / "k"
    proc = subprocess.Popen(_cmd("run", str(csv), *args, "--out", str(out), db=db, cwd=tmp_path), cwd=tmp_path,
                            env=_env(db), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    database = Database(db)
    deadline = time.time() + 600
    while time.time() < deadline:  # wait until the first format is stored, then kill mid-assembly
        time.sleep(0.2)
        try:
            with database.session() as s:
                ad = s.scalars(select(Ad)).first()
        except Exception:  # noqa: BLE001 - the schema may not exist yet
            continue
        if ad is not None and ad.state == "assembling" and (out / "one" / "ads" / "1" / "9x16.mp4").exists():
            break
    else:
        proc.kill()
        pytest.fail("the assembly never started")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with database.session() as s:
        assert s.scalars(select(Ad)).one().state == "assembling"  # killed in the middle

    # the resume assembles from the template and files the batch kept at submit, not from their paths
    shutil.rmtree(folder)
    _run("run", "--resume", "one", *QC, db=db, cwd=tmp_path)
    with database.session() as s:
        ad = s.scalars(select(Ad)).one()
    assert ad.state == "done" and ad.lease_owner is None
    assert _files(out, "one") == {"1": ["16x9.jpg", "16x9.mp4", "1x1.jpg", "1x1.mp4", "9x16.jpg", "9x16.mp4", "ad.json"]}
    assert not [p for p in (out / "one").rglob("*") if p.name.startswith(".")]  # no temporary file left
    # the same ad a clean run makes: every frame of every format as the clean run's, to within
    # what x264's threaded encoder varies from run to run (its bytes differ by a few under load)
    from clipmill.pipeline.video import decode

    for name in want:
        got, _ = decode(out / "one" / "ads" / "1" / f"{name}.mp4")
        ref, _ = decode(clean_out / "one" / "ads" / "1" / f"{name}.mp4")
        assert got.shape == ref.shape, name
        mse = float(np.mean((got.astype(np.float64) - ref) ** 2))
        assert mse < 8.0, (name, mse)  # above 39 dB PSNR (another ad, or other footage: hundreds)


@pytest.mark.parametrize("cmd", ["run", "submit"])
def test_a_bad_ad_row_or_template_is_refused_before_any_render_naming_the_row(tmp_path, cmd):
    db = f"sqlite:///{tmp_path / 'b.db'}"
    csv = tmp_path / "bad.csv"
    csv.write_text("id,merchant,price,cta,colour,shape\nok,Lao Wang,1,Go,red,circle\nx,,1,Go,red,circle\n",
                   encoding="utf-8")
    proc = _run(cmd, str(csv), "--ad", str(TEMPLATE), "--model", "shapes", "--out", str(tmp_path / "o"), db=db,
                cwd=tmp_path, code=2)
    assert proc.stderr.strip().splitlines()[-2:] == [
        f"Error: {csv}: 1 problem, nothing submitted:",
        f"{csv}:3: merchant: '' is missing or empty; the template local-life.toml fills {{merchant}} from it (its "
        "placeholders: colour, shape, merchant, price, cta)"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[[formats]]\nsize = [720, 1280]\nmethod = 'stretch'\n")
    proc = _run(cmd, str(csv), "--ad", str(bad), "--model", "shapes", "--out", str(tmp_path / "o"), db=db, cwd=tmp_path,
                code=2)
    assert proc.stderr.strip().splitlines()[-1] == f"Error: {bad}: formats[0].method = 'stretch': allowed: render, crop, pad"
    from sqlalchemy import inspect

    engine = Database(db).engine
    assert not inspect(engine).has_table("ads") or not Database(db).session().scalars(select(Ad)).all()
