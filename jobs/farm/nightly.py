"""Nightly runs: drain the queue by a deadline, with the adaptive tier scheduler, and write the
morning report.

Between groups it feeds the scheduler the groups rendered since it last looked (seconds per
denoising step, per worker, from the attempts' timings), asks whether the remaining work fits,
and sets the tier of queued jobs that asked for `quality` to what the scheduler chose. Every
decision that changed the tier is logged and goes into the report.

Streaming previews are served first by the render workers (jobs.farm.preview), so the time they
took over the last ``PREVIEW_WINDOW_S`` seconds (``preview_sessions``) is counted as a share of
the workers that goes on being taken: the prediction has that much less of them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

from sqlalchemy import func, or_, select, text, update

from clipmill.jobs.core.db import Database, sqlite_file
from clipmill.jobs.core.locks import exclusive_lock
from clipmill.jobs.core.models import PREVIEW_SEEN_EVERY_S, Attempt, Job, PreviewSession
from clipmill.jobs.core.states import JobState
from clipmill.jobs.farm.dispatch import BrokerDown, reconcile
from clipmill.jobs.farm.scheduler import Decision, SchedulerConfig, TierScheduler

log = logging.getLogger("clipmill.nightly")
OPEN = (JobState.QUEUED.value, JobState.RENDERING.value, JobState.POST.value)
SEEN_LOST_S = 6 * PREVIEW_SEEN_EVERY_S  # an open preview row not marked seen for this long: its worker died
PREVIEW_WINDOW_S = 1800.0  # the previews' recent share of the workers is measured over this


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)  # SQLite gives naive UTC back


def preview_seconds(db: Database, since: datetime, until: datetime, max_s: float = 900.0) -> float:
    """Seconds of render time previews took between ``since`` and ``until``: each session from
    its start to its end, a session still open up to ``until``, but never more than ``max_s``
    after its start (the preview time limit; 0: none) nor ``SEEN_LOST_S`` after its worker last
    marked it streaming (``seen_at``): a row whose worker died is not counted on, with or without
    a time limit. A row never started (no worker took it: its page went while it waited) counts
    nothing."""
    with db.session() as s:
        rows = s.execute(select(PreviewSession.started_at, PreviewSession.ended_at, PreviewSession.seen_at).where(
            PreviewSession.started_at.is_not(None), PreviewSession.started_at < until,
            or_(PreviewSession.ended_at.is_(None), PreviewSession.ended_at > since))).all()
    total = 0.0
    for started, ended, seen in rows:
        started = _aware(started)
        if ended is not None:
            end = _aware(ended)
        else:
            end = started + timedelta(seconds=max_s) if max_s else until
            if seen is not None:
                end = min(end, _aware(seen) + timedelta(seconds=SEEN_LOST_S))
        total += max(0.0, (min(end, until) - max(started, since)).total_seconds())
    return total


def parse_deadline(text: str, zone: str, now: datetime | None = None) -> datetime:
    """``HH:MM`` (the next such time of day), ``+SECONDS``, or an ISO date-time (one without an
    offset is read in ``zone``).

    ``zone`` is the one time zone of every clipmill time of day, ``Settings.timezone``
    (``CLIPMILL_TIMEZONE``, else this host's): `clipmill nightly --deadline` and the beat's nightly
    task both pass it, and the beat schedules ``CLIPMILL_NIGHTLY_AT`` in it, so the same text means
    the same instant wherever it is given.
    """
    try:
        tz = ZoneInfo(zone)
    except Exception:  # noqa: BLE001 - ZoneInfoNotFoundError, ValueError
        raise ValueError(f"time zone {zone!r}: not a time zone name; expected e.g. Europe/Paris or UTC (CLIPMILL_TIMEZONE)")
    now = (now or datetime.now(timezone.utc)).astimezone(tz)
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if m:
        h, mi = int(m.group(1)), int(m.group(2))
        if h > 23 or mi > 59:
            raise ValueError(f"--deadline {text!r}: not a time of day; allowed HH:MM, +SECONDS or an ISO date-time")
        at = now.replace(hour=h, minute=mi, second=0, microsecond=0)
        return at if at > now else at + timedelta(days=1)  # wall-clock arithmetic: HH:MM there, across DST too
    if re.fullmatch(r"\+\d+(\.\d+)?", text.strip()):
        return now + timedelta(seconds=float(text.strip()[1:]))
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--deadline {text!r}: allowed HH:MM, +SECONDS or an ISO date-time")
    return at if at.tzinfo else at.replace(tzinfo=tz)


@dataclass
class Supervisor:
    db: Database
    deadline: datetime
    cfg: SchedulerConfig = field(default_factory=SchedulerConfig)
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    preview_max_s: float = 900.0  # the farm's CLIPMILL_PREVIEW_MAX
    scheduler: TierScheduler = field(init=False)
    seen_groups: set = field(default_factory=set)
    changes: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.scheduler = TierScheduler(self.cfg)

    def time_left(self) -> float:
        return (self.deadline - datetime.now(timezone.utc)).total_seconds()

    def feed(self) -> int:
        """Record every group rendered since the run started that the scheduler has not seen."""
        with self.db.session() as s:
            rows = s.execute(
                select(Attempt.group_id, Attempt.worker, Attempt.steps, Attempt.group_size, Attempt.timings)
                .where(Attempt.started_at >= self.started, Attempt.group_id.is_not(None))
            ).all()
        groups: dict = {}
        for gid, worker, steps, size, timings in rows:
            if gid in self.seen_groups or not timings or "denoise_s" not in timings:
                continue
            g = groups.setdefault(gid, {"worker": worker, "steps": steps, "clips": 0, "seconds": 0.0})
            g["clips"] += 1
            g["seconds"] += float(timings["denoise_s"])  # each attempt holds its share of the group
        for gid, g in groups.items():
            self.scheduler.record(g["worker"] or "?", g["seconds"], g["steps"], g["clips"])
            self.seen_groups.add(gid)
        return len(groups)

    def preview_share(self, workers: int) -> float:
        """The share of ``workers``' time that previews took over the last PREVIEW_WINDOW_S."""
        now = datetime.now(timezone.utc)
        busy = preview_seconds(self.db, now - timedelta(seconds=PREVIEW_WINDOW_S), now, self.preview_max_s)
        return min(1.0, busy / (max(1, workers) * PREVIEW_WINDOW_S))

    def step(self, workers: int = 1) -> Decision:
        """Measure, decide, apply. Called before each group (embedded) or periodically (farm)."""
        self.feed()
        with self.db.session() as s:
            q = s.scalar(select(func.count()).select_from(Job).where(
                Job.state == JobState.QUEUED.value, func.coalesce(Job.tier_requested, Job.tier) == "quality"))
            f = s.scalar(select(func.count()).select_from(Job).where(
                Job.state == JobState.QUEUED.value, func.coalesce(Job.tier_requested, Job.tier) == "fast"))
        d = self.scheduler.decide(max(self.time_left(), 0.0), q, f, workers, self.preview_share(workers))
        with self.db.session() as s, s.begin():
            s.execute(update(Job).where(
                Job.state == JobState.QUEUED.value, func.coalesce(Job.tier_requested, Job.tier) == "quality",
                Job.tier != d.tier).values(tier=d.tier).execution_options(synchronize_session=False))
        if d.changed or d.will_miss:
            entry = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "tier": d.tier,
                     "reason": d.reason, "time_left_s": round(d.time_left_s, 1), "will_miss": d.will_miss,
                     "preview_share": round(d.preview_share, 3)}
            if not self.changes or self.changes[-1]["tier"] != d.tier or d.changed:
                self.changes.append(entry)
                log.warning("nightly: %s", entry)
        return d

    def report(self) -> dict:
        with self.db.session() as s:
            attempts = s.scalars(select(Attempt).where(Attempt.started_at >= self.started)).all()
            job_ids = {a.job_id for a in attempts}
            jobs = s.scalars(select(Job).where(Job.id.in_(job_ids))).all() if job_ids else []
            still_open = s.scalar(select(func.count()).select_from(Job).where(Job.state.in_(OPEN)))
        passed = [j for j in jobs if j.state in ("passed", "approved", "declined")]
        render_s = sum(float((a.timings or {}).get("render_s", 0.0)) for a in attempts)
        failures = [{"job": j.id, "batch": j.batch_id, "line": j.line, "state": j.state,
                     "reason": j.error or "; ".join(next((a.reasons or [] for a in reversed(attempts) if a.job_id == j.id), []))}
                    for j in jobs if j.state in ("failed", "rejected")]
        return {
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "deadline": self.deadline.astimezone(timezone.utc).isoformat(timespec="seconds"),
            "clips_produced": sum(1 for a in attempts if a.state in ("passed", "rejected")),
            "attempts": len(attempts),
            "passed": len(passed),
            "rejected": sum(1 for j in jobs if j.state == "rejected"),
            "failed": sum(1 for j in jobs if j.state == "failed"),
            "not_finished": still_open,
            "gpu_seconds_per_passed_clip": round(render_s / len(passed), 3) if passed else None,
            "render_seconds": round(render_s, 3),
            "preview_seconds": round(preview_seconds(self.db, self.started, datetime.now(timezone.utc),
                                                     self.preview_max_s), 1),
            "tier_changes": self.changes,
            "failures": failures,
        }


