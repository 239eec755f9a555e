"""Fail fast with honest exit codes, and honest output (issue 10, sections 1 and 2).

Every bad option, file or row is refused before the job table changes and before any render,
with one line naming the option or file, its value and what is allowed: exit 2 for bad input,
3 for setup (model, device, storage). A model that cannot load stops the run once and leaves
the jobs queued with their attempts unspent. Real SQLite / PostgreSQL, real files, real H.264.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from sqlalchemy import select, text

from clipmill.jobs.cli import main
from clipmill.jobs.core.models import Attempt, Job
from clipmill.pipeline.video import decode
from media import write_video

GOOD = 'id,prompt\nr1,"a bowl of ramen, dolly in"\nr2,"sushi on a plate, pan left"\n'
SMALL = ("--size", "64", "--frames", "8")


def snapshot(db) -> dict:
    with db.engine.connect() as c:
        return {t: c.execute(text(f"SELECT * FROM {t} ORDER BY 1")).all()
                for t in ("batches", "jobs", "attempts", "decisions", "alembic_version")}


@pytest.fixture
def cli(db, monkeypatch, tmp_path):
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", db.url)
    monkeypatch.delenv("CLIPMILL_BROKER_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.csv").write_text(GOOD)

    def invoke(*args):
        return CliRunner().invoke(main, list(args), catch_exceptions=False)

    return invoke


def no_credentials(monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def write(path, content: str | bytes) -> None:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


# -- bad input: exit 2, one line, nothing changed --------------------------------------------------

BAD_INPUT = [
    (("run", "good.csv", "--fps", "0"), "Error: --fps 0: out of range; allowed: an integer from 8 to 120"),
    (("submit", "good.csv", "--fps", "121"), "Error: --fps 121: out of range; allowed: an integer from 8 to 120"),
    (("run", "good.csv", "--frames", "99"),
     "Error: Invalid value for --frames: 99: the animatediff model takes an integer from 8 to 32 frames"),
    (("submit", "good.csv", "--size", "100"), "Error: Invalid value for --size: '100' is not a size this model takes; "
     "allowed: WIDTHxHEIGHT or N, each a multiple of 16 from 64 to 1536"),
    (("run", "good.csv", "--group-size", "0"), "Error: Invalid value for '--group-size': 0 is not in the range 1<=x<=16."),
    (("run", "good.csv", "--max-attempts", "0"), "Error: --max-attempts 0: out of range; allowed: 1 to 10"),
    (("submit", "good.csv", "--max-lost", "0"), "Error: --max-lost 0: out of range; allowed: 1 to 10"),
    (("submit", "good.csv", "--priority", "5000"),
     "Error: --priority 5000: out of range; allowed: an integer from -1000 to 1000 (higher goes first)"),
    (("run", "good.csv", "--guidance", "0.5"), "Error: --guidance 0.5: out of range; allowed: 1 (off) to 30"),
    (("run", "good.csv", "--guidance", "3", "--guidance-mode", "rcfg-self"),
     "Error: Invalid value for --guidance-mode: guidance 3 with rcfg-self: R-CFG diverges at guidance 2 and above"),
    (("run", "good.csv", "--device", "foo"), "Error: --device 'foo': not a device; allowed: cpu, cuda, cuda:N, mps"),
    (("run", "good.csv", "--model", "nope"),
     "Error: --model 'nope': no such folder; pass 'tiny'"),  # the built-in names, or a model folder
    (("submit", "good.csv", "--batch", "bad name!"),
     "Error: --batch 'bad name!': not a valid name; allowed: 1-80 letters, digits, '.', '_' or '-'"),
    (("run", "missing.csv"), "Error: missing.csv: no such file; nothing submitted"),
    (("submit", "folder.csv"), "Error: Invalid value for 'FILE': File 'folder.csv' is a directory."),
    (("run", "u16.csv"),
     "Error: u16.csv: is encoded as UTF-16LE (it starts with its byte-order mark); save it as UTF-8; nothing submitted"),
    (("submit", "u16nobom.csv"),
     "Error: u16nobom.csv: looks encoded as UTF-16LE (every other byte is NUL); save it as UTF-8; nothing submitted"),
    (("run", "noheader.csv"), "noheader.csv:1: the first line must name the columns (a header such as prompt, or "
     "id,prompt,tier); it reads 'a bowl of ramen, dolly in,sushi', which names no column; allowed: id, prompt,"),
    (("submit", "bigrow.csv"), "bigrow.csv:3: the row is 70003 bytes; the limit is 65536 bytes (64 KiB) per row"),
    (("submit", "bigrow.jsonl"), "bigrow.jsonl:2: the row is 70014 bytes; the limit is 65536 bytes (64 KiB) per row"),
    (("interpolate", "good.csv", "o.mp4", "--fps", "nan"),  # NaN passes a plain range: no comparison is true
     "Error: Invalid value for '--fps': 'nan' is not a number in the range 1<=x<=240"),
    (("status", "--watch", "nan"), "Error: Invalid value for '--watch': 'nan' is not a number in the range 0.5<=x<=3600"),
    (("nightly", "--interval", "-5", "--deadline", "+1"),
     "Error: Invalid value for '--interval': -5.0 is not in the range 0.1<=x<=3600."),
    (("train-model", "--seed", "-1"), "Error: Invalid value for '--seed': -1 is not in the range 0<=x<=4294967295."),
    (("train-model", "--stages", ""),
     "Error: Invalid value for --stages: '' names no stage; give one or more of vae, text, teacher, student, decoder"),
    (("cancel", "99999999999999999999999"), "Error: '99999999999999999999999': no batch or job of that name or id"),
    (("cancel", "²"), "Error: '²': no batch or job of that name or id"),  # Unicode digits are no job id
    (("status", "good", "--limit", "99999999999999"),
     "Error: Invalid value for '--limit': 99999999999999 is not in the range 0<=x<=1000000000."),
    (("submit", "good.csv", "--batch", "18"), "Error: --batch '18': not a valid name; allowed: 1-80 letters, digits, "
     "'.', '_' or '-', starting with a letter or digit, not digits alone (they name a job)"),
    (("submit", "good.csv", "--batch", "nl\n"), "Error: --batch 'nl\\n': not a valid name"),
    (("bench", "--model", "tiny", "--frames", "0"),  # was the model's default frame count
     "Error: Invalid value for --frames: 0: the animatediff model takes an integer from 8 to 32 frames"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_and_the_job_table_unchanged(cli, db, tmp_path, args, message):
    assert cli("submit", "good.csv", "--batch", "before").exit_code == 0
    (tmp_path / "folder.csv").mkdir()
    write(tmp_path / "u16.csv", GOOD.encode("utf-16"))
    write(tmp_path / "u16nobom.csv", GOOD.encode("utf-16-le"))
    write(tmp_path / "noheader.csv", '"a bowl of ramen, dolly in",sushi\n"tea, static shot",x\n')
    write(tmp_path / "bigrow.csv", 'prompt\n"ramen, orbit"\n"' + "x" * 70000 + '"\n')
    write(tmp_path / "bigrow.jsonl", '{"prompt": "ramen, orbit"}\n{"prompt": "' + "x" * 70000 + '"}\n')
    before = snapshot(db)
    res = cli(*args)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output
    assert snapshot(db) == before
    assert not (tmp_path / "clipmill-out").exists()  # nothing rendered, nothing stored


# -- setup: exit 3, one line, nothing changed --------------------------------------------------------

def test_setup_problems_exit_3_before_the_job_table_changes(cli, db, tmp_path, monkeypatch):
    import torch

    from clipmill.pipeline.models import tiny_path

    assert cli("submit", "good.csv", "--batch", "before").exit_code == 0
    before = snapshot(db)

    def refused(*args) -> str:
        res = cli(*args)
        assert res.exit_code == 3, res.output
        assert "Traceback" not in res.output
        assert snapshot(db) == before
        return [line for line in res.output.splitlines() if line.startswith("Error: ")][0]

    if not torch.cuda.is_available():
        assert refused("run", "good.csv", "--device", "cuda") == (
            "Error: --device cuda: this torch build has no CUDA support; allowed here: cpu"
            if torch.version.cuda is None else
            "Error: --device cuda: no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES); allowed here: cpu")
    line = refused("run", "good.csv", "--device", "cuda:99")
    assert line.startswith("Error: --device cuda:99: ") and "allowed here: cpu" in line

    write(tmp_path / "afile", "")
    assert refused("run", "good.csv", "--out", "afile/clips") == f"Error: --out afile/clips: {tmp_path / 'afile'} is a file, not a folder"
    assert refused("submit", "good.csv", "--out", "afile/clips") == f"Error: --out afile/clips: {tmp_path / 'afile'} is a file, not a folder"

    no_credentials(monkeypatch, tmp_path)
    assert refused("run", "good.csv", "--out", "s3://ads/clips").startswith(
        "Error: --out s3://ads/clips: no S3 credentials found (Unable to locate credentials); set AWS_ACCESS_KEY_ID")

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_path(), broken)
    (broken / "unet" / "config.json").unlink()
    assert refused("submit", "good.csv", "--model", str(broken)) == (
        f"Error: --model {broken}: {broken / 'unet' / 'config.json'} is missing; model_index.json names a "
        "UNetMotionModel there (save the pipeline again with save_pretrained)")
    (broken / "unet" / "config.json").write_text("{not json")
    assert refused("run", "good.csv", "--model", str(broken)).startswith(
        f"Error: --model {broken}: {broken / 'unet' / 'config.json'}: not valid JSON (Expecting property name")
    shutil.copy(tiny_path() / "unet" / "config.json", broken / "unet" / "config.json")
    shutil.rmtree(broken / "vae_tiny")
    assert refused("run", "good.csv", "--model", str(broken), "--decoder", "tiny") == (
        f"Error: --decoder tiny: {broken / 'vae_tiny'} is missing; the model folder has no AutoencoderTiny; "
        "allowed here: --decoder vae")
    assert not (tmp_path / "clipmill-out").exists()


def test_a_model_that_cannot_load_stops_the_run_once_and_leaves_the_jobs_queued(cli, db, tmp_path):
    """Its configs load (preflight passes) but its weights do not: the first group's claims are
    undone, the run stops with exit 3, and no job has used an attempt."""
    from clipmill.pipeline.models import tiny_path

    broken = tmp_path / "weights-gone"
    shutil.copytree(tiny_path(), broken)
    weights = broken / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    res = cli("run", "good.csv", "--model", str(broken), "--batch", "wg", "--group-size", "1", *SMALL)
    assert res.exit_code == 3, res.output
    assert "Traceback" not in res.output
    error = [line for line in res.output.splitlines() if line.startswith("Error: ")]
    assert len(error) == 1 and error[0].startswith(f"Error: the model {broken} does not load on cpu (")
    assert error[0].endswith("; the run stopped and the batch's jobs stay queued (`clipmill run --resume wg` continues it)")
    with db.session() as s:
        jobs = s.scalars(select(Job).where(Job.batch_id == "wg").order_by(Job.id)).all()
        assert [(j.state, j.attempts_made, j.lease_owner) for j in jobs] == [("queued", 0, None)] * 2
        assert s.scalars(select(Attempt).join(Job).where(Job.batch_id == "wg")).all() == []


# -- exit 1 when a job failed; progress as plain lines; status piped ------------------------------------

@pytest.mark.slow
def test_run_exits_1_when_a_job_failed_and_shows_plain_progress_and_full_paths(cli, db, tmp_path):
    from clipmill.jobs.core.queue import claim_group
    from clipmill.jobs.core.states import JobState, move_job

    out = tmp_path / ("a-storage-root-with-a-long-name-" * 6)  # paths over the 160 columns of a pipe
    assert cli("submit", "good.csv", "--batch", "b", "--out", str(out), "--max-attempts", "1", *SMALL).exit_code == 0
    (first,) = claim_group(db, "w", "b", size=1)
    with db.session() as s, s.begin():
        move_job(s, first.job_id, JobState.RENDERING, JobState.FAILED, error="boom", lease_owner=None)
    res = cli("run", "--resume", "b")
    assert res.exit_code == 1, res.output  # a job of the batch failed
    lines = res.output.splitlines()
    assert "batch b: 1/2 jobs done; rendering groups of up to 4 on cpu" in lines
    assert any(line.startswith("group 1: 1 clip(s) rendered; jobs done 1/2, 2 renders, ") for line in lines), lines
    assert any(line.startswith("batch b: jobs done 2/2, 2 renders, ") for line in lines), lines
    assert "Traceback" not in res.output
    with db.session() as s:
        location = s.scalar(select(Attempt.location).where(Attempt.location.is_not(None)))
    assert len(location) > 160
    for args in (("status", "b"), ("run", "--resume", "b")):  # the summary's files line too
        res = cli(*args)
        assert str(out) in res.output, res.output
    assert location in cli("status", "b").output
    res = cli("status")
    header = res.output.splitlines()[0].split()
    assert header == ["batch", "jobs", "queued", "running", "passed", "rejected", "failed", "approved", "declined",
                      "cancelled", "created"]
    assert res.output.splitlines()[1].split()[:2] == ["b", "2"]


def test_status_elapsed_stops_when_the_batch_ends(db):
    from datetime import datetime, timedelta, timezone

    from clipmill.jobs.core.batches import progress

    t0 = datetime(2026, 11, 29, 21, 0, tzinfo=timezone.utc)
    assert progress(4, 0, t0, t0 + timedelta(seconds=95))["elapsed_s"] == 95.0
    assert progress(4, 1, t0, t0 + timedelta(seconds=95))["elapsed_s"] > 95.0  # still running: the clock runs


# -- retry --rejected ----------------------------------------------------------------------------------

def test_retry_rejected_requeues_each_job_once_at_the_quality_tier(cli, db, tmp_path):
    from clipmill.jobs.core.operations import retry
    from clipmill.jobs.core.queue import claim_group
    from clipmill.jobs.core.states import AttemptState, JobState, move_attempt, move_job

    assert cli("submit", "good.csv", "--batch", "r", "--max-attempts", "1", *SMALL).exit_code == 0
    claimed = claim_group(db, "w", "r", size=2)
    with db.session() as s, s.begin():
        for c in claimed:
            move_attempt(s, c.attempt_id, AttemptState.RENDERING, AttemptState.RENDERED)
            move_attempt(s, c.attempt_id, AttemptState.RENDERED, AttemptState.REJECTED, verdict="reject")
            move_job(s, c.job_id, JobState.RENDERING, JobState.POST)
            move_job(s, c.job_id, JobState.POST, JobState.REJECTED)
    a, b = sorted(c.job_id for c in claimed)
    assert retry(db, "r") == []  # --failed only: a rejected job is not failed
    results: list[list[int]] = []
    threads = [threading.Thread(target=lambda: results.append(retry(db, str(a), failed=False, rejected=True)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(sum(results, [])) == [a]  # queued exactly once, whoever won
    res = cli("retry", "r", "--rejected")
    assert res.exit_code == 0 and res.output.strip() == f"queued 1 job(s) again: {b}"
    assert cli("retry", "r", "--rejected").output.strip() == "queued 0 job(s) again"
    with db.session() as s:
        assert [(j.state, j.tier) for j in s.scalars(select(Job).where(Job.batch_id == "r").order_by(Job.id))] == [
            ("queued", "quality")] * 2
    again = claim_group(db, "w", "r", size=2)
    with db.session() as s:
        atts = [s.get(Attempt, c.attempt_id) for c in again]
        jobs = [s.get(Job, c.job_id) for c in again]
        assert [(x.number, x.tier) for x in atts] == [(2, "quality")] * 2
        assert all(x.seed != j.seed for x, j in zip(atts, jobs))  # a new seed for the new attempt


# -- no password in what is printed ---------------------------------------------------------------------

def test_database_url_is_printed_without_its_password(pg_url, tmp_path, monkeypatch):
    url = pg_url.replace("postgres@", "postgres:s3cret-pw@", 1)
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", url)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.csv").write_text(GOOD)
    res = CliRunner().invoke(main, ["submit", "good.csv", "--batch", "pw"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "batch pw: 2 job(s) queued in postgresql+psycopg://postgres:***@127.0.0.1" in res.output
    assert "s3cret-pw" not in res.output


# -- QC reasons read true ---------------------------------------------------------------------------------

def test_qc_reasons_show_enough_digits_for_the_comparison_to_read_true():
    from clipmill.qc.check import _cmp

    assert _cmp(0.71999, "<", 0.72, 2) == "0.71999 < 0.72"  # never '0.72 < 0.72'
    assert _cmp(0.7151, "<", 0.72, 2) == "0.715 < 0.72"
    assert _cmp(0.5, "<", 0.72, 2) == "0.50 < 0.72"
    assert _cmp(12.04, ">", 12.0, 1, fixed_limit=True) == "12.04 > 12.00"
    assert _cmp(2.5004, ">", 2.5, 1) == "2.5004 > 2.5"
    assert _cmp(0.5996, "<", 0.6, 0, pct=True) == "59.96% < 60%"


def test_every_qc_reason_on_broken_clips_compares_truly():
    import re

    from clipmill.qc import check_frames
    from clipmill.qc.synth import make_set

    pattern = re.compile(r"(-?\d+(?:\.\d+)?)(%?) ([<>]) (-?\d+(?:\.\d+)?)(%?)")
    seen = 0
    for clip in make_set(seed=3, per_motion=1, size=(160, 96), n=24):
        for reason in check_frames(clip.frames, clip.fps).reasons:
            for v, _, op, lim, _ in pattern.findall(reason):
                seen += 1
                assert (float(v) < float(lim)) if op == "<" else (float(v) > float(lim)), reason
    assert seen > 0


# -- files given to qc, interpolate and export ---------------------------------------------------------------

def test_qc_reports_unreadable_files_as_errors_never_verdicts(tmp_path):
    from clipmill.pipeline.video import encode_h264

    rng = np.random.default_rng(0)
    encode_h264(rng.integers(0, 255, (12, 64, 64, 3), dtype=np.uint8), 24, tmp_path / "ok.mp4")
    (tmp_path / "folder.mp4").mkdir()
    (tmp_path / "text.mp4").write_text("not a video")
    encode_h264(rng.integers(0, 255, (12, 12, 12, 3), dtype=np.uint8), 24, tmp_path / "tiny.mp4")
    files = [str(tmp_path / n) for n in ("missing.mp4", "folder.mp4", "text.mp4", "tiny.mp4", "ok.mp4")]
    res = CliRunner().invoke(main, ["qc", *files])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"error: {files[0]}: no such file",
        f"error: {files[1]}: is a folder; give a file",
        f"error: {files[2]}: not a readable video (Invalid data found when processing input)",
        f"error: {files[3]}: frames of 12x12 px: QC needs at least 32 px a side (its optical flow cannot follow less)",
        "4 of 5 file(s) could not be read or checked",
    ]
    assert res.stdout.split()[1] == files[4]  # the readable file still gets its verdict
    assert "reject missing" not in res.output and "Errno" not in res.output


def _h264_ts(path) -> None:
    """A real H.264 clip in MPEG-TS, which FFmpeg reads from a pipe (an MP4 needs to seek)."""
    from clipmill.pipeline.synthetic import camera_move, photo

    write_video(path, camera_move(photo("astronaut"), "pan", 24, (256, 144), np.random.default_rng(0)), container="mpegts")


def test_qc_reads_a_clip_from_a_pipe_or_a_fifo(tmp_path):
    """check_input_file read one byte to test readability: through a pipe (`clipmill qc
    <(cat clip.ts)`) that byte was gone and the clip read as "not a readable video"; from a FIFO
    the writer died of SIGPIPE and QC waited for ever. Only regular files are read ahead now.
    `clipmill interpolate` from a pipe writes the video and says the audio is not carried."""
    import subprocess
    import sys

    _h264_ts(tmp_path / "clip.ts")
    cmd = f"{sys.executable} -m clipmill.jobs.cli qc --json <(cat clip.ts) clip.ts"
    proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    piped, direct = (json.loads(line) for line in proc.stdout.splitlines())
    assert piped["path"].startswith("/dev/fd/") and direct["path"] == "clip.ts"
    assert (piped["verdict"], piped["metrics"]["frames"]) == (direct["verdict"], direct["metrics"]["frames"]) == ("pass", 24)
    # interpolate reads a pipe once: its frames, not its sound (a second read of the pipe failed)
    cmd = f"{sys.executable} -m clipmill.jobs.cli interpolate <(cat clip.ts) out.mp4 --fps 30"
    proc = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "not a regular file (a pipe); its audio, if any, is not carried over" in proc.stderr, \
        proc.stderr
    assert len(decode(tmp_path / "out.mp4")[0]) == 30

    fifo = tmp_path / "fifo.ts"
    os.mkfifo(fifo)
    data = (tmp_path / "clip.ts").read_bytes()

    def writer():
        with open(fifo, "wb") as f:  # blocks until QC opens the FIFO
            f.write(data)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "qc", str(fifo)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"pass {fifo}"]
    t.join(10)


def test_interpolate_refuses_bad_destinations_before_any_work(tmp_path):
    from clipmill.pipeline.video import encode_h264

    src = tmp_path / "in.mp4"
    encode_h264(np.zeros((6, 32, 32, 3), np.uint8), 24, src)
    (tmp_path / "dir").mkdir()
    cases = [
        (["interpolate", str(src), str(tmp_path / "out.avi"), "--fps", "30"],
         f"Error: DST {tmp_path / 'out.avi'}: unknown output extension '.avi'; allowed: .mp4 (H.264 in MP4)"),
        (["interpolate", str(src), str(tmp_path / "nowhere" / "out.mp4"), "--fps", "30"],
         f"Error: DST {tmp_path / 'nowhere' / 'out.mp4'}: the folder {tmp_path / 'nowhere'} does not exist; create it first"),
        (["interpolate", str(src), str(src), "--fps", "30"],
         f"Error: DST {src}: is SRC itself; write to another file (SRC would be overwritten)"),
        (["interpolate", str(tmp_path / "dir"), str(tmp_path / "o.mp4"), "--fps", "30"],
         f"Error: Invalid value for '[SRC]': File '{tmp_path / 'dir'}' is a directory."),
        (["interpolate", str(tmp_path / "missing.mp4"), str(tmp_path / "o.mp4"), "--fps", "30"],
         f"Error: SRC {tmp_path / 'missing.mp4'}: no such file"),
    ]
    size = src.stat().st_size
    for args, message in cases:
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2, res.output
        assert message in res.output
        assert "Traceback" not in res.output
    assert src.stat().st_size == size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "in.mp4"]


def test_export_with_nothing_approved_or_no_credentials(cli, db, tmp_path, monkeypatch):
    assert cli("submit", "good.csv", "--batch", "e").exit_code == 0
    res = cli("export", "e", "--to", "delivery")
    assert res.exit_code == 1
    assert res.output.strip() == ("batch e: no approved clips, nothing exported; approve clips on the review page "
                                  "(clipmill review e) first")
    assert not (tmp_path / "delivery").exists()
    no_credentials(monkeypatch, tmp_path)
    res = cli("export", "e", "--to", "s3://ads/approved")
    assert res.exit_code == 3
    assert res.output.startswith("Error: --to s3://ads/approved: no S3 credentials found")
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_exit_codes_are_in_the_main_help():
    res = CliRunner().invoke(main, ["--help"])
    assert "Exit codes (every command):" in res.output
    for line in ("0  done: every job passed or was rejected by QC", "1  a job failed, an ad could not be assembled, or export found nothing approved",
                 "2  usage or bad input: nothing was done, the job table is unchanged"):
        assert line in res.output


@pytest.mark.parametrize("url, code, message", [
    ("foo", 2, "Error: CLIPMILL_DATABASE_URL 'foo': not a database URL (Could not parse SQLAlchemy URL"),
    ("sqlite:////nonexistent-dir/x.db", 3,
     "Error: the job table at sqlite:////nonexistent-dir/x.db cannot be opened: unable to open database file"),
])
def test_a_job_table_that_cannot_be_opened_is_one_line(tmp_path, monkeypatch, url, code, message):
    """Every command that opens the job table ended in SQLAlchemy's traceback (exit 1)."""
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", url)
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["status"])
    assert res.exit_code == code and res.output.startswith(message), res.output


