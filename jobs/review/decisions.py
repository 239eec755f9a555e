"""Operator review: what a batch has to show, and approve / decline decisions.

A decision is a compare-and-set on the job row: it carries the job version the operator saw,
so when two operators decide on the same clip the later one is told instead of silently
overwriting the first. Every decision is kept in the ``decisions`` table, and approving a clip
that QC rejected is recorded as an override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from sqlalchemy import func, select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Batch, Decision, Job
from clipmill.jobs.core.states import JOB_MOVES, JobState, MoveConflict, move_job
from clipmill.jobs.runner.checks import VERDICT_KINDS

DECISIONS = {"approve": JobState.APPROVED, "decline": JobState.DECLINED}
REVIEW_STATES = ("passed", "approved", "declined")  # what the page shows unless asked for more
FILTERS = ("review", "passed", "approved", "declined", "rejected", "all")
MAX_NOTE = 500


class ReviewError(ValueError):
    """A decision that cannot be made (unknown job, bad input)."""


class DecisionConflict(RuntimeError):
    """The job changed since the operator loaded it."""


@dataclass
class ClipView:
    job_id: int
    client_id: str | None
    line: int
    state: str
    version: int
    prompt: str
    prompt_raw: str
    seed: int
    tier: str
    attempts: int
    attempt_no: int | None
    verdict: str | None
    reasons: list[str]
    metrics: dict
    has_clip: bool
    has_sheet: bool
    last_decision: dict | None = None
    history: list[dict] = field(default_factory=list)
    margin: float | None = None  # qc.margin: how close the clip came to a QC limit
    near: str | None = None  # the metric that came nearest
    attempt_list: list[dict] = field(default_factory=list)  # every attempt, to compare retries


def states_for(filter_name: str) -> tuple[str, ...]:
    if filter_name not in FILTERS:
        raise ReviewError(f"state filter {filter_name!r}: allowed {', '.join(FILTERS)}")
    if filter_name == "review":
        return REVIEW_STATES
    if filter_name == "all":
        return (*REVIEW_STATES, "rejected")
    return (filter_name,)


def shown_attempt(atts: list[Attempt]) -> Attempt | None:
    with_clip = [a for a in atts if a.clip_key]
    return with_clip[-1] if with_clip else (atts[-1] if atts else None)


SORTS = ("risk", "time", "line")
PER_PAGE = 48
MAX_PER_PAGE = 200


@dataclass(frozen=True)
class View:
    """What a review page shows: a state filter, the order, the page, and narrowing filters
    (a QC reason kind, a tier, jobs that passed on a retry, a text in the prompt)."""

    filter: str = "review"
    sort: str = "risk"
    page: int = 1
    per: int = PER_PAGE
    reason: str = ""
    tier: str = ""
    retry: bool = False
    q: str = ""

    def check(self) -> View:
        states_for(self.filter)
        if self.sort not in SORTS:
            raise ReviewError(f"sort {self.sort!r}: allowed {', '.join(SORTS)}")
        if self.page < 1:
            raise ReviewError(f"page {self.page}: pages start at 1")
        if not 1 <= self.per <= MAX_PER_PAGE:
            raise ReviewError(f"per {self.per}: allowed 1 to {MAX_PER_PAGE}")
        if self.reason and self.reason not in VERDICT_KINDS:
            raise ReviewError(f"reason {self.reason!r}: allowed {', '.join(VERDICT_KINDS)}")
        if len(self.q) > 200:
            raise ReviewError(f"q: {len(self.q)} characters; at most 200")
        return self


@dataclass
class Page:
    clips: list[ClipView]
    total: int  # jobs matching the view, over all pages
    counts: dict[str, int]  # per state filter, under the view's narrowing filters
    nothing_passed: bool  # no clip of the batch passed QC: the default view shows the rejects
    view: View

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.view.per))


def _narrowed(q, view: View):
    if view.reason:
        q = q.where(Job.qc_kinds.like(f"%,{view.reason},%"))
    if view.tier:
        q = q.where(Job.tier == view.tier)
    if view.retry:
        q = q.where(Job.attempts_made > 1)
    if view.q:
        text = view.q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        q = q.where(Job.prompt.ilike(f"%{text}%", escape="\\"))
    return q


def _order(q, sort: str):
    if sort == "risk":  # the borderline first; jobs without a margin (checked before 0010) last
        return q.order_by(Job.qc_margin.is_(None), Job.qc_margin, Job.id)
    if sort == "time":
        return q.order_by(Job.updated_at.desc(), Job.id.desc())
    return q.order_by(Job.line, Job.id)


def _states(s, batch_id: str, view: View) -> tuple[tuple[str, ...], bool]:
    """The states the view shows, and whether nothing of the batch passed QC (then the default
    view shows the rejects as well, until a clip passes)."""
    nothing_passed = s.scalar(select(Attempt.id).join(Job, Attempt.job_id == Job.id).where(
        Job.batch_id == batch_id, Attempt.verdict == "pass").limit(1)) is None
    if view.filter == "review" and nothing_passed:
        return (*REVIEW_STATES, "rejected"), True
    return states_for(view.filter), nothing_passed


def page_of(db: Database, batch_id: str, view: View = View()) -> Page:
    """One page of a batch's clips in the view's order, with the counts of every filter."""
    view.check()
    with db.session() as s:
        if s.get(Batch, batch_id) is None:
            raise ReviewError(f"batch {batch_id!r}: no such batch")
        states, nothing_passed = _states(s, batch_id, view)
        base = _narrowed(select(Job).where(Job.batch_id == batch_id), view)
        by_state = dict(s.execute(_narrowed(select(Job.state, func.count()).where(Job.batch_id == batch_id), view)
                                  .group_by(Job.state)).all())
        counts = {f: sum(by_state.get(st, 0) for st in states_for(f)) for f in FILTERS}
        total = sum(by_state.get(st, 0) for st in states)
        jobs = s.scalars(_order(base.where(Job.state.in_(states)), view.sort)
                         .limit(view.per).offset((view.page - 1) * view.per)).all()
        views = _views(s, jobs)
    return Page(views, total, counts, nothing_passed, view)


def clips(db: Database, batch_id: str, filter_name: str = "review") -> list[ClipView]:
    """Every clip of a batch in a state filter, in job order (no paging)."""
    states = states_for(filter_name)
    with db.session() as s:
        if s.get(Batch, batch_id) is None:
            raise ReviewError(f"batch {batch_id!r}: no such batch")
        jobs = s.scalars(select(Job).where(Job.batch_id == batch_id, Job.state.in_(states)).order_by(Job.id)).all()
        return _views(s, jobs)


def _views(s, jobs: list[Job]) -> list[ClipView]:
    ids = [j.id for j in jobs]
    atts: dict[int, list[Attempt]] = {}
    for a in s.scalars(select(Attempt).where(Attempt.job_id.in_(ids)).order_by(Attempt.number)):
        atts.setdefault(a.job_id, []).append(a)
    decs: dict[int, list[Decision]] = {}
    for d in s.scalars(select(Decision).where(Decision.job_id.in_(ids)).order_by(Decision.id)):
        decs.setdefault(d.job_id, []).append(d)
    out = []
    for j in jobs:
        a = shown_attempt(atts.get(j.id, []))
        history = [
            {"decision": d.decision, "operator": d.operator, "note": d.note, "override": d.override,
             "at": d.created_at.isoformat(timespec="seconds")}
            for d in decs.get(j.id, [])
        ]
        out.append(
            ClipView(
                job_id=j.id, client_id=j.client_id, line=j.line, state=j.state, version=j.version,
                prompt=j.prompt, prompt_raw=j.prompt_raw, seed=a.seed if a else j.seed, tier=a.tier if a else j.tier,
                attempts=len(atts.get(j.id, [])), attempt_no=a.number if a else None,
                verdict=a.verdict if a else None, reasons=(a.reasons or []) if a else [],
                metrics=(a.qc_metrics or {}) if a else {}, has_clip=bool(a and a.clip_key),
                has_sheet=bool(a and a.clip_key), last_decision=history[-1] if history else None, history=history,
                margin=j.qc_margin, near=j.qc_near,
                attempt_list=[{"number": x.number, "seed": x.seed, "tier": x.tier, "verdict": x.verdict,
                               "reasons": x.reasons or [], "has_clip": bool(x.clip_key)} for x in atts.get(j.id, [])],
            )
        )
    return out


def decide(db: Database, job_id: int, version: int, decision: str, note: str, operator: str) -> dict:
    """Approve or decline ``job_id`` if it is still at ``version``; returns its new state."""
    if decision not in DECISIONS:
        raise ReviewError(f"decision {decision!r}: allowed approve, decline")
    note, operator = clean_note(note, operator)
    dst = DECISIONS[decision]
    with db.session() as s, s.begin():
        job = s.get(Job, job_id)
        if job is None:
            raise ReviewError(f"job {job_id}: no such job")
        src = JobState(job.state)
        if job.version != version:
            last = s.scalars(select(Decision).where(Decision.job_id == job_id).order_by(Decision.id.desc())).first()
            who = f" by {last.operator} at {hm(last.created_at)}" if last else ""
            raise DecisionConflict(
                f"job {job_id} changed since you loaded it: it is now {job.state}{who}; reload to see it"
            )
        if dst == src:
            return {"job": job_id, "state": job.state, "version": job.version}
        if dst not in JOB_MOVES[src]:
            raise ReviewError(f"job {job_id} is {src.value}; only passed or rejected clips can be approved or declined")
        try:
            move_job(s, job_id, src, dst, version=version)
        except MoveConflict:
            raise DecisionConflict(f"job {job_id} changed since you loaded it; reload to see it")
        attempt = shown_attempt(list(s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number))))
        s.add(
            Decision(
                job_id=job_id, attempt_id=attempt.id if attempt else None, decision=dst.value, from_state=src.value,
                override=src is JobState.REJECTED and dst is JobState.APPROVED, note=note, operator=operator,
            )
        )
        return {"job": job_id, "state": dst.value, "version": version + 1}


def clean_note(note: str, operator: str) -> tuple[str, str]:
    """A decision's note (stripped, at most MAX_NOTE characters, else ReviewError) and its
    operator's name (at most 120 characters; "operator" when empty)."""
    note = (note or "").strip()
    if len(note) > MAX_NOTE:
        raise ReviewError(f"note: {len(note)} characters; at most {MAX_NOTE}")
    return note, (operator or "").strip()[:120] or "operator"


