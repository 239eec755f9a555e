"""S3 storage and export against a real S3 API (moto in server mode) on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Job
from services import free_port, need_program, stop, wait_port
from clipmill.storage import open_storage
from clipmill.storage.s3 import MULTIPART_BYTES, S3Storage

CREDS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    exe = need_program(os.path.join(os.path.dirname(sys.executable), "moto_server"), "moto_server (moto[server])")
    port = free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_port(port, proc)
    endpoint = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in [*CREDS, "CLIPMILL_S3_ENDPOINT"]}
    os.environ.update(CREDS, CLIPMILL_S3_ENDPOINT=endpoint)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ads")
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    stop(proc)


def test_put_get_stat_delete_and_verified_multipart(s3, tmp_path):
    st = open_storage("s3://ads/clips")
    assert isinstance(st, S3Storage)
    assert st.put_bytes("b/1/a1.json", b'{"x": 1}') == "s3://ads/clips/b/1/a1.json"
    assert st.get_bytes("b/1/a1.json") == b'{"x": 1}'
    assert st.stat("b/1/a1.json")[0] == 8 and st.exists("b/1/a1.json")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(MULTIPART_BYTES + 1_000_000))  # above the multipart threshold
    assert st.put_file("b/1/big.bin", big) == "s3://ads/clips/b/1/big.bin"
    head = st.client.head_object(Bucket="ads", Key="clips/b/1/big.bin")
    assert head["ContentLength"] == big.stat().st_size and "-" in head["ETag"]  # a multipart ETag
    assert st.get_bytes("b/1/big.bin") == big.read_bytes()
    st.delete("b/1/a1.json")
    assert st.stat("b/1/a1.json") is None


def test_run_to_s3_review_from_s3_and_export_to_s3(s3, tmp_path):
    from clipmill.jobs.review.export import export_batch
    from clipmill.jobs.review.decisions import decide

    env = dict(os.environ, CLIPMILL_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}")
    (tmp_path / "a.csv").write_text('id,prompt\nx1,"ramen, orbit"\nx2,"sushi, pan left"\n')
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "run", "a.csv", "--batch", "s3b", "--out", "s3://ads/clips",
                           "--size", "64", "--frames", "8", "--max-attempts", "1"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    db = Database(env["CLIPMILL_DATABASE_URL"])
    with db.session() as s:
        attempts = s.scalars(select(Attempt).order_by(Attempt.job_id)).all()
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
    st = open_storage("s3://ads/clips")
    for a in attempts:
        assert a.location == f"s3://ads/clips/s3b/{a.job_id}/a1.mp4"
        for suffix in (".mp4", ".jpg", ".json", ".sheet.png"):
            assert st.exists(f"s3b/{a.job_id}/a1{suffix}")
        assert not st.exists(f"s3b/{a.job_id}/a1.frames.npy")
        side = json.loads(st.get_bytes(f"s3b/{a.job_id}/a1.json"))
        assert side["qc"]["verdict"] == a.verdict

    # the review server streams clips stored in S3
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "review", "s3b", "--port", str(port)], cwd=tmp_path,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_port(port, srv)
        url, whole = f"http://127.0.0.1:{port}/media/{jobs[0].id}/1/clip", st.get_bytes(f"s3b/{jobs[0].id}/a1.mp4")
        with urllib.request.urlopen(url) as r:
            assert r.headers["content-type"] == "video/mp4" and r.headers["accept-ranges"] == "bytes"
            assert r.read() == whole
        # a browser seeking (Safari asks for ranges only): 206 with just those bytes
        for asked, (first, last) in (("bytes=0-1", (0, 1)), ("bytes=100-", (100, len(whole) - 1)),
                                     ("bytes=-10", (len(whole) - 10, len(whole) - 1))):
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": asked})) as r:
                assert r.status == 206 and r.headers["content-range"] == f"bytes {first}-{last}/{len(whole)}"
                assert r.read() == whole[first:last + 1]
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={len(whole)}-"}))
        assert e.value.code == 416 and e.value.headers["content-range"] == f"bytes */{len(whole)}"
    finally:
        stop(srv)

    for j in jobs:  # QC rejected the noise; the operator overrides
        decide(db, j.id, j.version, "approve", "", "dana")
    res = export_batch(db, "s3b", "s3://ads/delivery")
    assert sorted(res.copied) == [f"s3b/{jobs[0].id}-x1.mp4", f"s3b/{jobs[1].id}-x2.mp4"] and res.skipped == []
    dest = open_storage("s3://ads/delivery")
    manifest = json.loads(dest.get_bytes("s3b/manifest.json"))
    assert [c["approver"] for c in manifest["clips"]] == ["dana", "dana"]
    assert dest.get_bytes("s3b/manifest.csv").decode().splitlines()[0].startswith("job_id,client_id,file,bytes,sha256")

    # rerun: nothing copied twice; an interrupted export (one object missing) resumes with just that one
    assert export_batch(db, "s3b", "s3://ads/delivery").copied == []
    dest.delete(f"s3b/{jobs[1].id}-x2.mp4")
    res = export_batch(db, "s3b", "s3://ads/delivery")
    assert res.copied == [f"s3b/{jobs[1].id}-x2.mp4"] and res.skipped == [f"s3b/{jobs[0].id}-x1.mp4"]
    db.dispose()


@pytest.mark.slow
def test_export_to_folder_resumes_after_a_partial_copy(tmp_path):
    """A local destination with one clip missing and one truncated gets exactly those two."""
    from clipmill.jobs.core.batches import SubmitOptions, submit
    from clipmill.jobs.runner.embedded import run_batch
    from clipmill.jobs.review.export import export_batch
    from clipmill.jobs.core.prompts import Defaults
    from clipmill.jobs.review.decisions import decide
    from clipmill.jobs.runner.stages import WorkerContext

    db = Database(f"sqlite:///{tmp_path / 'e.db'}")
    (tmp_path / "e.csv").write_text('prompt\n"a, orbit"\n"b, orbit"\n"c, orbit"\n')
    submit(db, tmp_path / "e.csv", SubmitOptions(batch="e", out=str(tmp_path / "out"), max_attempts=1,
                                                  defaults=Defaults(frames=8, size=(64, 64))))
    run_batch(WorkerContext(db), "e")
    with db.session() as s:
        jobs = s.scalars(select(Job).order_by(Job.id)).all()
    for j in jobs:
        decide(db, j.id, j.version, "approve", "", "eve")
    first = export_batch(db, "e", str(tmp_path / "out-delivery"))
    assert len(first.copied) == 3
    folder = tmp_path / "out-delivery" / "e"
    (folder / f"{jobs[0].id}.mp4").unlink()
    (folder / f"{jobs[1].id}.mp4").write_bytes(b"half a file")
    again = export_batch(db, "e", str(tmp_path / "out-delivery"))
    assert sorted(again.copied) == sorted([f"e/{jobs[0].id}.mp4", f"e/{jobs[1].id}.mp4"])
    assert again.skipped == [f"e/{jobs[2].id}.mp4"]
    db.dispose()