def test_a_broker_url_that_does_not_parse_is_refused_before_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPMILL_BROKER_URL", "redis://x:y@[::1")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["reconcile"])
    assert res.exit_code == 2
    assert res.output.startswith("Error: CLIPMILL_BROKER_URL='redis://x:***@[::1': not a URL (Invalid IPv6 URL)")


def test_status_watch_with_json_prints_json(cli, db, tmp_path):
    assert cli("submit", "good.csv", "--batch", "w").exit_code == 0
    with db.session() as s, s.begin():
        for j in s.scalars(select(Job).where(Job.batch_id == "w")):
            j.state = "cancelled"  # nothing open: one report, then it ends
    res = cli("status", "w", "--watch", "1", "--json")
    assert res.exit_code == 0
    (line,) = res.output.splitlines()
    assert json.loads(line)["progress"]["open"] == 0


def test_export_to_an_empty_path_is_refused(cli, db, tmp_path):
    assert cli("submit", "good.csv", "--batch", "e2").exit_code == 0
    for dest in ("", "  "):
        res = cli("export", "e2", "--to", dest)
        assert res.exit_code == 2, res.output
        assert res.output.strip() == (f"Error: --to {dest!r}: an empty path; give a folder (e.g. ./delivery) "
                                      "or s3://bucket/prefix")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("clipmill.db")) == ["good.csv"]