def hm(t: datetime) -> str:
    return t.strftime("%H:%M:%S")


def media_key(db: Database, job_id: int, attempt_no: int, kind: str) -> tuple[str, str] | None:
    """(storage root, key) of a clip, poster or contact sheet, looked up in the job table.

    Keys never come from the request: only ids do."""
    suffix = {"clip": "clip_key", "poster": "poster_key", "sheet": "sidecar_key"}.get(kind)
    if suffix is None:
        return None
    with db.session() as s:
        row = s.execute(
            select(Attempt, Batch).join(Job, Attempt.job_id == Job.id).join(Batch, Job.batch_id == Batch.id)
            .where(Attempt.job_id == job_id, Attempt.number == attempt_no)
        ).first()
    if row is None:
        return None
    a, batch = row
    key = getattr(a, suffix)
    if key is None:
        return None
    if kind == "sheet":  # the contact sheet sits beside the sidecar: aN.json -> aN.sheet.png
        key = key[: -len(".json")] + ".sheet.png"
    return batch.out, key


@dataclass
class BulkResult:
    changed: list[dict] = field(default_factory=list)  # {"job", "state", "version"}
    skipped: list[dict] = field(default_factory=list)  # {"job", "reason"}


def decide_many(db: Database, items: list[tuple[int, int]], decision: str, note: str, operator: str) -> BulkResult:
    """One decision on many jobs, each still a compare-and-set on the version the operator saw
    (``items``: job id, version). A job that changed meanwhile is skipped and reported, never
    overwritten; every job decided gets its own decision record."""
    if decision not in DECISIONS:
        raise ReviewError(f"decision {decision!r}: allowed approve, decline")
    out = BulkResult()
    for job_id, version in items:
        try:
            out.changed.append(decide(db, job_id, version, decision, note, operator))
        except (DecisionConflict, ReviewError) as e:
            out.skipped.append({"job": job_id, "reason": str(e)})
    return out


