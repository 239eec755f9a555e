"""The review page at scale, behind ``clipmill bench --review`` and its tests.

- :func:`synthetic_batch`: a batch of N jobs written straight into a job table as the post
  stage leaves them: most passed, some rejected (each with reasons of a QC kind), some passed
  on a retry (two attempts), every one with QC metrics drawn from a seeded generator and its
  risk margin; with ``media``, every attempt gets a real H.264 clip, poster and contact sheet
  (one set encoded, then hard-linked under each attempt's keys).
- :func:`server_times`: the server's time to make a page (the query and the template) for the
  views an operator opens, median of ``repeat``.
- :func:`browser_load`: a page of a batch in headless Chromium: time to first paint and to
  interactive, bytes of the page, media requests made on load, and ``j`` across a page boundary.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import sqlalchemy as sa
from sqlalchemy import insert

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Batch, Job
from clipmill.jobs.review.decisions import View, page_of
from clipmill.jobs.review.web import TEMPLATES
from clipmill.pipeline.video import encode_h264, poster_jpeg
from clipmill.qc.margin import risk

REASONS = {
    "boiling": "boiling: frames 0-23 (fine texture re-rolls over 1.5% of the frame or more: band-pass residual 2.4 > 1.5 above the clip's noise floor)",
    "flicker": "flicker: frames 3-11 (mean luma swings up to 6.2 > 2.5, alternating)",
    "black": "black: frames 0-4 (mean luma 3.1 < 12.0)",
    "frozen": "frozen: frames 8-17 (10 frames, 0.33 s, in a clip moving 1.20 px/frame)",
    "blur": "blur: frames 18-23 (sharpness 0.21 is 41% < 60% of frames 0-5's 0.51)",
}
WORDS = ("ramen", "dumplings", "latte art", "hot pot", "bao", "noodles", "sushi", "tacos", "pizza", "salad")
CAMERAS = ("dolly in", "orbit", "close-up", "pan left", "static shot")


def _metrics(rng: np.random.Generator, bad: str | None) -> dict:
    m = {"frames": 30, "fps": 30.0, "luma_mean": round(float(rng.uniform(60, 160)), 3),
         "luma_min": round(float(rng.uniform(25, 120)), 3), "spread_min": round(float(rng.uniform(8, 40)), 3),
         "ssim_mean": round(float(rng.uniform(0.7, 0.99)), 4), "ssim_min": round(float(rng.uniform(0.55, 0.95)), 4),
         "residual_median": round(float(rng.uniform(0.5, 2.5)), 3), "residual_max": round(float(rng.uniform(2, 13)), 3),
         "diff_mean": round(float(rng.uniform(0.5, 6)), 3), "flow_median": round(float(rng.uniform(0.1, 3)), 3),
         "texture_residual": round(float(rng.uniform(0.2, 0.6)), 3), "boiling": round(float(rng.uniform(0, 2.5)), 3),
         "clipped_max": round(float(rng.uniform(0, 0.02)), 4), "sharpness_ratio": round(float(rng.uniform(0.65, 1.2)), 3)}
    if bad == "boiling":
        m["boiling"] = round(float(rng.uniform(2.7, 6)), 3)
    elif bad == "black":
        m["luma_min"] = round(float(rng.uniform(1, 11)), 3)
    elif bad == "blur":
        m["sharpness_ratio"] = round(float(rng.uniform(0.3, 0.59)), 3)
    return m


def _media(folder: Path) -> dict[str, Path]:
    """One real clip (H.264), poster and contact sheet to link under every attempt's keys."""
    import cv2

    folder.mkdir(parents=True, exist_ok=True)
    t = np.arange(30)[:, None, None]
    x = np.arange(64)[None, None, :]
    frames = np.zeros((30, 64, 64, 3), np.uint8)
    frames[..., 0] = ((x + 2 * t) % 64 * 4).astype(np.uint8)
    frames[..., 2] = 120
    files = {"clip": folder / "clip.mp4", "poster": folder / "poster.jpg", "sheet": folder / "sheet.png"}
    encode_h264(frames, 30, files["clip"])
    files["poster"].write_bytes(poster_jpeg(frames))
    cv2.imwrite(str(files["sheet"]), np.concatenate(list(frames[::6]), axis=1))
    return files