def test_a_first_submit_that_fails_leaves_no_empty_job_table(cli, tmp_path, monkeypatch):
    fresh = tmp_path / "fresh.db"
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", f"sqlite:///{fresh}")
    write(tmp_path / "bad.csv", 'id,prompt\nr1,"a bowl of ramen"\nr2,""\n')
    for args in (("submit", "bad.csv"), ("run", "bad.csv", *SMALL, "--model", "tiny"), ("submit", "missing.csv")):
        res = cli(*args)
        assert res.exit_code == 2, res.output
        assert not any(p.name.startswith("fresh.db") for p in tmp_path.iterdir()), (args, list(tmp_path.iterdir()))
    # a job table that holds batches is never removed by a later bad submit
    assert cli("submit", "good.csv", "--batch", "kept").exit_code == 0
    assert cli("submit", "bad.csv").exit_code == 2
    assert fresh.exists()
    assert "kept" in cli("status").output


@pytest.mark.parametrize("args", [("run", "--resume", "nosuch"), ("status", "nosuch"), ("cancel", "nosuch"),
                                  ("retry", "nosuch", "--failed"), ("export", "nosuch", "--to", "d"),
                                  ("review", "nosuch")])
def test_a_command_about_a_batch_refuses_a_job_table_that_is_not_there(cli, tmp_path, monkeypatch, args):
    """Before, each made an empty clipmill.db where it ran, then said the batch did not exist."""
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", f"sqlite:///{tmp_path / 'none.db'}")
    res = cli(*args)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == (f"Error: no job table at sqlite:///{tmp_path / 'none.db'}: nothing was submitted "
                                  "there; set CLIPMILL_DATABASE_URL to the job table that holds the batch")
    assert not list(tmp_path.glob("none.db*"))


