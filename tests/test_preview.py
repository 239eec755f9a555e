"""The streaming preview (issue 13) in a real headless Chromium against a real `clipmill
preview` server on the built-in shapes model: frames arrive over Server-Sent Events, a changed
prompt changes what the analyzer reads within 2 s (16 frames at 8 a second), "Queue this"
makes a batch with the prompt, its seed and tier, and closing the page frees the model."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import cv2
import numpy as np
import pytest
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Job, PreviewSession
from clipmill.qc.adherence import analyze
from services import free_port, need_program, stop, wait_port

RED = "a red circle moves right on a beige background, pan right"
BLUE = "a blue square moves up on a black background, static shot"
pytestmark = pytest.mark.slow


def _frames(uris: list[str]) -> np.ndarray:
    out = []
    for u in uris:
        img = cv2.imdecode(np.frombuffer(base64.b64decode(u.split(",", 1)[1]), np.uint8), cv2.IMREAD_COLOR)
        out.append(cv2.resize(cv2.cvtColor(img, cv2.COLOR_BGR2RGB), (64, 64), interpolation=cv2.INTER_AREA))
    return np.stack(out)


def _active(url: str) -> int:
    with urllib.request.urlopen(url + "/api/preview") as r:
        return json.loads(r.read())["active"]


def test_preview_streams_follows_a_new_prompt_queues_it_and_frees_the_model(tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = need_program("chromium", "Debian's Chromium")
    port = free_port()
    server, db_url = _server(tmp_path, port)
    try:
        wait_port(port, server, timeout=60)
        url = f"http://127.0.0.1:{port}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_context(bypass_csp=True).new_page()  # the test evaluates its own probes
            page.goto(url + "/preview?prompt=" + urllib.request.quote(RED))
            # every frame that arrives, with its arrival time
            page.evaluate("""() => { window.got = []; new MutationObserver(() => window.got.push(
                [performance.now(), document.getElementById('frame').src])).observe(
                document.getElementById('frame'), {attributes: true, attributeFilter: ['src']}); }""")
            page.wait_for_function("window.got.length >= 12", timeout=60000)
            first = page.evaluate("window.got.slice(-8).map(g => g[1])")
            red = analyze(_frames(first))
            assert (red.colour, red.shape) == ("red", "circle"), red.label()
            assert _active(url) == 1

            # steer: type the new prompt; within 2 s the frames show it. That is 16 frames at the
            # budget's 8 a second: a machine that streams slower (measured here, over the last 8
            # frames) gets the time of 16 of its own frames (a CI run on a machine 2x slower than
            # usual read the new shape but the old colour at 2 s; the test alone there passed)
            arrived = page.evaluate("window.got.slice(-9).map(g => g[0])")
            budget_ms = 16 * max(125.0, (arrived[-1] - arrived[0]) / 8)
            t0 = page.evaluate("performance.now()")
            page.fill("#prompt", BLUE)
            page.wait_for_timeout(budget_ms)
            got = page.evaluate("window.got")
            within = [src for t, src in got if t0 < t <= t0 + budget_ms]
            assert len(within) >= 6, len(within)  # frames kept coming (8 a second is the budget)
            blue = analyze(_frames(within[-4:]))
            assert blue.colour == "blue", blue.label()

            # a seed out of range is a 400 naming it, and the stream that is on keeps streaming
            try:
                urllib.request.urlopen(url + "/preview/stream?prompt=x&seed=100000000000")
                raise AssertionError("a seed of 1e11 was accepted")
            except urllib.error.HTTPError as e:
                assert e.code == 400 and b"seed 100000000000: allowed an integer from 0 to 4294967295" in e.read()
            assert _active(url) == 1

            # queue this: a batch with the prompt, its seed and the chosen tier; a second click
            # answers the same batch (it made one batch a click)
            page.select_option("#tier", "quality")
            page.click("#queue")
            page.wait_for_function("document.getElementById('message').textContent.startsWith('queued as batch')")
            queued = page.text_content("#message")
            page.evaluate("document.getElementById('message').textContent = ''")
            page.click("#queue")
            page.wait_for_function("document.getElementById('message').textContent.startsWith('queued as batch')")
            assert page.text_content("#message") == queued

            # a second page takes the stream; the first is told why and does not take it back
            # (its browser reconnected by itself, and the two pages swapped the stream forever)
            other = browser.new_context(bypass_csp=True).new_page()
            other.goto(url + "/preview?prompt=" + urllib.request.quote(RED))
            page.wait_for_function("document.getElementById('message').textContent.includes('replaced by a newer page')",
                                   timeout=60000)
            other.wait_for_function("document.getElementById('info').textContent.startsWith('frame')", timeout=60000)
            ids = set()
            for _ in range(20):  # 3 s: one session, never replaced again
                with urllib.request.urlopen(url + "/api/preview") as r:
                    ids |= {x["session"] for x in json.loads(r.read())["sessions"]}
                time.sleep(0.15)
            assert len(ids) == 1, ids
            other.close()
            page.close()
            # the stream notices the closed page when its render thread next hands over a frame:
            # after the window in flight (about a second here, 1.5 s was once too short on a
            # machine 2x slower than usual)
            deadline = time.time() + 5.0
            while _active(url) and time.time() < deadline:
                time.sleep(0.05)
            assert _active(url) == 0  # closing the page stopped the stream and freed the model
            browser.close()
    finally:
        stop(server)
    db = Database(db_url)
    with db.session() as s:
        jobs = s.scalars(select(Job)).all()
    assert [(j.prompt, j.seed, j.tier, j.batch_id.startswith("preview-")) for j in jobs] == [(BLUE, 0, "quality", True)]
    db.dispose()


def _server(tmp_path, port: int, **env_extra) -> tuple[subprocess.Popen, str]:
    """A real `clipmill preview` server (embedded) on ``port``, and its database URL."""
    db_url = f"sqlite:///{tmp_path / 'c.db'}"
    env = dict(os.environ, CLIPMILL_DATABASE_URL=db_url, OMP_NUM_THREADS="1", CLIPMILL_OUT=str(tmp_path / "out"),
               **env_extra)
    server = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "preview", RED, "--model", "shapes",
                               "--port", str(port)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    return server, db_url


def test_an_embedded_preview_ends_at_the_preview_time_limit_and_the_page_is_told(tmp_path):
    """CLIPMILL_PREVIEW_MAX applies to the review server's own previews too: a page left open
    does not stream all night; it is told why the stream ended, and the session's row ends."""
    from playwright.sync_api import sync_playwright

    chromium = need_program("chromium", "Debian's Chromium")
    port = free_port()
    server, db_url = _server(tmp_path, port, CLIPMILL_PREVIEW_MAX="4")
    try:
        wait_port(port, server, timeout=60)
        url = f"http://127.0.0.1:{port}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_context(bypass_csp=True).new_page()  # the test evaluates its own probes
            page.goto(url + "/preview?prompt=" + urllib.request.quote(RED))
            page.wait_for_function("window.clipmillPreview.frames() >= 1", timeout=60000)
            assert _active(url) == 1
            page.wait_for_function("document.getElementById('message').textContent.includes('CLIPMILL_PREVIEW_MAX')",
                                   timeout=60000)
            told = page.text_content("#message")
            assert told == ("this preview ended: its time on this review server is up (4 s, CLIPMILL_PREVIEW_MAX); "
                            "press Stream to start again"), told
            frames = page.evaluate("window.clipmillPreview.frames()")
            page.wait_for_timeout(1000)
            assert page.evaluate("window.clipmillPreview.frames()") == frames  # no frame after the end
            assert _active(url) == 0  # the stream is off the model
            browser.close()
    finally:
        stop(server)
    db = Database(db_url)
    with db.session() as s:
        row = s.scalars(select(PreviewSession)).one()
    db.dispose()
    assert row.mode == "embedded" and row.ended_at is not None and row.frames >= 3
    assert row.ended == "its time on this review server is up (4 s, CLIPMILL_PREVIEW_MAX); press Stream to start again"
    took = (row.ended_at - row.started_at).total_seconds()
    assert 4.0 <= took < 10.0, took
    assert row.started_at < row.seen_at <= row.ended_at  # marked seen as it streamed


