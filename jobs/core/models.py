"""The job table: batches, jobs and attempts (SQLAlchemy 2 typed ORM)."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(80), primary_key=True)
    source: Mapped[str] = mapped_column(Text)  # the file it came from
    model: Mapped[str] = mapped_column(Text)  # 'tiny' or a model folder
    sampler: Mapped[str] = mapped_column(String(20))
    guidance: Mapped[float] = mapped_column(Float, default=1.0)
    out: Mapped[str] = mapped_column(Text)  # storage root
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=2)  # attempts that render or QC can use up
    # attempts lost with their worker (killed, lease expired) do not count against max_attempts;
    # a job that loses this many is failed (a poison job that kills its worker)
    max_lost: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    template: Mapped[str | None] = mapped_column(Text, nullable=True)
    ad_template: Mapped[str | None] = mapped_column(Text, nullable=True)  # an ad batch's template file
    # as it was at submit: its TOML, and {file as the template names it, filled: its copy's storage key}
    ad_template_text: Mapped[str | None] = mapped_column(Text, nullable=True)
    ad_assets: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # the batch-finished callback (core.notify): where to POST, when it was taken, why it failed
    notify_url: Mapped[str | None] = mapped_column(Text, nullable=True)
    notified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    notify_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    jobs: Mapped[list[Job]] = relationship(back_populates="batch", order_by="Job.id")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("batch_id", "client_id", name="uq_jobs_batch_client"),
        Index("ix_jobs_batch_state", "batch_id", "state"),
        Index("ix_jobs_batch_margin", "batch_id", "qc_margin"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    line: Mapped[int] = mapped_column(Integer)  # line in the source file
    client_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    prompt_raw: Mapped[str] = mapped_column(Text)
    prompt: Mapped[str] = mapped_column(Text)  # cleaned
    negative_prompt: Mapped[str] = mapped_column(Text, default="")
    elements: Mapped[dict] = mapped_column(JSON, default=dict)  # subject/action/scene/camera
    seed: Mapped[int] = mapped_column(BigInteger)
    tier: Mapped[str] = mapped_column(String(16))  # the tier its next attempt renders at
    tier_requested: Mapped[str | None] = mapped_column(String(16), nullable=True)  # what the batch file asked for
    frames: Mapped[int] = mapped_column(Integer)
    fps: Mapped[int] = mapped_column(Integer)
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16), default="queued")
    version: Mapped[int] = mapped_column(Integer, default=0)  # bumped by every move
    attempts_made: Mapped[int] = mapped_column(Integer, default=0)  # every claim: attempts are numbered by it
    attempts_lost: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # of those, lost with their worker
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)  # farm: its stage's message (render, then post) sent at
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # an ad's shot: the ad, the shot's place in it and the formats made from this footage
    ad_id: Mapped[int | None] = mapped_column(ForeignKey("ads.id", ondelete="CASCADE"), nullable=True, index=True)
    shot: Mapped[int | None] = mapped_column(Integer, nullable=True)
    formats: Mapped[list | None] = mapped_column(JSON, nullable=True)
    # the review page's risk order (qc.margin), from the shown attempt's QC; see migration 0010
    qc_margin: Mapped[float | None] = mapped_column(Float, nullable=True)
    qc_near: Mapped[str | None] = mapped_column(String(24), nullable=True)
    qc_kinds: Mapped[str | None] = mapped_column(String(200), nullable=True)  # ",boiling,flicker,"
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)

    batch: Mapped[Batch] = relationship(back_populates="jobs")
    attempts: Mapped[list[Attempt]] = relationship(back_populates="job", order_by="Attempt.number")


# the claim order: queued jobs by priority, highest first, then oldest first (the DESC lets
# PostgreSQL walk the index and stop at the first unlocked row instead of sorting every queued job)
Index("ix_jobs_state_priority_desc", Job.state, Job.priority.desc(), Job.id)


class Attempt(Base):
    """One render try of a job, and what became of it."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
        Index("ix_attempts_state", "state"),  # open attempts (rendering, rendered) among many final ones
        Index("ix_attempts_started_at", "started_at"),  # the nightly run's groups since it started
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)  # 1, 2, ...
    state: Mapped[str] = mapped_column(String(16), default="rendering")
    tier: Mapped[str] = mapped_column(String(16))
    steps: Mapped[int] = mapped_column(Integer)
    seed: Mapped[int] = mapped_column(BigInteger)
    model: Mapped[str] = mapped_column(Text)
    sampler: Mapped[str] = mapped_column(String(20))
    guidance: Mapped[float] = mapped_column(Float)
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    group_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    group_size: Mapped[int | None] = mapped_column(Integer, nullable=True)
    timings: Mapped[dict] = mapped_column(JSON, default=dict)
    qc_metrics: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # prompts in the shapes grammar: {"asked": {...}, "read": {...}, "match": {attribute: bool}}
    adherence: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    verdict: Mapped[str | None] = mapped_column(String(16), nullable=True)
    reasons: Mapped[list | None] = mapped_column(JSON, nullable=True)
    raw_key: Mapped[str | None] = mapped_column(Text, nullable=True)  # rendered frames, until post
    clip_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    poster_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    sidecar_key: Mapped[str | None] = mapped_column(Text, nullable=True)
    location: Mapped[str | None] = mapped_column(Text, nullable=True)  # the clip's path or URL
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    job: Mapped[Job] = relationship(back_populates="attempts")