@pytest.mark.parametrize("url, says", [
    ("sqlite://", "an in-memory SQLite database forgets every batch when the command ends; give a file "
                  "(sqlite:///clipmill.db) or a PostgreSQL URL"),
    ("mysql://x/y", "its database driver is not installed (No module named 'MySQLdb'); clipmill's job table is SQLite "
                    "(sqlite:///clipmill.db) or PostgreSQL (postgresql+psycopg://user@host/db)"),
])
def test_a_job_table_url_that_cannot_keep_or_open_a_batch_is_one_line(cli, monkeypatch, url, says):
    """An in-memory SQLite URL said "1 job(s) queued" and the next command found no such batch;
    a dialect whose driver is not installed was a ModuleNotFoundError traceback (exit 1)."""
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", url)
    for args in (("submit", "good.csv", "--model", "tiny"), ("status",)):
        res = cli(*args)
        assert res.exit_code == 2, res.output
        assert res.output.strip().splitlines()[-1] == f"Error: CLIPMILL_DATABASE_URL {url!r}: {says}"


def test_numbers_too_long_or_in_other_digits_and_a_file_too_large_are_named(cli, tmp_path):
    """A seed of 5000 digits (a 5 KB row) was a traceback (Python reads at most 4300 digits),
    in a CSV, a JSONL row or --size; a seed or rate in Arabic-Indic or full-width digits was read
    as the ASCII number without a word; a 1 GB batch file was read whole several times over
    (and a link to /dev/zero for ever)."""
    long = "9" * 5000
    (tmp_path / "long.csv").write_text(f"prompt,seed,fps\na bowl of ramen,{long},３０\n", encoding="utf-8")
    res = cli("prompts", "check", "long.csv", "--model", "tiny")
    assert res.exit_code == 2
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: long.csv:2: seed: '{long[:77]}...' is not a seed; allowed: an integer from 0 to 4294967295",
                      "error: long.csv:2: fps: '３０' is not a frame rate; allowed: an integer from 8 to 120"]
    (tmp_path / "long.jsonl").write_text(f'{{"prompt": "a bowl of ramen", "seed": {long}}}\n')
    res = cli("submit", "long.jsonl", "--model", "tiny")
    assert res.exit_code == 2 and "long.jsonl:1: holds a number of more than 4300 digits; no column takes one" in res.output
    res = cli("submit", "good.csv", "--model", "tiny", "--size", long)
    assert res.exit_code == 2 and "Invalid value for --size: " in res.output and "Traceback" not in res.output
    with open(tmp_path / "huge.csv", "wb") as f:
        f.truncate(101 * 2**20)  # sparse: 101 MiB of zeros, made at once
    res = cli("prompts", "check", "huge.csv", "--model", "tiny")
    assert res.exit_code == 2 and ("error: huge.csv: is larger than 100 MiB, the most a batch file may hold (about half "
                                   "a million prompts); split it into several batches") in res.output