def synthetic_batch(db: Database, batch_id: str, n: int, out: str | Path, seed: int = 0, media: bool = True,
                    rejected: float = 0.15, retried: float = 0.1, chunk: int = 2000) -> dict:
    """Write a batch of ``n`` checked jobs into ``db`` (storage root ``out``); returns counts."""
    rng = np.random.default_rng(seed)
    out = Path(out)
    files = _media(out / ".bench-media") if media else None
    kinds = list(REASONS)
    t0 = datetime.now(timezone.utc) - timedelta(hours=8)
    with db.session() as s, s.begin():
        s.add(Batch(id=batch_id, source=f"synthetic ({n} jobs, seed {seed})", model="shapes", sampler="lcm",
                    guidance=1.0, out=str(out), max_attempts=2))
    counts = {"passed": 0, "rejected": 0, "retried": 0}
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        jobs, plans = [], []
        for i in range(start, start + size):
            bad = kinds[int(rng.integers(len(kinds)))] if rng.random() < rejected else None
            again = bad is None and rng.random() < retried  # passed on its second attempt
            metrics = _metrics(rng, bad)
            margin, near = risk(metrics)
            prompt = f"{WORDS[i % len(WORDS)]} at store {i}, {CAMERAS[i % len(CAMERAS)]}"
            jobs.append({"batch_id": batch_id, "line": i + 2, "client_id": f"r{i}", "prompt_raw": prompt,
                         "prompt": prompt, "negative_prompt": "", "elements": {}, "seed": 1000 + i,
                         "tier": "quality" if again or bad else "fast", "frames": 8, "fps": 30, "width": 64,
                         "height": 64, "priority": 0, "state": "rejected" if bad else "passed", "version": 4,
                         "attempts_made": 2 if again else 1, "attempts_lost": 0, "qc_margin": margin, "qc_near": near,
                         "qc_kinds": f",{bad}," if bad else None,
                         "created_at": t0, "updated_at": t0 + timedelta(seconds=i)})
            plans.append((bad, again, metrics))
            counts["rejected" if bad else "passed"] += 1
            counts["retried"] += again
        with db.session() as s, s.begin():
            ids = s.scalars(insert(Job).returning(Job.id, sort_by_parameter_order=True), jobs).all()
            attempts = []
            for jid, (bad, again, metrics) in zip(ids, plans):
                numbers = [1, 2] if again else [1]
                for k in numbers:
                    final = k == numbers[-1]
                    verdict = "reject" if (bad or not final) else "pass"
                    reasons = [REASONS[bad]] if bad else ([] if final else [REASONS["boiling"]])
                    keys = {"clip_key": f"{batch_id}/{jid}/a{k}.mp4", "poster_key": f"{batch_id}/{jid}/a{k}.jpg",
                            "sidecar_key": f"{batch_id}/{jid}/a{k}.json"}
                    attempts.append({"job_id": jid, "number": k, "state": "passed" if verdict == "pass" else "rejected",
                                     "tier": "fast" if k == 1 else "quality", "steps": 6 if k == 1 else 8,
                                     "seed": 1000 + jid * 7 + k, "model": "shapes", "sampler": "lcm", "guidance": 1.0,
                                     "timings": {}, "qc_metrics": metrics, "verdict": verdict, "reasons": reasons,
                                     **keys, "started_at": t0, "finished_at": t0})
                    if files is not None:
                        for kind, suffix in (("clip", ".mp4"), ("poster", ".jpg"), ("sheet", ".sheet.png")):
                            dest = out / batch_id / str(jid) / f"a{k}{suffix}"
                            dest.parent.mkdir(parents=True, exist_ok=True)
                            if not dest.exists():
                                os.link(files[kind], dest)
            s.execute(insert(Attempt), attempts)
    return counts


def server_times(db: Database, batch_id: str, repeat: int = 5) -> dict[str, float]:
    """Milliseconds to make each view's page (query, attempts and decisions of the page, the
    counts of every filter), median of ``repeat``."""
    views = {"first page (risk order)": View(), "page 50": View(page=50), "newest first": View(sort="time"),
             "rejected, boiling": View(filter="rejected", reason="boiling"), "text search": View(filter="all", q="store 77")}
    out = {}
    for name, v in views.items():
        runs = []
        for _ in range(repeat):
            t = time.perf_counter()
            p = page_of(db, batch_id, v)
            TEMPLATES.get_template("batch.html").render(
                batch=batch_id, p=p, clips=p.clips, state=v.filter, filters=(), notice=None, sorts=(), reasons=(),
                operators=[], loaded_at="", query="", query_for=lambda **kw: "", csrf="x")
            runs.append((time.perf_counter() - t) * 1000)
        out[name] = round(statistics.median(runs), 1)
    return out


