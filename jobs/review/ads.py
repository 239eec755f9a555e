"""Operator review of ad batches: what an ad has to show (its formats, its shots with their QC),
approving or declining it, and re-rendering one of its shots with a new seed.

Every decision is a compare-and-set on the ad's version, so two operators never overwrite each
other silently, and every one is kept in ``ad_decisions``. Re-rendering a shot queues its jobs
again (their next attempt gets a new seed, see ``queue.attempt_seed``) and sends the ad back to
``waiting``, in one transaction; the ad is assembled again, under the same keys, once the new
shot has passed QC (in-process by the review server, or by the farm's post queue).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import func, select, update

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, AdDecision, Attempt, Batch, Job
from clipmill.jobs.core.queue import now
from clipmill.jobs.core.states import JobState, MoveConflict, move_job
from clipmill.jobs.review.decisions import DecisionConflict, ReviewError, clean_note, hm, shown_attempt

AD_FILTERS = ("all", "done", "approved", "declined", "rejected", "open")
OPEN_STATES = ("waiting", "assembling")
AD_DECISIONS = {"approve": "approved", "decline": "declined"}
# an ad's moves by an operator; approving needs every format written (a rejected ad whose
# ad-level QC refused a format: an override; one that lost a shot has no files to approve)
AD_MOVES = {"done": ("approved", "declined"), "rejected": ("approved", "declined"), "failed": ("declined",),
            "approved": ("declined",), "declined": ("approved",)}
RERENDER_FROM = ("done", "rejected", "failed", "approved", "declined")
RERENDER_JOBS = (JobState.PASSED, JobState.APPROVED, JobState.DECLINED, JobState.REJECTED, JobState.FAILED,
                 JobState.CANCELLED)


@dataclass
class ShotJob:
    job_id: int
    state: str
    width: int
    height: int
    formats: list[str]
    attempts: int
    attempt_no: int | None
    seed: int | None
    tier: str
    verdict: str | None
    reasons: list[str]
    metrics: dict
    has_clip: bool
    prompt: str


@dataclass
class FormatView:
    name: str
    width: int
    height: int
    seconds: float
    bytes: int
    sha256: str
    verdict: str
    reasons: list[str]
    shot_seeds: list[int]


@dataclass
class AdView:
    ad_id: int
    client_id: str | None
    line: int
    values: dict
    state: str
    version: int
    error: str | None
    formats: list[FormatView]
    shots: list[list[ShotJob]]  # by shot: the jobs rendering it (one per render size)
    history: list[dict] = field(default_factory=list)

    @property
    def open(self) -> bool:
        return self.state in OPEN_STATES


def _states(filter_name: str) -> tuple[str, ...] | None:
    if filter_name not in AD_FILTERS:
        raise ReviewError(f"ad filter {filter_name!r}: allowed {', '.join(AD_FILTERS)}")
    if filter_name == "all":
        return None
    return OPEN_STATES if filter_name == "open" else (filter_name,)


def is_ad_batch(db: Database, batch_id: str) -> bool:
    with db.session() as s:
        batch = s.get(Batch, batch_id)
        if batch is None:
            raise ReviewError(f"batch {batch_id!r}: no such batch")
        return batch.ad_template is not None


def formats_of(ad: Ad) -> list[FormatView]:
    out = []
    for name, f in ((ad.outputs or {}).get("formats") or {}).items():
        seeds = [u["seed"] for u in sorted(f.get("shots", []), key=lambda u: u["shot"])]
        out.append(FormatView(name, f["width"], f["height"], f["seconds"], f["bytes"], f["sha256"],
                              f["qc"]["verdict"], f["qc"]["reasons"], seeds))
    return out


AD_PER_PAGE = 24


def counts(db: Database, batch_id: str) -> dict[str, int]:
    """How many of the batch's ads each filter shows."""
    with db.session() as s:
        by_state = dict(s.execute(select(Ad.state, func.count()).where(Ad.batch_id == batch_id).group_by(Ad.state)).all())
    out = {}
    for f in AD_FILTERS:
        states = _states(f)
        out[f] = sum(by_state.values()) if states is None else sum(by_state.get(st, 0) for st in states)
    return out


