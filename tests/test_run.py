"""`clipmill run` end to end on the tiny model, in a real subprocess, against real databases."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Job
from clipmill.pipeline.video import probe

BATCH = (
    "id,dish,store,subject,action,scene,camera,fps,seed\n"
    "r1,tonkotsu ramen,Menya Kaz,,,,dolly in,30,11\n"
    "r2,红烧肉,老街面馆,,,,特写,60,12\n"
    "r3,,,a barista,pours latte art,in a sunlit cafe,push in,24,13\n"
    "r4,,,一碗牛肉面,冒着热气,在兰州拉面馆里,环绕,30,14\n"
    "r5,dumplings,Golden Lotus,,,,orbit,30,15\n"
)


def clipmill(*args, db_url, cwd, check=True):
    env = dict(os.environ, CLIPMILL_DATABASE_URL=db_url)
    proc = subprocess.run(
        [sys.executable, "-m", "clipmill.jobs.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
def test_run_end_to_end(db_url, tmp_path):
    (tmp_path / "ads.csv").write_text(BATCH)
    out = tmp_path / "out"
    proc = clipmill(
        "run", "ads.csv", "--batch", "ads", "--out", str(out), "--size", "64", "--frames", "8", "--max-attempts", "1",
        "--template", "{dish} on a table in {store}, {camera}", db_url=db_url, cwd=tmp_path,
    )
    assert "random weights: its clips are noise" in proc.stderr  # the tiny-model warning
    assert "seconds per clip" in proc.stdout and str(out / "ads") in proc.stdout

    db = Database(db_url)
    with db.session() as s:
        jobs = s.scalars(select(Job).where(Job.batch_id == "ads").order_by(Job.id)).all()
        attempts = {a.job_id: a for a in s.scalars(select(Attempt))}
    assert len(jobs) == 5
    sizes = set()
    for job in jobs:
        a = attempts[job.id]
        sizes.add(a.group_size)
        assert job.state in ("passed", "rejected")
        assert a.state == job.state and a.verdict == {"passed": "pass", "rejected": "reject"}[job.state]
        assert (a.number, a.tier, a.steps, a.seed, a.model, a.sampler) == (1, "fast", 6, job.seed, "tiny", "lightning")
        assert a.raw_key is None and a.error is None
        folder = out / "ads" / str(job.id)
        assert sorted(p.name for p in folder.iterdir()) == ["a1.jpg", "a1.json", "a1.mp4", "a1.sheet.png"]  # raw frames removed
        assert a.location == str(folder / "a1.mp4")

        info = probe(folder / "a1.mp4")
        assert (info["codec"], info["pix_fmt"], info["width"], info["height"]) == ("h264", "yuv420p", 64, 64)
        assert info["frames"] == round((8 - 1) * job.fps / 24) + 1
        assert info["fps"] == pytest.approx(job.fps)

        side = json.loads((folder / "a1.json").read_text())
        assert side["prompt_raw"] == job.prompt_raw and side["prompt"] == job.prompt
        assert (side["seed"], side["model"], side["tier"], side["steps"]) == (job.seed, "tiny", "fast", 6)
        assert side["frames"] == info["frames"] and side["fps"] == job.fps and side["fps_rendered"] == 24
        assert side["qc"]["verdict"] == a.verdict and side["qc"]["reasons"] == a.reasons
        assert side["files"] == {"clip": f"ads/{job.id}/a1.mp4", "poster": f"ads/{job.id}/a1.jpg",
                                 "sidecar": f"ads/{job.id}/a1.json", "sheet": f"ads/{job.id}/a1.sheet.png"}
        assert (folder / "a1.sheet.png").read_bytes()[:4] == b"\x89PNG"
        for k in ("text_s", "denoise_s", "decode_s", "render_s", "retime_s", "h264_s", "qc_s", "post_s"):
            assert side["timings"][k] >= 0
        assert (folder / "a1.jpg").read_bytes()[:2] == b"\xff\xd8"

        # `clipmill qc` on the stored file says what the pipeline stored
        qc = json.loads(clipmill("qc", str(folder / "a1.mp4"), "--json", db_url=db_url, cwd=tmp_path).stdout)
        assert set(qc) == {"path", "verdict", "reasons", "metrics"}
        assert (qc["verdict"], qc["reasons"]) == (a.verdict, a.reasons)
    assert sizes == {4, 1}  # five compatible jobs: a group of four, then one
    assert jobs[1].prompt == "红烧肉 on a table in 老街面馆, close-up"

    st = json.loads(clipmill("status", "ads", "--json", db_url=db_url, cwd=tmp_path).stdout)
    assert st["jobs"] == 5 and st["states"]["passed"] + st["states"]["rejected"] == 5
    db.dispose()


def test_run_records_and_prints_adherence_for_prompts_in_the_shapes_grammar(sqlite_url, tmp_path):
    from clipmill.pipeline import shapes
    from clipmill.pipeline.video import decode
    from clipmill.qc import adherence

    (tmp_path / "mix.csv").write_text(
        "id,prompt,seed\n"
        "en,\"a red circle moves right on a black background, static shot\",5\n"
        "zh,白色圆形向上移动，灰色背景，变焦推进,6\n"
        "ad,\"a bowl of ramen on a table, dolly in\",7\n"
    )
    out = tmp_path / "out"
    proc = clipmill("run", "mix.csv", "--batch", "mix", "--out", str(out), "--size", "64", "--frames", "8",
                    "--max-attempts", "1", db_url=sqlite_url, cwd=tmp_path)
    assert "adherence (2 clip(s) with prompts in the shapes grammar" in proc.stdout
    assert "  all: colour " in proc.stdout
    db = Database(sqlite_url)
    with db.session() as s:
        rows = s.execute(select(Job.client_id, Job.id, Attempt.adherence).join(Attempt)).all()
    db.dispose()
    by = {r.client_id: r for r in rows}
    assert by["ad"].adherence is None
    asked = {"en": shapes.Spec("red", "circle", "moves right", "black", "static shot"),
             "zh": shapes.Spec("white", "circle", "moves up", "grey", "zoom in")}
    for cid, spec in asked.items():
        rec = by[cid].adherence
        assert rec["asked"] == spec.as_dict()
        # what was recorded is what the analyzer reads in the delivered H.264 file
        read = adherence.analyze(decode(out / "mix" / str(by[cid].id) / "a1.mp4")[0]).label()
        assert rec["read"] == read
        assert rec["match"] == {k: read[k] == getattr(spec, k) for k in shapes.ATTRIBUTES}
        side = json.loads((out / "mix" / str(by[cid].id) / "a1.json").read_text())
        assert side["adherence"] == rec
        assert f"job {by[cid].id} (line " in proc.stdout


@pytest.mark.slow
def test_resume_after_crash_finishes_every_job_once(sqlite_url, tmp_path):
    """A run that died mid-batch (one group claimed by a dead process, one rendered but not
    post-processed) is finished by `run --resume`: no job lost, no clip duplicated."""
    from clipmill.jobs.core.batches import SubmitOptions, submit
    from clipmill.jobs.core.queue import claim_group
    from clipmill.jobs.runner.stages import WorkerContext, render_group

    (tmp_path / "b.csv").write_text("prompt,size,frames\n" + "".join(f'"dish {i}, orbit",64,8\n' for i in range(4)))
    db = Database(sqlite_url)
    submit(db, tmp_path / "b.csv", SubmitOptions(batch="b", out=str(tmp_path / "out")))
    # a process that exited: its pid is free, so its lease is stale at once
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    owner = f"{socket.gethostname()}:{int(dead.stdout)}"
    claimed_dead = claim_group(db, owner, "b", size=2)
    rendered = claim_group(db, "me:1", "b", size=2)
    done = render_group(WorkerContext(db), [c.attempt_id for c in rendered])
    assert len(done) == 2  # rendered, raw frames stored, never post-processed

    clipmill("run", "--resume", "b", db_url=sqlite_url, cwd=tmp_path)
    with db.session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        attempts = s.scalars(select(Attempt).order_by(Attempt.job_id, Attempt.number)).all()
    assert all(j.state in ("passed", "rejected") for j in jobs)
    by_job = {j.id: [a for a in attempts if a.job_id == j.id] for j in jobs}
    for c in claimed_dead:  # abandoned attempt 1, fresh attempt 2 (a lost attempt does not count against
        mine = by_job[c.job_id]  # --max-attempts 2: a QC reject of attempt 2 is still retried, as attempt 3)
        assert [(a.number, a.state) for a in mine][0] == (1, "failed")
        assert mine[1].state in ("passed", "rejected")
        checked = [a.number for a in mine[1:]]
        assert checked == ([2] if mine[1].state == "passed" else [2, 3]) and mine[-1].tier == (
            mine[1].tier if mine[1].state == "passed" else "quality")
        files = sorted(p.name for p in (tmp_path / "out" / "b" / str(c.job_id)).iterdir())
        assert files == sorted(f"a{n}{suffix}" for n in checked for suffix in (".jpg", ".json", ".mp4", ".sheet.png"))
    for c in rendered:  # post-processed from the stored frames, not rendered again
        first = by_job[c.job_id][0]
        assert (first.number, first.group_id) == (1, by_job[rendered[0].job_id][0].group_id)
        assert first.state in ("passed", "rejected") and first.verdict is not None
        files = sorted(p.name for p in (tmp_path / "out" / "b" / str(c.job_id)).iterdir())
        assert files[:4] == ["a1.jpg", "a1.json", "a1.mp4", "a1.sheet.png"]
        assert len(by_job[c.job_id]) == (1 if first.state == "passed" else 2)  # a QC reject is retried once
    db.dispose()


@pytest.mark.slow
def test_qc_reject_is_retried_at_quality_tier_with_a_new_seed(sqlite_url, tmp_path):
    """The tiny model renders noise, which QC rejects: each job gets attempt 1 at its own tier
    and seed, then attempt 2 at `quality` with a new seed; both are kept; then it is out of attempts."""
    from clipmill.jobs.core.queue import attempt_seed

    (tmp_path / "r.csv").write_text('prompt,seed,tier\n"a bowl of ramen, orbit",7,fast\n')
    proc = clipmill("--log-json", "-v", "run", "r.csv", "--batch", "r", "--out", str(tmp_path / "out"), "--size", "64",
                    "--frames", "8", "--max-attempts", "2", db_url=sqlite_url, cwd=tmp_path)
    logs = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    verdicts = [r for r in logs if r["logger"] == "clipmill.stages" and r["msg"].startswith("reject")]
    assert [(r["batch"], r["attempt"]) for r in verdicts] == [("r", 1), ("r", 2)]  # structured, with ids
    assert verdicts[0]["msg"].startswith("reject (retry queued): ")
    db = Database(sqlite_url)
    with db.session() as s:
        job = s.scalars(select(Job)).one()
        attempts = s.scalars(select(Attempt).order_by(Attempt.number)).all()
    assert job.state == "rejected" and job.attempts_made == 2
    assert [(a.number, a.tier, a.steps, a.seed, a.state) for a in attempts] == [
        (1, "fast", 6, 7, "rejected"),
        (2, "quality", 8, attempt_seed(7, 2), "rejected"),
    ]
    assert attempt_seed(7, 2) != 7 and all(a.reasons for a in attempts)
    assert sorted(p.name for p in (tmp_path / "out" / "r" / str(job.id)).iterdir()) == [
        "a1.jpg", "a1.json", "a1.mp4", "a1.sheet.png", "a2.jpg", "a2.json", "a2.mp4", "a2.sheet.png"]
    st = json.loads(clipmill("status", "r", "--json", db_url=sqlite_url, cwd=tmp_path).stdout)
    assert st["out_of_attempts"] == 1 and st["passed_on_retry"] == 0
    assert st["rows"][0]["out_of_attempts"] is True
    text = clipmill("status", "r", db_url=sqlite_url, cwd=tmp_path).stdout
    assert "out of attempts (2/2)" in text
    db.dispose()


@pytest.fixture(scope="module")
def renderer(tiny_cache):
    from clipmill.pipeline.models import model_info
    from clipmill.pipeline.render import Renderer

    return Renderer(model_info("tiny"))


@pytest.mark.slow
def test_same_seed_same_frames_and_group_does_not_change_a_clip(renderer):
    from clipmill.pipeline.render import ClipRequest, GroupSettings

    reqs = [ClipRequest(i, f"clip number {i}, orbit", 100 + i, 8, 64, 64) for i in range(4)]
    for sampler in ("lightning", "lcm"):
        settings = GroupSettings("fast", sampler)
        alone = renderer.render([reqs[2]], settings)[0].frames
        again = renderer.render([reqs[2]], settings)[0].frames
        group = renderer.render(reqs, settings)
        assert np.array_equal(alone, again)
        diff = np.abs(group[2].frames.astype(int) - alone.astype(int))
        assert diff.max() <= 2 and diff.mean() < 0.05, (sampler, diff.max(), diff.mean())
        assert np.abs(group[1].frames.astype(int) - group[2].frames.astype(int)).mean() > 1  # seeds differ
        assert [r.key for r in group] == [0, 1, 2, 3]


def test_group_with_mixed_sizes_is_refused(renderer):
    from clipmill.pipeline.render import ClipRequest, GroupSettings

    with pytest.raises(ValueError, match="same frames, width and height"):
        renderer.render([ClipRequest(0, "a", 1, 8, 64, 64), ClipRequest(1, "b", 2, 8, 96, 64)], GroupSettings())


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_an_interrupted_run_puts_its_group_back_with_attempts_unspent(sqlite_url, tmp_path, how):
    """Ctrl-C (SIGINT) or `docker stop` (SIGTERM) while a group renders is no fault of its jobs:
    the run exits 130 naming `--resume`, the group goes back to queued with no attempt used or
    counted as lost (three interrupts used to fail a healthy job as a worker killer), and the
    resumed run finishes every job once."""
    import signal
    import time

    (tmp_path / "b.csv").write_text("prompt\n" + "".join(f'"dish {i}, orbit"\n' for i in range(2)))
    clipmill("submit", "b.csv", "--batch", "b", "--out", str(tmp_path / "out"), "--size", "256", "--frames", "16",
             db_url=sqlite_url, cwd=tmp_path)
    db = Database(sqlite_url)
    env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url)
    # a shell that starts a job in the background (as CI's may) hands it SIGINT ignored, and
    # Python then never turns Ctrl-C into KeyboardInterrupt: the run gets the default, as at a terminal
    proc = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "run", "--resume", "b"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with db.session() as s:
            owners = [j.lease_owner for j in s.scalars(select(Job).where(Job.state == "rendering"))]
        if owners and all(o and o.split(":")[-1].split(".")[0] == str(proc.pid) for o in owners):
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    else:
        pytest.fail("the run never started rendering")
    proc.send_signal(getattr(signal, how))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stdout + stderr
    assert ("interrupted: the jobs being rendered went back to queued with their attempts unspent; "
            "`clipmill run --resume b` continues the batch") in stderr
    with db.session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        attempts = s.scalars(select(Attempt)).all()
    assert [(j.state, j.attempts_made, j.attempts_lost or 0, j.lease_owner) for j in jobs] == [("queued", 0, 0, None)] * 2
    assert attempts == []

    clipmill("run", "--resume", "b", db_url=sqlite_url, cwd=tmp_path)
    with db.session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
        firsts = {a.job_id: a for a in s.scalars(select(Attempt).where(Attempt.number == 1))}
    assert all(j.state in ("passed", "rejected") and (j.attempts_lost or 0) == 0 for j in jobs)
    assert all(firsts[j.id].state in ("passed", "rejected") for j in jobs)
    db.dispose()