def browser_load(url: str, chromium: str, page_boundary: bool = True) -> dict:
    """Open ``url`` (a batch's review page) in headless Chromium: first paint and interactive
    (ms from the navigation's start), the page's bytes, media requests made in the first 3 s,
    and whether ``j`` from the last card opens the next page with its first card selected."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_context(viewport={"width": 1400, "height": 900}, bypass_csp=True).new_page()
        media: list[str] = []
        page.on("request", lambda r: media.append(r.url) if "/media/" in r.url else None)
        resp = page.goto(url)
        page.wait_for_function("document.body.dataset.ready === '1'")
        timing = page.evaluate("""() => {
            const nav = performance.getEntriesByType('navigation')[0];
            const paint = performance.getEntriesByName('first-contentful-paint')[0] || performance.getEntriesByName('first-paint')[0];
            return {paint: paint ? paint.startTime : null, interactive: nav.domInteractive, loaded: nav.loadEventEnd,
                    bytes: nav.transferSize || nav.encodedBodySize};
        }""")
        page.wait_for_timeout(3000)
        out = {"first_paint_ms": round(timing["paint"] or 0), "interactive_ms": round(timing["interactive"]),
               "load_ms": round(timing["loaded"]), "page_bytes": len(resp.body()), "media_requests": len(set(media)),
               "cards": page.locator(".card").count()}
        if page_boundary:
            n = out["cards"]
            for _ in range(n):
                page.keyboard.press("j")
            page.wait_for_url("**page=2**")
            page.wait_for_function("document.body.dataset.ready === '1'")
            out["j_to_page_2"] = page.evaluate("document.querySelector('.card.selected') === document.querySelector('.card')")
        browser.close()
    return out


def review_bench(jobs: int = 5000, table_jobs: int = 100_000, pg_url: str | None = None,
                 chromium: str | None = None) -> dict:
    """``clipmill bench --review``: a synthetic ``jobs``-job batch opened in headless Chromium
    (through a real ``clipmill review`` server on SQLite), and the server's time per page with
    ``table_jobs`` jobs in the table, on SQLite and (given ``pg_url``) PostgreSQL, in a schema of
    its own that is dropped afterwards."""
    def fill(db: Database, root: Path, media: bool) -> None:
        synthetic_batch(db, "big", jobs, root, seed=11, media=media)
        rest, k = table_jobs - jobs, 0
        while rest > 0:  # other nights' batches: the table the queries have to find the batch in
            n = min(10_000, rest)
            synthetic_batch(db, f"other-{k}", n, root, seed=100 + k, media=False)
            rest, k = rest - n, k + 1

    out: dict = {"jobs": jobs, "table_jobs": table_jobs}
    with tempfile.TemporaryDirectory(prefix="clipmill-bench-review-") as tmp:
        url = f"sqlite:///{tmp}/review.db"
        db = Database(url)
        t = time.perf_counter()
        fill(db, Path(tmp) / "out", media=True)
        out["fill_s"] = round(time.perf_counter() - t, 1)
        out["sqlite_ms"] = server_times(db, "big")
        chromium = chromium or shutil.which("chromium") or shutil.which("chromium-browser")
        if chromium:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            env = dict(os.environ, CLIPMILL_DATABASE_URL=url)
            server = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "review", "big", "--port", str(port)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                _wait_http(f"http://127.0.0.1:{port}/", server)
                out["browser"] = browser_load(f"http://127.0.0.1:{port}/batch/big", chromium)
            finally:
                server.terminate()
                server.wait(10)
        else:
            out["browser"] = {"skipped": "no chromium on PATH"}
        db.dispose()
    if pg_url:
        schema = f"bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(pg_url)
        with admin.begin() as c:
            c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        try:
            sep = "&" if "?" in pg_url else "?"
            db = Database(f"{pg_url}{sep}options=-csearch_path%3D{schema}")
            with tempfile.TemporaryDirectory(prefix="clipmill-bench-review-") as tmp:
                fill(db, Path(tmp), media=False)
            out["postgresql_ms"] = server_times(db, "big")
            db.dispose()
        finally:
            with admin.begin() as c:
                c.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            admin.dispose()
    return out


def _wait_http(url: str, proc, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the review server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the review server did not answer at {url} within {timeout:g} s")