def ads(db: Database, batch_id: str, filter_name: str = "all", page: int = 1, per: int | None = None) -> list[AdView]:
    """The ads of a batch in the filter's states (one page of ``per``, or all), with their
    formats, shots and decisions."""
    states = _states(filter_name)
    if page < 1:
        raise ReviewError(f"page {page}: pages start at 1")
    is_ad_batch(db, batch_id)
    with db.session() as s:
        q = select(Ad).where(Ad.batch_id == batch_id)
        if states is not None:
            q = q.where(Ad.state.in_(states))
        q = q.order_by(Ad.id)
        if per is not None:
            q = q.limit(per).offset((page - 1) * per)
        rows = s.scalars(q).all()
        ids = [a.id for a in rows]
        jobs: dict[int, list[Job]] = {}
        for j in s.scalars(select(Job).where(Job.ad_id.in_(ids)).order_by(Job.shot, Job.id)):
            jobs.setdefault(j.ad_id, []).append(j)
        atts: dict[int, list[Attempt]] = {}
        job_ids = [j.id for js in jobs.values() for j in js]
        for a in s.scalars(select(Attempt).where(Attempt.job_id.in_(job_ids)).order_by(Attempt.number)):
            atts.setdefault(a.job_id, []).append(a)
        decs: dict[int, list[AdDecision]] = {}
        for d in s.scalars(select(AdDecision).where(AdDecision.ad_id.in_(ids)).order_by(AdDecision.id)):
            decs.setdefault(d.ad_id, []).append(d)
    out = []
    for ad in rows:
        shots: dict[int, list[ShotJob]] = {}
        for j in jobs.get(ad.id, []):
            a = shown_attempt(atts.get(j.id, []))
            shots.setdefault(j.shot, []).append(ShotJob(
                j.id, j.state, j.width, j.height, list(j.formats or []), len(atts.get(j.id, [])),
                a.number if a else None, a.seed if a else None, a.tier if a else j.tier, a.verdict if a else None,
                (a.reasons or []) if a else [], (a.qc_metrics or {}) if a else {}, bool(a and a.clip_key), j.prompt))
        history = [{"decision": d.decision, "operator": d.operator, "note": d.note, "override": d.override,
                    "shot": d.shot, "at": d.created_at.isoformat(timespec="seconds")} for d in decs.get(ad.id, [])]
        out.append(AdView(ad.id, ad.client_id, ad.line, ad.values, ad.state, ad.version, ad.error, formats_of(ad),
                          [shots[k] for k in sorted(shots)], history))
    return out


def _locked_ad(s, ad_id: int, version: int) -> Ad:
    ad = s.get(Ad, ad_id)
    if ad is None:
        raise ReviewError(f"ad {ad_id}: no such ad")
    if ad.version != version:
        last = s.scalars(select(AdDecision).where(AdDecision.ad_id == ad_id).order_by(AdDecision.id.desc())).first()
        who = f" by {last.operator} at {hm(last.created_at)}" if last else ""
        raise DecisionConflict(f"ad {ad_id} changed since you loaded it: it is now {ad.state}{who}; reload to see it")
    return ad


def _cas(s, ad: Ad, **values) -> None:
    res = s.execute(update(Ad).where(Ad.id == ad.id, Ad.version == ad.version)
                    .values(version=Ad.version + 1, updated_at=now(), **values))
    if res.rowcount != 1:
        raise DecisionConflict(f"ad {ad.id} changed since you loaded it; reload to see it")


