"""Operator review in a real headless Chromium against a real `clipmill review` server, on a
batch made by `clipmill run`; then `clipmill export` delivers what was approved."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Decision, Job
from services import free_port, need_program, stop, wait_port

# QC thresholds that let the tiny model's noise through, so the batch has survivors to review
LENIENT_QC = """[qc]
black_luma = 0
uniform_spread = 0
spike_factor = 1e9
spike_min = 1e9
min_pair_ssim = -2
block_jump = 1e9
block_concentration = 1e9
flicker_luma = 1e9
moving_flow = 1e9
exposure_luma = 1e9
exposure_saturation = 1e9
boiling_ssim = -2
boiling_excess = 1e9
blur_ratio = 0
min_median_ssim = -2
"""


def cli(*args, env, cwd, check=True):
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tiny_cache):
    """Three clips rendered by `clipmill run`: two pass the lenient QC, one is forced to fail."""
    tmp = tmp_path_factory.mktemp("review")
    env = dict(os.environ, CLIPMILL_DATABASE_URL=f"sqlite:///{tmp / 'clipmill.db'}")
    (tmp / "qc.toml").write_text(LENIENT_QC)
    (tmp / "ads.csv").write_text('id,prompt\nr1,"a bowl of ramen, dolly in"\nr2,"dumplings, orbit"\nr3,"latte art, close-up"\n')
    cli("run", "ads.csv", "--batch", "ads", "--out", str(tmp / "out"), "--size", "64", "--frames", "8",
        "--max-attempts", "1", "--qc-config", "qc.toml", env=env, cwd=tmp)
    db = Database(env["CLIPMILL_DATABASE_URL"])
    with db.session() as s, s.begin():  # r3 plays the false reject an operator may rescue
        s.execute(Job.__table__.update().where(Job.client_id == "r3").values(state="rejected"))
    yield tmp, env, db
    db.dispose()


@pytest.fixture
def server(batch):
    tmp, env, _ = batch
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "review", "ads", "--port", str(port)], env=env,
                            cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_port(port, proc)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def job_state(db, client_id):
    with db.session() as s:
        return s.scalars(select(Job).where(Job.client_id == client_id)).one()


def test_browser_review_then_export(batch, server):
    from playwright.sync_api import sync_playwright

    tmp, env, db = batch
    chromium = need_program("chromium", "Debian's Chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--autoplay-policy=no-user-gesture-required"])
        page = browser.new_context(bypass_csp=True).new_page()  # the test evaluates its own probes
        page.goto(server + "/")
        assert page.url.endswith("/batch/ads")
        cards = page.locator(".card")
        assert cards.count() == 2  # the survivors; the reject is not shown by default
        page.fill("#operator", "alice")
        page.dispatch_event("#operator", "change")

        # play the first clip: the browser decodes our H.264 and time advances
        page.evaluate("document.querySelector('video').play()")
        page.wait_for_function("document.querySelector('video').currentTime > 0.05", timeout=15000)

        # approve r1 with its button
        first = page.locator("#job-1")
        first.locator("button[value=approve]").click()
        page.wait_for_function("document.querySelector('#job-1 .state').textContent === 'approved'")

        # decline r2 with the keyboard: j to move, type a note, Escape, d
        page.keyboard.press("j")
        page.fill("#job-2 input[name=note]", "logo hidden by steam")
        page.keyboard.press("Escape")
        page.keyboard.press("d")
        page.wait_for_function("document.querySelector('#job-2 .state').textContent === 'declined'")

        # rejected clips on request, with reasons and contact sheet; approving one is an override
        page.goto(server + "/batch/ads?state=rejected")
        assert page.locator(".card").count() == 1
        page.wait_for_function(  # the contact sheet has loaded (on a loaded machine it takes a moment)
            "(() => { const i = document.querySelector('#job-3 img.sheet'); "
            "return i !== null && i.complete && i.naturalWidth > 0; })()", timeout=15000)
        browser.close()

    assert job_state(db, "r1").state == "approved"
    assert job_state(db, "r2").state == "declined"
    assert job_state(db, "r3").state == "rejected"
    with db.session() as s:
        decisions = [(d.job_id, d.decision, d.operator, d.note, d.override) for d in s.scalars(select(Decision).order_by(Decision.id))]
    assert decisions == [(1, "approved", "alice", "", False), (2, "declined", "alice", "logo hidden by steam", False)]

    # export delivers the approved clip and its manifest row; a second run copies nothing
    dest = tmp / "delivery"
    res = cli("export", "ads", "--to", str(dest), env=env, cwd=tmp)
    assert "1 approved clip(s): 1 copied, 0 already there" in res.stdout
    assert sorted(p.name for p in (dest / "ads").iterdir()) == ["1-r1.mp4", "manifest.csv", "manifest.json"]
    rows = list(csv.DictReader((dest / "ads" / "manifest.csv").open()))
    assert [(r["job_id"], r["client_id"], r["approver"], r["tier"], r["model"]) for r in rows] == [
        ("1", "r1", "alice", "fast", "tiny")]
    assert json.loads(rows[0]["qc_metrics"])["frames"] == 10
    manifest = json.loads((dest / "ads" / "manifest.json").read_text())
    assert manifest["clips"][0]["prompt"] == "a bowl of ramen, dolly in" and manifest["clips"][0]["seed"] == job_state(db, "r1").seed
    res = cli("export", "ads", "--to", str(dest), env=env, cwd=tmp)
    assert "1 approved clip(s): 0 copied, 1 already there" in res.stdout


def post(url, data: dict, headers=None):
    body = "&".join(f"{k}={urllib.request.quote(str(v))}" for k, v in data.items()).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def csrf_cookie(url):
    with urllib.request.urlopen(url) as r:
        cookie = r.headers["set-cookie"]
    return cookie.split("clipmill_csrf=")[1].split(";")[0]


def test_two_operators_never_overwrite_each_other(batch, server):
    _, _, db = batch
    csrf = csrf_cookie(server + "/batch/ads?state=all")
    job = job_state(db, "r3")
    seen = job.version
    h = {"Cookie": f"clipmill_csrf={csrf}"}
    status, body = post(f"{server}/decide/{job.id}", {"version": seen, "decision": "approve", "csrf": csrf, "operator": "bob"}, h)
    assert status == 200 and body["state"] == "approved"
    status, body = post(f"{server}/decide/{job.id}", {"version": seen, "decision": "decline", "csrf": csrf, "operator": "carol"}, h)
    assert status == 409
    assert body["error"].startswith(f"job {job.id} changed since you loaded it: it is now approved by bob at ")
    assert job_state(db, "r3").state == "approved"
    with db.session() as s:
        d = s.scalars(select(Decision).where(Decision.job_id == job.id)).all()
    assert [(x.decision, x.operator, x.override, x.from_state) for x in d] == [("approved", "bob", True, "rejected")]


def test_csrf_and_cross_site_posts_are_refused(batch, server):
    _, _, db = batch
    job = job_state(db, "r2")
    csrf = csrf_cookie(server + "/")
    status, _ = post(f"{server}/decide/{job.id}", {"version": job.version, "decision": "approve", "csrf": "forged"},
                     {"Cookie": f"clipmill_csrf={csrf}"})
    assert status == 403
    status, body = post(f"{server}/decide/{job.id}", {"version": job.version, "decision": "approve", "csrf": csrf},
                        {"Cookie": f"clipmill_csrf={csrf}", "Origin": "http://evil.example"})
    assert status == 403 and "cross-site request from http://evil.example refused" in body["detail"]
    assert job_state(db, "r2").version == job.version


@pytest.mark.parametrize("path", [
    "/media/1/1/../../../../../../etc/passwd",
    "/media/1/1/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/media/1/1/..%2F..%2F..%2Fetc%2Fpasswd",
    "/media/1/9/clip",
    "/media/1/1/sidecar",
    "/static/../../etc/passwd",
])
def test_path_traversal_gets_404_and_reads_nothing(server, path):
    req = urllib.request.Request(server + path)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 404
    assert b"root:" not in e.value.read()


def test_token_required_when_set(batch):
    tmp, env, _ = batch
    port = free_port()
    token = "s3cret-token-for-tests"
    proc = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "review", "ads", "--port", str(port), "--token", token],
                            env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_port(port, proc)
        base = f"http://127.0.0.1:{port}"
        for path in ("/", "/batch/ads", "/media/1/1/clip", "/?token=%C3%A9t%C3%A9"):  # a non-ASCII guess: 401, not 500
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + path)
            assert e.value.code == 401
        ok = urllib.request.urlopen(urllib.request.Request(base + "/batch/ads", headers={"Authorization": f"Bearer {token}"}))
        assert ok.status == 200
    finally:
        stop(proc)


def test_binding_beyond_loopback_needs_a_token(batch):
    tmp, env, _ = batch
    env = {k: v for k, v in env.items() if k != "CLIPMILL_REVIEW_TOKEN"}
    res = cli("review", "ads", "--host", "0.0.0.0", env=env, cwd=tmp, check=False)
    assert res.returncode == 2  # bad input
    assert "Error: --host 0.0.0.0: binding beyond this machine needs --token (or CLIPMILL_REVIEW_TOKEN)" in res.stderr