def matching(db: Database, batch_id: str, view: View, loaded_at: datetime, snapshot: int
             ) -> tuple[list[tuple[int, int]], list[dict]]:
    """Every job of the view, over all pages, as (id, version) to decide on, and the jobs the
    operator's page counted that changed since (``loaded_at``: when the page was made;
    ``snapshot``: the last decision id then): skipped, with the reason. A job another operator
    decided meanwhile has left the view, and is reported, not silently dropped."""
    view.check()
    with db.session() as s:
        states, _ = _states(s, batch_id, view)
        rows = s.execute(_order(_narrowed(select(Job.id, Job.version, Job.updated_at, Job.state).where(
            Job.batch_id == batch_id, Job.state.in_(states)), view), view.sort)).all()
        # decided since the page was made, from a state the view showed: gone from it meanwhile
        gone = s.execute(_narrowed(select(Decision.job_id, Decision.operator, Decision.created_at, Job.state)
                                   .join(Job, Decision.job_id == Job.id).where(
            Job.batch_id == batch_id, Decision.id > snapshot, Decision.from_state.in_(states),
            Job.state.not_in(states)), view).order_by(Decision.id)).all()
    seen = _utc(loaded_at)
    take, skipped, reported = [], [], set()
    for job_id, version, updated, state in rows:
        if _utc(updated) > seen:
            skipped.append({"job": job_id, "reason": f"job {job_id} changed after you loaded the page (it is now "
                                                      f"{state}); reload to see it"})
        else:
            take.append((job_id, version))
    for job_id, operator, at, state in gone:
        if job_id not in reported:
            reported.add(job_id)
            skipped.append({"job": job_id, "reason": f"job {job_id} changed since you loaded it: it is now {state} "
                                                      f"by {operator} at {hm(at)}; reload to see it"})
    return take, skipped