def decide_ad(db: Database, ad_id: int, version: int, decision: str, note: str = "", operator: str = "") -> dict:
    """Approve or decline ``ad_id`` if it is still at ``version``; returns its new state."""
    if decision not in AD_DECISIONS:
        raise ReviewError(f"decision {decision!r}: allowed approve, decline")
    note, operator = clean_note(note, operator)
    dst = AD_DECISIONS[decision]
    with db.session() as s, s.begin():
        ad = _locked_ad(s, ad_id, version)
        if ad.state == dst:
            return {"ad": ad_id, "state": ad.state, "version": ad.version}
        if dst not in AD_MOVES.get(ad.state, ()):
            raise ReviewError(f"ad {ad_id} is {ad.state}; only assembled, rejected or decided ads can be "
                              f"{dst}" + (" (it is still being made)" if ad.state in OPEN_STATES else ""))
        if dst == "approved" and not formats_of(ad):
            raise ReviewError(f"ad {ad_id} has no assembled files to approve ({ad.error or 'none were made'})")
        src = ad.state
        _cas(s, ad, state=dst)  # (the session's copy of the ad follows the update)
        s.add(AdDecision(ad_id=ad_id, decision=dst, from_state=src, override=src == "rejected" and dst == "approved",
                         note=note, operator=operator))
    return {"ad": ad_id, "state": dst, "version": version + 1}


def rerender_shot(db: Database, ad_id: int, shot: int, version: int, note: str = "", operator: str = "") -> dict:
    """Queue shot ``shot`` of ``ad_id`` again (every job rendering it; each next attempt has a
    new seed) and send the ad back to ``waiting``, if the ad is still at ``version``. Returns
    the ad's new state and version and the jobs queued."""
    note, operator = clean_note(note, operator)
    with db.session() as s, s.begin():
        ad = _locked_ad(s, ad_id, version)
        if ad.state not in RERENDER_FROM:
            raise ReviewError(f"ad {ad_id} is {ad.state}; a shot can be re-rendered once the ad is assembled or "
                              "decided")
        jobs = s.scalars(select(Job).where(Job.ad_id == ad_id, Job.shot == shot).order_by(Job.id)).all()
        if not jobs:
            n = s.scalar(select(Job.shot).where(Job.ad_id == ad_id).order_by(Job.shot.desc()).limit(1))
            raise ReviewError(f"shot {shot}: ad {ad_id} has shots 0 to {n}")
        for j in jobs:
            src = JobState(j.state)
            if src not in RERENDER_JOBS:
                raise DecisionConflict(f"shot {shot} of ad {ad_id} is already {src.value} (job {j.id}); reload to see it")
            try:
                move_job(s, j.id, src, JobState.QUEUED, error=None, enqueued_at=None, lease_owner=None,
                         lease_expires_at=None)
            except MoveConflict:
                raise DecisionConflict(f"job {j.id} of ad {ad_id} changed meanwhile; reload to see it")
        src = ad.state
        _cas(s, ad, state="waiting", error=None)
        ids = [j.id for j in jobs]
        s.add(AdDecision(ad_id=ad_id, decision="rerender", from_state=src, shot=shot, jobs=ids, note=note,
                         operator=operator))
        batch_id = ad.batch_id
    return {"ad": ad_id, "state": "waiting", "version": version + 1, "jobs": ids, "batch": batch_id}


def states(db: Database, batch_id: str) -> list[dict]:
    """Each ad's state and version: what the ad page polls while an ad is made again."""
    is_ad_batch(db, batch_id)
    with db.session() as s:
        return [{"ad": i, "state": st, "version": v} for i, st, v in
                s.execute(select(Ad.id, Ad.state, Ad.version).where(Ad.batch_id == batch_id).order_by(Ad.id))]


def ad_media_key(db: Database, ad_id: int, fmt: str, kind: str) -> tuple[str, str] | None:
    """(storage root, key) of an ad format's video or poster, from the ad's recorded outputs."""
    if kind not in ("clip", "poster"):
        return None
    with db.session() as s:
        row = s.execute(select(Ad, Batch).join(Batch, Ad.batch_id == Batch.id).where(Ad.id == ad_id)).first()
    if row is None:
        return None
    ad, batch = row
    f = ((ad.outputs or {}).get("formats") or {}).get(fmt)
    if f is None:
        return None
    return batch.out, f["file"] if kind == "clip" else f["poster"]