def _get(url: str, headers: dict) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read(200).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_another_sites_page_cannot_start_steer_or_queue_a_preview(tmp_path):
    """The preview server has no token on loopback: a page of another origin that the operator
    visits must not make their browser start a stream (EventSource, fetch, img), steer one or
    queue one. Real HTTP requests with a browser's headers to a real server: 403, no session."""
    port = free_port()
    server, db_url = _server(tmp_path, port)
    try:
        wait_port(port, server, timeout=60)
        url = f"http://127.0.0.1:{port}"
        stream = url + "/preview/stream?prompt=" + urllib.request.quote(RED)
        for headers in ({"Origin": "http://evil.example"},  # an EventSource or fetch of another origin
                        {"Origin": f"http://127.0.0.1:{port + 1}"},  # another server on this machine
                        {"Origin": "null"},  # a sandboxed frame, a file
                        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"},  # an <img>, a link
                        {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"}):
            status, body = _get(stream, headers)
            assert status == 403, (headers, status, body)
            assert "refused: only this server's own pages" in body, body
            assert _active(url) == 0
        status, body = _get(stream, {"Origin": "http://evil.example"})
        assert "cross-site request from http://evil.example refused" in body, body
        # DNS rebinding: another site's name pointed at 127.0.0.1 is its page's own origin; a
        # server without a token answers only to loopback names, on every path
        for path in ("/preview/stream?prompt=" + urllib.request.quote(RED), "/api/preview", "/"):
            status, body = _get(url + path, {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"})
            assert status == 403 and body.startswith(f"403: Host 'evil.example:{port}' refused: this review server "
                                                     "has no token"), (path, status, body)
        assert _get(url + "/api/preview", {"Host": f"localhost:{port}"})[0] == 200
        # headers that do not parse are refused too (they were a 500)
        assert _get(url + "/api/preview", {"Host": "[::1"})[0] == 403
        status, body = _get(stream, {"Origin": "http://[::1"})
        assert status == 403 and "cross-site request from http://[::1 refused" in body, (status, body)
        assert _active(url) == 0
        # this server's own page passes the check (and the seed's, which fails before any model loads)
        status, body = _get(stream + "&seed=-1", {"Origin": url, "Sec-Fetch-Site": "same-origin"})
        assert status == 400 and "seed -1: allowed an integer from 0 to 4294967295" in body, body
        # steer and queue: refused for another origin even with the page's CSRF cookie and token
        with urllib.request.urlopen(url + "/preview") as r:
            csrf = r.headers["set-cookie"].split("clipmill_csrf=")[1].split(";")[0]
        for path, form in (("/preview/x/prompt", {"prompt": BLUE}), ("/preview/x/queue", {"tier": "fast"})):
            req = urllib.request.Request(url + path, data=urllib.parse.urlencode(dict(form, csrf=csrf)).encode(),
                                         headers={"Cookie": f"clipmill_csrf={csrf}", "Origin": "http://evil.example"})
            try:
                urllib.request.urlopen(req)
                raise AssertionError(f"{path}: a cross-site POST was accepted")
            except urllib.error.HTTPError as e:
                assert e.code == 403 and "cross-site request from http://evil.example refused" in e.read().decode()
        assert _active(url) == 0
    finally:
        stop(server)
    db = Database(db_url)
    with db.session() as s:
        assert s.scalars(select(PreviewSession)).all() == []  # no session was started, none recorded
        assert s.scalars(select(Job)).all() == []
    db.dispose()
