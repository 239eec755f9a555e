"""Operator review: what a batch has to show, and approve / decline decisions.

A decision is a compare-and-set on the job row: it carries the job version the operator saw,
so when two operators decide on the same clip the later one is told instead of silently
overwriting the first. Every decision is kept in the ``decisions`` table, and approving a clip
that QC rejected is recorded as an override.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Batch, Decision, Job
from clipmill.jobs.core.states import JOB_MOVES, JobState, MoveConflict, move_job

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


def clips(db: Database, batch_id: str, filter_name: str = "review") -> list[ClipView]:
    states = states_for(filter_name)
    with db.session() as s:
        if s.get(Batch, batch_id) is None:
            raise ReviewError(f"batch {batch_id!r}: no such batch")
        jobs = s.scalars(select(Job).where(Job.batch_id == batch_id, Job.state.in_(states)).order_by(Job.id)).all()
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
            )
        )
    return out


def decide(db: Database, job_id: int, version: int, decision: str, note: str, operator: str) -> dict:
    """Approve or decline ``job_id`` if it is still at ``version``; returns its new state."""
    if decision not in DECISIONS:
        raise ReviewError(f"decision {decision!r}: allowed approve, decline")
    note = (note or "").strip()
    if len(note) > MAX_NOTE:
        raise ReviewError(f"note: {len(note)} characters; at most {MAX_NOTE}")
    operator = (operator or "").strip()[:120] or "operator"
    dst = DECISIONS[decision]
    with db.session() as s, s.begin():
        job = s.get(Job, job_id)
        if job is None:
            raise ReviewError(f"job {job_id}: no such job")
        src = JobState(job.state)
        if job.version != version:
            last = s.scalars(select(Decision).where(Decision.job_id == job_id).order_by(Decision.id.desc())).first()
            who = f" by {last.operator} at {_hm(last.created_at)}" if last else ""
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


def _hm(t: datetime) -> str:
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