def last_decision_id(db: Database) -> int:
    """The newest decision's id: a page's snapshot, for bulk decisions over a filter."""
    with db.session() as s:
        return s.scalar(select(func.max(Decision.id))) or 0


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)  # SQLite hands back naive UTC


ACTIVE_GAP_S = 300.0  # a pause longer than this between two decisions is not review time


def operator_summary(db: Database, batch_id: str) -> list[dict]:
    """Per operator on a batch: decisions made (approved, declined, overrides) and the time
    spent, counted as the gaps between consecutive decisions up to ACTIVE_GAP_S each."""
    with db.session() as s:
        rows = s.execute(select(Decision.operator, Decision.decision, Decision.override, Decision.created_at)
                         .join(Job, Decision.job_id == Job.id).where(Job.batch_id == batch_id)
                         .order_by(Decision.operator, Decision.created_at, Decision.id)).all()
    out: dict[str, dict] = {}
    last: dict[str, datetime] = {}
    for op, dec, override, at in rows:
        o = out.setdefault(op, {"operator": op, "decisions": 0, "approved": 0, "declined": 0, "overrides": 0,
                                "active_s": 0.0, "first": at, "last": at})
        o["decisions"] += 1
        o[dec] = o.get(dec, 0) + 1
        o["overrides"] += bool(override)
        if op in last:
            o["active_s"] += min((at - last[op]).total_seconds(), ACTIVE_GAP_S)
        last[op] = o["last"] = at
    for o in out.values():
        o["active_s"] = round(o["active_s"], 1)
        o["per_decision_s"] = round(o["active_s"] / max(1, o["decisions"] - 1), 1)
        o["first"], o["last"] = o["first"].isoformat(timespec="seconds"), o["last"].isoformat(timespec="seconds")
    return sorted(out.values(), key=lambda o: -o["decisions"])