@pytest.mark.parametrize("args, says", [
    (("--tier", "quality"), "--tier cannot be used with --ad: an ad template sets each shot's tier"),
    (("--size", "128"), "--size cannot be used with --ad: an ad template sets each format's size"),
    (("--truncate",), "--truncate cannot be used with --ad: an ad's prompts and texts are checked whole; shorten the "
                      "rows named"),
    (("--skip-invalid",), "--skip-invalid cannot be used with --ad: an ad batch is submitted whole; fix or remove the "
                          "rows named"),
])
def test_options_an_ad_batch_does_not_take_are_refused_not_ignored(cli, db, args, says):
    """They were accepted with --ad and did nothing (--truncate's error then told the user to
    pass --truncate)."""
    from clipmill.jobs.core.models import Batch

    ad = os.path.join(os.path.dirname(__file__), "..", "examples", "ad")
    for command in (("submit",), ("prompts", "check")):
        if command == ("prompts", "check") and "--skip-invalid" in args:
            continue  # prompts check has no --skip-invalid
        res = cli(*command, f"{ad}/ads.csv", "--ad", f"{ad}/local-life.toml", "--model", "tiny", *args)
        assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == f"Error: {says}", res.output
    with db.session() as s:
        assert s.scalars(select(Batch)).all() == []


