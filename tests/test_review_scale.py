"""The review page at scale (issue 14), in a real headless Chromium against a real `clipmill
review` server: a synthetic 5,000-job batch opens fast with few media requests and pages with
`j`; bulk decisions over a filter are one compare-and-set per job and report a job another
operator decided in between; the nothing-passed notice stays; the same pages on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import func, select

from clipmill.jobs.bench.review import browser_load, synthetic_batch
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Decision, Job
from clipmill.jobs.review.decisions import View, decide, operator_summary, page_of
from clipmill.qc.margin import margins, reason_kinds, risk
from services import free_port, need_program, stop, wait_port

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]


def _browser(p, chromium: str):
    browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
    return browser, browser.new_context(bypass_csp=True).new_page()  # the test evaluates its own probes


def _serve(tmp_path, db_url: str, batch: str):
    port = free_port()
    env = dict(os.environ, CLIPMILL_DATABASE_URL=db_url)
    proc = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "review", batch, "--port", str(port)], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_port(port, proc)
    return proc, f"http://127.0.0.1:{port}"


def test_qc_margin_is_the_nearest_limit_and_reasons_have_kinds():
    ok = {"luma_min": 60, "spread_min": 20, "ssim_min": 0.8, "residual_median": 1.0, "residual_max": 6.0,
          "boiling": 0.75, "ssim_mean": 0.9, "sharpness_ratio": 0.9}
    m = margins(ok)
    assert m == {"black": 4.0, "uniform": 5.6667, "pair_ssim": 0.6, "residual": 0.5, "boiling": 0.5, "median_ssim": 0.5,
                 "blur": 0.5}
    assert risk(ok) == (0.5, "residual")  # the nearest limit (the first of a tie)
    at_limit = dict(ok, boiling=1.5)
    assert risk(at_limit) == (0.0, "boiling")
    assert risk(dict(ok, boiling=2.25))[0] < 0  # past the limit: negative
    assert risk({}) == (None, None)
    # the border line: the side that decides is the border_sides-th strongest (3 of 4 by default)
    assert margins(dict(ok, border_line=[20.0, 9.0, 4.5, 0.0]))["border"] == 0.25
    assert risk(dict(ok, border_line=[20.0, 9.0, 7.5, 0.0])) == (-0.25, "border")
    assert reason_kinds(["boiling: frames 0-23 (...)", "flicker: frames 1-4 (...)", "boiling: again"]) == ["boiling", "flicker"]
    assert reason_kinds(["border: frames 0-26 (...)"]) == ["border"]


@pytest.mark.slow
def test_a_5000_job_batch_opens_fast_with_few_media_requests_and_j_crosses_pages(tmp_path):
    chromium = need_program("chromium", "Debian's Chromium")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    db = Database(url)
    counts = synthetic_batch(db, "big", 5000, tmp_path / "out", seed=3)
    server, base = _serve(tmp_path, url, "big")
    try:
        res = browser_load(base + "/batch/big", chromium)
    finally:
        stop(server)
    assert res["cards"] == 48
    assert res["interactive_ms"] < 2000 and res["first_paint_ms"] < 2000, res
    assert res["media_requests"] <= 60, res  # posters and clips load near the viewport only
    assert res["page_bytes"] < 300_000, res
    assert res["j_to_page_2"], res
    page = page_of(db, "big")
    assert page.counts["passed"] == counts["passed"] and page.counts["rejected"] == counts["rejected"]
    retried = page_of(db, "big", View(retry=True))
    assert retried.total == counts["retried"] and all(c.attempts == 2 for c in retried.clips)
    assert page.total == counts["passed"] and page.pages == -(-counts["passed"] // 48)
    margins_ = [c.margin for c in page.clips]
    assert margins_ == sorted(margins_) and margins_[0] < 0.2  # the borderline survivors first
    db.dispose()


@pytest.mark.slow
def test_bulk_approve_of_a_filter_is_one_decision_per_job_and_skips_one_decided_in_between(tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = need_program("chromium", "Debian's Chromium")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    db = Database(url)
    synthetic_batch(db, "b", 1200, tmp_path / "out", seed=5, rejected=0.3)
    boiling = page_of(db, "b", View(filter="rejected", reason="boiling", per=200))
    assert boiling.total > 60  # more than a page: "all matching" is not "all on this page"
    server, base = _serve(tmp_path, url, "b")
    try:
        with sync_playwright() as p:
            browser, page = _browser(p, chromium)
            page.goto(base + "/batch/b?state=rejected&reason=boiling")
            page.wait_for_function("document.body.dataset.ready === '1'")
            assert page.locator("#filters [data-filter=rejected] .count").text_content() == str(boiling.total)
            page.fill("#operator", "alice")
            page.dispatch_event("#operator", "change")
            # another operator decides one of the matching jobs after the page was loaded
            late = boiling.clips[-1]
            decide(db, late.job_id, late.version, "decline", "not this one", "bob")
            page.check("#select-matching")
            page.fill("#bulk-note", "steam is fine here")
            page.click("#bulk-approve")
            page.wait_for_function("document.querySelector('#bulk-message').textContent.startsWith('approved')")
            message = page.text_content("#bulk-message")
            assert page.get_attribute("#bulk-message", "data-skipped") == str(late.job_id), message
            assert f"approved {boiling.total - 1} job(s); skipped 1 that changed under you: {late.job_id}" == message

            # a selection on a page: two passed clips declined with one note
            page.goto(base + "/batch/b?state=passed")
            page.wait_for_function("document.body.dataset.ready === '1'")
            cards = page.locator(".card")
            picked = [int(cards.nth(i).get_attribute("data-job")) for i in (0, 1)]
            cards.nth(0).locator(".pick").check()
            cards.nth(1).locator(".pick").check()
            assert page.text_content("#selected-count") == "2 selected"
            page.fill("#bulk-note", "off brand")
            page.click("#bulk-decline")
            page.wait_for_function("document.querySelector('#bulk-message').textContent === 'declined 2 job(s)'")

            # a job passed on a retry: its attempts side by side; a contact sheet enlarged
            page.goto(base + "/batch/b?retry=1")
            page.wait_for_function("document.body.dataset.ready === '1'")
            page.locator(".card button.compare").first.click()
            figures = page.locator("#modal figure")
            assert page.is_visible("#modal") and figures.count() == 2
            assert figures.nth(0).locator("figcaption").text_content().startswith("attempt 1: seed ")
            assert "reject" in figures.nth(0).text_content() and "pass" in figures.nth(1).text_content()
            page.keyboard.press("Escape")
            assert not page.is_visible("#modal")
            page.goto(base + "/batch/b?state=rejected")
            page.wait_for_function("document.body.dataset.ready === '1'")
            sheet = page.locator(".card img.sheet").first
            sheet.scroll_into_view_if_needed()
            page.wait_for_function("document.querySelector('.card img.sheet').complete && "
                                   "document.querySelector('.card img.sheet').naturalWidth > 0")
            sheet.click()
            big = page.locator("#modal img.big")
            assert big.count() == 1 and big.evaluate("i => i.getBoundingClientRect().width") > 3 * sheet.evaluate(
                "i => i.getBoundingClientRect().width") / 2
            browser.close()
    finally:
        stop(server)
    with db.session() as s:
        ids = [c.job_id for c in boiling.clips]
        states = dict(s.execute(select(Job.id, Job.state).where(Job.id.in_(ids))).all())
        decisions = s.execute(select(Decision.job_id, Decision.operator, Decision.decision, Decision.note)
                              .where(Decision.job_id.in_(ids))).all()
        declined = s.execute(select(Decision.job_id, Decision.note).where(Decision.job_id.in_(picked))).all()
    assert states[late.job_id] == "declined" and sum(v == "approved" for v in states.values()) == len(ids) - 1
    assert len(decisions) == len(ids)  # one record per job: bob's for the late one, alice's for the rest
    assert {(d.operator, d.decision, d.note) for d in decisions if d.job_id != late.job_id} == {
        ("alice", "approved", "steam is fine here")}
    assert sorted(declined) == sorted((j, "off brand") for j in picked)
    summary = {o["operator"]: o for o in operator_summary(db, "b")}
    assert summary["alice"]["decisions"] == len(ids) - 1 + 2 and summary["alice"]["approved"] == len(ids) - 1
    assert summary["bob"]["decisions"] == 1
    db.dispose()


@pytest.mark.slow
def test_the_nothing_passed_notice_stays_and_rejects_stay_in_view_after_a_decision(tmp_path):
    from playwright.sync_api import sync_playwright

    chromium = need_program("chromium", "Debian's Chromium")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    db = Database(url)
    synthetic_batch(db, "none", 6, tmp_path / "out", seed=1, rejected=1.0)
    server, base = _serve(tmp_path, url, "none")
    try:
        with sync_playwright() as p:
            browser, page = _browser(p, chromium)
            page.goto(base + "/batch/none")
            assert "No clip of this batch passed QC" in page.text_content("#notice")
            assert page.locator(".card").count() == 6
            first = page.locator(".card").first
            first.locator("input[name=note]").fill("rescued")
            first.locator("button[value=approve]").click()
            page.wait_for_function("document.querySelector('.card .state').textContent === 'approved'")
            page.reload()
            assert "No clip of this batch passed QC" in page.text_content("#notice")
            states = [page.locator(".card .state").nth(i).text_content() for i in range(page.locator(".card").count())]
            assert sorted(states) == ["approved"] + ["rejected"] * 5
            # a decline's note leaves its box
            card = page.locator(".card").nth(1)
            card.locator("input[name=note]").fill("garbage")
            card.locator("button[value=decline]").click()
            page.wait_for_function("document.querySelectorAll('.card .state')[1].textContent === 'declined'")
            assert card.locator("input[name=note]").input_value() == ""
            browser.close()
    finally:
        stop(server)
    db.dispose()


def test_pages_are_the_same_on_postgresql_and_sqlite(tmp_path, pg_url):
    lite = Database(f"sqlite:///{tmp_path / 'c.db'}")
    pg = Database(pg_url)
    for db in (lite, pg):
        synthetic_batch(db, "same", 300, tmp_path / "out", seed=9, media=False)
    views = [View(), View(page=3, per=20), View(sort="time"), View(sort="line", filter="all"),
             View(filter="rejected", reason="black"), View(filter="all", q="store 1"), View(filter="all", q="100%_"),
             View(retry=True, tier="quality")]
    for v in views:
        a, b = page_of(lite, "same", v), page_of(pg, "same", v)
        assert [c.job_id for c in a.clips] == [c.job_id for c in b.clips], v
        assert a.counts == b.counts and a.total == b.total, v
    assert page_of(pg, "same", View(filter="all", q="100%_")).total == 0  # % and _ are text, not wildcards
    with pg.session() as s:
        retried = s.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == "same", Job.attempts_made > 1, Job.state == "passed"))
    assert retried and page_of(pg, "same", View(retry=True)).total == retried
    lite.dispose()
    pg.dispose()
