"""`export` refuses what it cannot deliver whole, before writing it: a clip missing from
storage, an ad file whose bytes are not what its assembly recorded, two ads that would share a
folder. Real SQLite, real local storage; the job table's rows are written as a finished batch
would have them."""

from __future__ import annotations

import hashlib

import pytest

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, AdDecision, Attempt, Batch, Decision, Job
from clipmill.jobs.review.export import ExportError, export_batch
from clipmill.storage import LocalStorage


@pytest.fixture
def seeded(sqlite_url, tmp_path):
    out = tmp_path / "out"
    db, store = Database(sqlite_url), LocalStorage(str(out))
    with db.session() as s, s.begin():
        s.add(Batch(id="b1", source="x.txt", model="tiny", sampler="lcm", out=str(out)))
        s.add(Batch(id="ads1", source="x.csv", model="tiny", sampler="lcm", out=str(out), ad_template="t.toml"))
        s.flush()
        job = Job(batch_id="b1", line=1, prompt_raw="p", prompt="p", seed=1, tier="fast", frames=8, fps=8, width=64,
                  height=64, state="approved", attempts_made=1)
        s.add(job)
        s.flush()
        store.put_bytes(f"b1/{job.id}/a1.mp4", b"clip")
        a = Attempt(job_id=job.id, number=1, state="passed", tier="fast", steps=6, seed=1, model="tiny", sampler="lcm",
                    guidance=1.0, clip_key=f"b1/{job.id}/a1.mp4", verdict="pass")
        s.add(a)
        s.flush()
        s.add(Decision(job_id=job.id, attempt_id=a.id, decision="approved", from_state="passed", operator="op"))
        ads = [Ad(batch_id="ads1", line=1, client_id="2", values={}, seed=1, state="approved"),
               Ad(batch_id="ads1", line=2, client_id=None, values={}, seed=2, state="approved")]
        for ad, body in zip(ads, (b"AD-ONE", b"AD-TWO")):
            s.add(ad)
            s.flush()
            key = f"ads1/ad{ad.id}/square.mp4"
            store.put_bytes(key, body)
            ad.outputs = {"formats": {"square": {"file": key, "sha256": hashlib.sha256(body).hexdigest(), "width": 64,
                                                 "height": 64, "seconds": 1.0, "shots": []}}}
            s.add(AdDecision(ad_id=ad.id, decision="approved", from_state="passed", operator="op", note=""))
        ids = (job.id, [ad.id for ad in ads])
    yield db, out, ids
    db.dispose()


def test_ads_without_a_row_id_get_their_own_folder(seeded, tmp_path):
    """Ad 2 has no row id, ad 1's row id is "2": both were written to ads1/2/, the second over the first."""
    db, _, (_, (ad1, ad2)) = seeded
    res = export_batch(db, "ads1", str(tmp_path / "d"))
    assert sorted(r["file"] for r in res.rows) == ["ads1/2/square.mp4", f"ads1/ad-{ad2}/square.mp4"]
    assert (tmp_path / "d/ads1/2/square.mp4").read_bytes() == b"AD-ONE"
    assert (tmp_path / f"d/ads1/ad-{ad2}/square.mp4").read_bytes() == b"AD-TWO"


def test_ad_files_whose_bytes_changed_are_refused_before_delivery(seeded, tmp_path):
    db, out, (_, (ad1, _)) = seeded
    (out / f"ads1/ad{ad1}/square.mp4").write_bytes(b"CORRUPTED")
    with pytest.raises(ExportError, match=rf"^ad {ad1} square: the stored file's SHA-256 .* is not the one its assembly"):
        export_batch(db, "ads1", str(tmp_path / "d"))
    assert not (tmp_path / "d/ads1/2/square.mp4").exists()  # used to be delivered first, then refused


def test_a_clip_missing_from_storage_is_one_line_naming_the_job(seeded, tmp_path):
    db, out, (job, _) = seeded
    (out / f"b1/{job}/a1.mp4").unlink()
    with pytest.raises(ExportError) as e:
        export_batch(db, "b1", str(tmp_path / "d"))
    assert str(e.value) == (f"job {job}: its file b1/{job}/a1.mp4 cannot be read from the batch's storage (no such file); "
                            "nothing of it was delivered")


def test_two_ads_that_would_share_a_folder_are_refused(seeded, tmp_path):
    db, _, (_, (ad1, ad2)) = seeded
    with db.session() as s, s.begin():
        s.get(Ad, ad1).client_id = f"ad-{ad2}"
    with pytest.raises(ExportError, match=rf"^ads {ad1} and {ad2} would both be delivered to ads1/ad-{ad2}/; "):
        export_batch(db, "ads1", str(tmp_path / "d"))


def waiting_for_post(db) -> int:
    """A job of b1 rendered and waiting for post-processing; returns its id."""
    with db.session() as s, s.begin():
        job = Job(batch_id="b1", line=2, prompt_raw="p", prompt="p", seed=1, tier="fast", frames=8, fps=8, width=64,
                  height=64, state="post", attempts_made=1)
        s.add(job)
        s.flush()
        s.add(Attempt(job_id=job.id, number=1, state="rendered", tier="fast", steps=6, seed=1, model="tiny",
                      sampler="lcm", guidance=1.0, raw_key=f"b1/{job.id}/a1.frames.npy"))
    return job.id


def test_reconcile_with_the_broker_down_and_a_clip_waiting_for_post_is_one_line(seeded, sqlite_url, tmp_path):
    """Only the render messages were turned into the broker's one-line error: a clip waiting for
    post-processing made `reconcile` (and the nightly supervisor, which then wrote no report) end
    in kombu's traceback."""
    import os
    import subprocess
    import sys

    from services import free_port

    db, _, _ = seeded
    waiting_for_post(db)
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url, CLIPMILL_BROKER_URL=url)
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "reconcile"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith(f"Error: broker {url} unreachable: ") and "Traceback" not in proc.stderr


def test_reconcile_sends_a_post_message_again_only_once_it_is_stale_and_no_live_worker_holds_the_post(
        seeded, sqlite_url, broker, tmp_path):
    """Before, every `reconcile` (beat sends one a minute) sent a post message for every clip
    waiting for post-processing: a post queue with a backlog filled with repeats of itself."""
    import os
    import subprocess
    import sys
    from datetime import datetime, timedelta, timezone

    import redis

    db, _, _ = seeded
    job_id = waiting_for_post(db)
    env = dict(os.environ, CLIPMILL_DATABASE_URL=sqlite_url, CLIPMILL_BROKER_URL=broker)
    r = redis.Redis.from_url(broker)

    def reconcile(*args) -> str:
        proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "reconcile", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    def queued_posts() -> int:
        return sum(r.llen(k) for k in r.scan_iter("post*") if r.type(k) == b"list")

    assert "post messages sent 1" in reconcile()  # never sent: sent now
    assert "post messages sent 0" in reconcile()  # sent a moment ago: not again
    assert queued_posts() == 1
    assert "post messages sent 1" in reconcile("--stale", "0")  # older than --stale: sent again
    with db.session() as s, s.begin():  # another worker is post-processing it now
        s.get(Job, job_id).lease_owner = "elsewhere:4242.1"
        s.get(Job, job_id).lease_expires_at = datetime.now(timezone.utc) + timedelta(minutes=10)
    assert "post messages sent 0" in reconcile("--stale", "0")
    assert queued_posts() == 2