def report_markdown(r: dict) -> str:
    lines = [
        f"# clipmill nightly report, {r['started'][:10]}",
        "",
        f"Run {r['started']} to {r['finished']}, deadline {r['deadline']}."
        + (f" Stopped early: {r['stopped']}." if r.get("stopped") else ""),
        "",
        "| clips produced | passed | rejected | failed | not finished | GPU-seconds per passed clip |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {r['clips_produced']} | {r['passed']} | {r['rejected']} | {r['failed']} | {r['not_finished']} | "
        f"{r['gpu_seconds_per_passed_clip'] if r['gpu_seconds_per_passed_clip'] is not None else '-'} |",
        "",
        f"Streaming previews took {r.get('preview_seconds', 0)} s of the render workers' time.",
        "",
        "## Tier changes",
        "",
    ]
    lines += [f"- {c['at']}: {c['tier']} ({c['reason']})" for c in r["tier_changes"]] or ["- none: every job ran at its own tier"]
    lines += ["", "## Failures and rejects", ""]
    lines += [f"- job {f['job']} ({f['batch']}, line {f['line']}) {f['state']}: {f['reason']}" for f in r["failures"]] or ["- none"]
    return "\n".join(lines) + "\n"


def write_report(r: dict, storage, name: str) -> list[str]:
    return [
        storage.put_bytes(f"reports/{name}.json", json.dumps(r, indent=2, ensure_ascii=False).encode()),
        storage.put_bytes(f"reports/{name}.md", report_markdown(r).encode()),
    ]