def test_an_ad_template_with_a_byte_order_mark_a_huge_number_or_a_bare_notify_url(cli, tmp_path):
    """A template saved with a byte-order mark (Windows editors) was "not valid TOML (at line 1,
    column 1)"; a number of 5000 digits a traceback; notify = "http://" passed where --notify
    http:// is refused."""
    ad = os.path.join(os.path.dirname(__file__), "..", "examples", "ad")
    for name in os.listdir(ad):
        shutil.copy(os.path.join(ad, name), tmp_path / name)
    text = (tmp_path / "local-life.toml").read_text(encoding="utf-8")
    (tmp_path / "bom.toml").write_text("\ufeff" + text, encoding="utf-8")
    assert cli("prompts", "check", "ads.csv", "--ad", "bom.toml", "--model", "tiny").exit_code == 0
    (tmp_path / "fps.toml").write_text(text.replace("fps = 30", "fps = " + "9" * 5000, 1), encoding="utf-8")
    res = cli("prompts", "check", "ads.csv", "--ad", "fps.toml", "--model", "tiny")
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == (
        "Error: --ad fps.toml: holds a number of more than 4300 digits; no setting takes one")
    (tmp_path / "notify.toml").write_text('notify = "http://"\n' + text, encoding="utf-8")
    res = cli("prompts", "check", "ads.csv", "--ad", "notify.toml", "--model", "tiny")
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == (
        "Error: notify.toml: notify = 'http://': give an http://HOST/... or https://HOST/... URL")


def test_a_cache_folder_that_cannot_be_written_is_one_line_and_an_empty_one_is_unset(cli, tmp_path, monkeypatch):
    """CLIPMILL_CACHE under a file was a NotADirectoryError traceback; set empty, it built the
    tiny model into the current folder (every other CLIPMILL_ variable reads empty as unset)."""
    from clipmill.pipeline.models import cache_dir

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("CLIPMILL_CACHE", str(tmp_path / "afile" / "x"))
    res = cli("prompts", "check", "good.csv", "--model", "tiny")
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1] == (
        f"Error: model 'tiny' is built on first use in {tmp_path / 'afile' / 'x'} ($CLIPMILL_CACHE, else "
        "~/.cache/clipmill), which cannot be written (Not a directory); set CLIPMILL_CACHE to a writable folder")
    monkeypatch.setenv("CLIPMILL_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "clipmill"