# what one attempt may write, under ``{batch}/{job}/a{n}``: raw frames (render, until post),
# then the clip, poster, sidecar and contact sheet (post)
ATTEMPT_SUFFIXES = (".frames.npy", ".mp4", ".jpg", ".json", ".sheet.png")


def attempt_key(job: Job, attempt: Attempt, suffix: str) -> str:
    """The storage key of one of an attempt's files, e.g. ``BATCH/JOB/a2.mp4``."""
    return f"{job.batch_id}/{job.id}/a{attempt.number}{suffix}"


def attempt_keys(job: Job, attempt: Attempt) -> list[str]:
    """Every storage key an attempt may have written (see ATTEMPT_SUFFIXES)."""
    return [attempt_key(job, attempt, suffix) for suffix in ATTEMPT_SUFFIXES]


class Ad(Base):
    """One row of an ad batch: its placeholder values, and what its assembly made.

    States: ``waiting`` (for its shots), ``assembling`` (a worker holds its lease), ``done`` (every
    format written and checked: ``outputs``), ``rejected`` (a shot ran out of attempts, or the
    ad-level QC refused a format: ``error``), ``failed`` (assembly raised: ``error``), and an
    operator's ``approved`` or ``declined`` (review.ads; a shot re-rendered sends it back to
    ``waiting``)."""

    __tablename__ = "ads"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)
    line: Mapped[int] = mapped_column(Integer)
    client_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    values: Mapped[dict] = mapped_column(JSON, default=dict)
    seed: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16), default="waiting")
    version: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(200), nullable=True)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    outputs: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # format -> file, bytes, seconds, qc
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class Decision(Base):
    """An operator's decision on a job; every one is kept, overrides of QC included."""

    __tablename__ = "decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id", ondelete="SET NULL"), nullable=True)
    decision: Mapped[str] = mapped_column(String(16))  # approved | declined
    from_state: Mapped[str] = mapped_column(String(16))
    override: Mapped[bool] = mapped_column(default=False)  # True when it overrules QC's reject
    note: Mapped[str] = mapped_column(Text, default="")
    operator: Mapped[str] = mapped_column(String(120))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AdDecision(Base):
    """An operator's decision on an ad (approved, declined, or ``rerender`` of one shot with a
    new seed); every one is kept."""

    __tablename__ = "ad_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    ad_id: Mapped[int] = mapped_column(ForeignKey("ads.id", ondelete="CASCADE"), index=True)
    decision: Mapped[str] = mapped_column(String(16))  # approved | declined | rerender
    from_state: Mapped[str] = mapped_column(String(16))
    override: Mapped[bool] = mapped_column(default=False)  # approving an ad the ad-level QC rejected
    shot: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the shot re-rendered
    jobs: Mapped[list | None] = mapped_column(JSON, nullable=True)  # its jobs, queued again
    note: Mapped[str] = mapped_column(Text, default="")
    operator: Mapped[str] = mapped_column(String(120))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


PREVIEW_SEEN_EVERY_S = 10.0  # a streaming preview's row is marked seen (seen_at) this often


class PreviewSession(Base):
    """One streaming preview: the render time it took (started to ended, on ``worker``) is what
    the nightly scheduler counts as taken from the render workers (jobs.farm.nightly)."""

    __tablename__ = "preview_sessions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    mode: Mapped[str] = mapped_column(String(16))  # embedded (the review server's process) | farm
    worker: Mapped[str | None] = mapped_column(String(200), nullable=True)
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True, index=True)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # when its worker last showed it streaming (renewed every PREVIEW_SEEN_EVERY_S): a row a dead worker
    # left open counts up to shortly after this (jobs.farm.nightly.preview_seconds)
    seen_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    frames: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    ended: Mapped[str | None] = mapped_column(String(200), nullable=True)  # why: closed, time limit, error