NIGHTLY_LOCK = 4242002  # PostgreSQL advisory lock class: one nightly run per job table (schema)


class NightlyRunning(RuntimeError):
    """Another nightly run holds the job table's nightly lock."""


def lock_file(db: Database) -> Path | None:
    """SQLite: the nightly lock file beside the database file (None for an in-memory database)."""
    path = sqlite_file(db.engine.url)
    return None if path is None else path.expanduser().resolve().with_name(path.name + ".nightly.lock")


@contextmanager
def single_run(db: Database):
    """Hold the job table's nightly lock for the run: a second nightly (a second beat, or one
    started by hand) stops at once with ``NightlyRunning`` instead of making tier decisions
    against the first. The lock goes when the run ends or its process dies.

    PostgreSQL: a session-level advisory lock (class ``NIGHTLY_LOCK``, keyed by the schema, so
    job tables in other schemas of the same database do not block each other) on a connection of
    its own in autocommit mode. No transaction stays open during the run, so a server's
    ``idle_in_transaction_session_timeout`` cannot end the session and silently drop the lock;
    the session also turns its ``idle_session_timeout`` off.

    SQLite (one machine): an exclusive ``flock`` on ``DB.nightly.lock`` beside the database file
    (``jobs.core.locks``). The file stays when the run ends; only the lock on it matters. An
    in-memory database, which one process alone can see, takes none.
    """
    if db.engine.dialect.name == "postgresql":
        with _pg_lock(db):
            yield
    elif (path := lock_file(db)) is not None:
        with _file_lock(path):
            yield
    else:
        yield


@contextmanager
def _pg_lock(db: Database):
    conn = db.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    key = {"k": NIGHTLY_LOCK}
    try:
        # hashtext(): the schema name as the lock's second int4 key
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k, hashtext(coalesce(current_schema(), '')))"), key
                            ).scalar():
            raise NightlyRunning("another nightly run is in progress on this database (it holds the nightly "
                                 "lock); this one stops. Run one beat per farm.")
        try:
            conn.execute(text("SET idle_in_transaction_session_timeout = 0"))
            if conn.dialect.server_version_info >= (14,):
                conn.execute(text("SET idle_session_timeout = 0"))
            yield
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k, hashtext(coalesce(current_schema(), '')))"), key)
            except Exception as e:  # noqa: BLE001 - the session is gone, and its lock with it
                log.warning("releasing the nightly lock: %s", e)
    finally:
        conn.invalidate()  # its session settings stay out of the pool
        conn.close()


def _file_lock(path: Path):
    return exclusive_lock(path, lambda holder: NightlyRunning(
        f"another nightly run is in progress on this database (it holds {path}); this one stops. On SQLite one "
        f"nightly run works a database file at a time. The lock is held by {holder}."))


def run_farm(db: Database, sup: Supervisor, interval: float = 30.0, stop: threading.Event | None = None) -> bool:
    """Farm mode: until the deadline, until no job is open, or until ``stop`` is set (the worker
    running it shuts down), run reconcile and let the scheduler measure and decide every
    ``interval`` seconds. The workers do the rendering. Returns whether ``stop`` ended it."""
    stop = stop or threading.Event()
    while sup.time_left() > 0 and not stop.is_set():
        try:
            reconcile(db, stale_s=max(600.0, 4 * interval))
        except BrokerDown as e:
            log.warning("nightly: broker unreachable (%s); retrying", e)
        with db.session() as s:
            left = s.scalar(select(func.count()).select_from(Job).where(Job.state.in_(OPEN)))
            since = datetime.now(timezone.utc) - timedelta(minutes=30)
            workers = s.scalar(select(func.count(func.distinct(Attempt.worker))).where(Attempt.started_at >= since))
        if not left:
            break
        sup.step(max(1, workers or 0))
        stop.wait(max(0.0, min(interval, sup.time_left())))
    return stop.is_set()


def report_name(report: dict) -> str:
    return f"nightly-{report['started'][:10]}"
