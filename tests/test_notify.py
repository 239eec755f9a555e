"""The batch-finished callback (issue 12): a signed JSON summary POSTed once per batch, retried
with backoff, against a real HTTP server on loopback that fails its first tries."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clipmill.jobs.core.notify import SIGNATURE_HEADER, RetryPolicy, post, sign


@pytest.fixture
def receiver():
    """A loopback HTTP server answering each POST with the next status of ``statuses`` (then 200),
    keeping every request's headers and body."""
    got: list[dict] = []
    statuses: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the http.server name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append({"headers": dict(self.headers), "body": body, "path": self.path})
            code = statuses.pop(0) if statuses else 200
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", got, statuses
    server.shutdown()


def test_a_failing_receiver_is_retried_with_backoff_and_the_body_is_signed(receiver):
    url, got, statuses = receiver
    statuses += [503, 500]
    slept = []
    res = post(url, {"batch": "b", "n": 1}, "s3cret", RetryPolicy(attempts=4, backoff=0.5), sleep=slept.append)
    assert res == {"ok": True, "status": 200, "tries": 3, "error": None}
    assert slept == [0.5, 1.0]  # doubling
    assert len(got) == 3 and all(g["body"] == got[0]["body"] for g in got)
    mac = hmac.new(b"s3cret", got[0]["body"], hashlib.sha256).hexdigest()
    assert got[0]["headers"][SIGNATURE_HEADER] == f"sha256={mac}" == sign(got[0]["body"], "s3cret")


def test_a_refusing_receiver_is_not_retried_and_a_dead_one_is_given_up(receiver):
    url, got, statuses = receiver
    statuses += [400]
    res = post(url, {"x": 1}, None, RetryPolicy(attempts=4, backoff=0.01), sleep=lambda s: None)
    assert res == {"ok": False, "status": 400, "tries": 1, "error": "HTTP 400 Bad Request"}
    assert SIGNATURE_HEADER not in got[0]["headers"]  # no secret: unsigned
    dead = post("http://127.0.0.1:9/hook", {"x": 1}, None, RetryPolicy(attempts=3, backoff=0.01, timeout=1),
                sleep=lambda s: None)
    assert not dead["ok"] and dead["tries"] == 3 and dead["error"].startswith("URLError")


@pytest.mark.slow
def test_run_posts_one_signed_summary_when_the_batch_finishes(receiver, tmp_path, tiny_cache):
    url, got, statuses = receiver
    statuses += [503, 503]  # the first two tries fail
    (tmp_path / "b.csv").write_text('prompt,seed\n"a bowl of ramen, orbit",1\n"a cup of tea, dolly in",2\n')
    env = dict(os.environ, CLIPMILL_DATABASE_URL=f"sqlite:///{tmp_path / 'n.db'}", CLIPMILL_NOTIFY_SECRET="k3y",
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "clipmill.jobs.cli", "run", "b.csv", "--model", "tiny", "--batch", "nb", "--size", "64",
           "--frames", "8", "--max-attempts", "1", "--out", str(tmp_path / "out"), "--notify", url]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "notified: HTTP 200 after 3 try(ies)" in proc.stderr
    assert len(got) == 3
    body = got[-1]["body"]
    assert got[-1]["headers"][SIGNATURE_HEADER] == "sha256=" + hmac.new(b"k3y", body, hashlib.sha256).hexdigest()
    summary = json.loads(body)
    assert summary["event"] == "batch.finished" and summary["batch"] == "nb"
    assert sum(summary["counts"]["jobs"].values()) == 2 and summary["ads"] == []
    # a resumed run of a finished batch does not notify again
    again = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "run", "--resume", "nb"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert len(got) == 3 and "notified" not in again.stderr


def test_a_notify_url_that_is_not_one_is_refused(tmp_path):
    env = dict(os.environ, CLIPMILL_DATABASE_URL=f"sqlite:///{tmp_path / 'n.db'}")
    (tmp_path / "b.csv").write_text("prompt\nx, orbit\n")
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "submit", "b.csv", "--notify", "ftp://x/y"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("Error: --notify 'ftp://x/y': not a URL; allowed: http://HOST/... "
                                                    "or https://HOST/...")


def test_a_callback_whose_sender_died_is_sent_again_and_one_being_sent_is_not(receiver, db, tmp_path):
    """The batch was marked notified before the first try: a post worker killed between tries
    lost the callback for good. A send is now marked ``sending`` until its tries end; one still
    so after SENDING_STALE_S (its worker died) is taken and sent again, by notify_once and by
    reconcile's list; a recent one is left to the worker sending it."""
    from datetime import timedelta

    from sqlalchemy import update

    from clipmill.jobs.core.batches import SubmitOptions, submit
    from clipmill.jobs.core.models import Batch, Job
    from clipmill.jobs.core.notify import SENDING, SENDING_STALE_S, notify_once
    from clipmill.jobs.core.queue import now
    from clipmill.jobs.farm.dispatch import unnotified

    url, got, _ = receiver
    (tmp_path / "b.csv").write_text('prompt\n"a bowl of ramen, orbit"\n')
    submit(db, tmp_path / "b.csv", SubmitOptions(batch="nb", out=str(tmp_path / "out"), notify=url))
    with db.session() as s, s.begin():
        s.execute(update(Job).values(state="failed"))  # finished
        s.execute(update(Batch).values(notified_at=now() - timedelta(seconds=30), notify_error=SENDING))
    assert unnotified(db) == [] and notify_once(db, "nb", None) is None and got == []  # being sent
    with db.session() as s, s.begin():
        s.execute(update(Batch).values(notified_at=now() - timedelta(seconds=SENDING_STALE_S + 60)))
    assert unnotified(db) == ["nb"]
    assert notify_once(db, "nb", None)["ok"] and len(got) == 1
    with db.session() as s:
        assert s.get(Batch, "nb").notify_error is None
    assert unnotified(db) == [] and notify_once(db, "nb", None) is None and len(got) == 1  # once
