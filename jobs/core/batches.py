"""Submitting batches and reading their status: the Python API under the CLI."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from sqlalchemy import func, insert, select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Attempt, Batch, Job
from clipmill.jobs.core.preflight import BATCH_RE, BadOption, SetupProblem, check_defaults, check_model, check_submit_options
from clipmill.jobs.core.prompts import BatchFile, BatchInvalid, Defaults, read_batch
from clipmill.jobs.core.states import JobState
from clipmill.pipeline.models import BUILTIN_MODELS, ModelInfo, load_tokenizer, model_info

DISTILLED_MAX_GUIDANCE = 6.0


class SubmitError(BadOption):
    """A submit option that cannot be used, or a batch that does not exist."""


@dataclass
class SubmitOptions:
    model: str = "tiny"
    sampler: str | None = None  # None: what the model folder's scheduler says
    guidance: float = 1.0
    out: str = "clipmill-out"
    batch: str | None = None
    template: str | None = None
    truncate: bool = False
    skip_invalid: bool = False
    defaults: Defaults = field(default_factory=Defaults)
    priority: int = 0
    max_attempts: int = 2
    max_lost: int = 3  # attempts lost with their worker before the job is failed (see core.queue)
    notify: str | None = None  # the batch-finished callback's URL (core.notify)


@dataclass
class SubmitResult:
    batch_id: str | None
    file: BatchFile
    job_ids: list[int]


@lru_cache(maxsize=4)
def _token_counter(path: str):
    info = model_info(path)
    try:
        tok = load_tokenizer(info)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, ...
        raise SetupProblem(f"--model {path}: its tokenizer ({info.path / 'tokenizer'}) does not load "
                           f"({e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    return lambda text: len(tok(text, add_special_tokens=True, truncation=False).input_ids)


def check_file(path: str | Path, opts: SubmitOptions) -> tuple[ModelInfo, BatchFile]:
    """Check the options, then read and validate a batch file against the model; submits
    nothing. Raises BadOption (bad input) or SetupProblem (the model folder does not load)."""
    check_submit_options(opts)
    info = check_model(opts.model)
    check_defaults(opts.defaults, info)
    return info, read_batch(path, info, _token_counter(opts.model), opts.defaults, opts.template, opts.truncate)


def _batch_name(session, path: Path, wanted: str | None) -> str:
    if wanted is not None:
        if not BATCH_RE.match(wanted):
            raise SubmitError(
                f"--batch {wanted!r}: not a valid name; allowed: 1-80 letters, digits, '.', '_' or '-'"
            )
        if session.get(Batch, wanted) is not None:
            raise SubmitError(f"--batch {wanted!r}: a batch with that name exists; choose another name")
        return wanted
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-._")[:50] or "batch"
    base = f"{stem}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    name, n = base, 1
    while session.get(Batch, name) is not None:
        n += 1
        name = f"{base}-{n}"
    return name


def check_submission(path: str | Path, opts: SubmitOptions) -> tuple[ModelInfo, BatchFile]:
    """Everything ``submit`` checks before it writes, with no job table needed: the options,
    the model and the whole file. With errors and no ``skip_invalid``, raises ``BatchInvalid``;
    a bad option ``BadOption`` (SubmitError), a model folder that does not load
    ``SetupProblem`` (see core.preflight)."""
    if not 1 <= opts.max_lost <= 10:
        raise SubmitError(f"--max-lost {opts.max_lost}: out of range; allowed: 1 to 10")
    info, batch_file = check_file(path, opts)
    if opts.sampler is not None and info.family == "wan":
        raise SubmitError(f"--sampler {opts.sampler!r}: the wan model {opts.model!r} samples with 'flow' (flow-matching "
                          "Euler); leave --sampler out")
    if batch_file.errors and (not opts.skip_invalid or not batch_file.rows):
        raise BatchInvalid(batch_file)
    return info, batch_file


def submit(db: Database, path: str | Path, opts: SubmitOptions,
           checked: tuple[ModelInfo, BatchFile] | None = None) -> SubmitResult:
    """Validate the whole file (``check_submission``, unless ``checked`` is its result), then
    write the batch and its jobs in one transaction; with any problem, nothing is written."""
    info, batch_file = checked or check_submission(path, opts)
    with db.session() as session, session.begin():
        name = _batch_name(session, Path(path), opts.batch)
        session.add(
            Batch(
                id=name,
                source=str(path),
                model=opts.model if opts.model in BUILTIN_MODELS else str(Path(opts.model).expanduser().resolve()),
                sampler=opts.sampler or info.scheduler,
                guidance=opts.guidance,
                out=str(Path(opts.out).expanduser().resolve()) if "://" not in opts.out else opts.out,
                priority=opts.priority,
                max_attempts=opts.max_attempts,
                max_lost=opts.max_lost,
                template=opts.template,
                notify_url=opts.notify,
            )
        )
        session.flush()
        # one bulk INSERT (no ORM object per row, no RETURNING, which psycopg would have to parse
        # as one huge statement): 10,000 jobs are written in about half a second
        rows = [
            dict(
                batch_id=name,
                line=r.line,
                client_id=r.client_id,
                prompt_raw=r.prompt_raw,
                prompt=r.prompt,
                negative_prompt=r.negative_prompt,
                elements=r.elements,
                seed=r.seed,
                tier=r.tier,
                tier_requested=r.tier,
                frames=r.frames,
                fps=r.fps,
                width=r.width,
                height=r.height,
                priority=opts.priority,
                state=JobState.QUEUED.value,
            )
            for r in batch_file.rows
        ]
        session.execute(insert(Job), rows)
        # the batch is new, so its jobs are exactly these rows, in file order
        ids = list(session.scalars(select(Job.id).where(Job.batch_id == name).order_by(Job.line, Job.id)))
    return SubmitResult(name, batch_file, ids)


# -- status -------------------------------------------------------------------------------------


def list_batches(db: Database) -> list[dict]:
    """Every batch with its job counts by state, newest first."""
    with db.session() as s:
        counts: dict[str, dict[str, int]] = {}
        for batch_id, state, n in s.execute(
            select(Job.batch_id, Job.state, func.count()).group_by(Job.batch_id, Job.state)
        ):
            counts.setdefault(batch_id, {})[state] = n
        out = []
        for b in s.scalars(select(Batch).order_by(Batch.created_at.desc())):
            c = counts.get(b.id, {})
            out.append(
                {
                    "batch": b.id,
                    "source": b.source,
                    "model": b.model,
                    "created_at": b.created_at.isoformat(),
                    "out": b.out,
                    "jobs": sum(c.values()),
                    "states": {st.value: c.get(st.value, 0) for st in JobState},
                }
            )
        return out


OPEN_STATES = (JobState.QUEUED.value, JobState.RENDERING.value, JobState.POST.value)


def progress(n_jobs: int, n_open: int, first_started: datetime | None, last_finished: datetime | None = None) -> dict:
    """Done and open jobs, and an ETA from the batch's own pace so far (jobs done per second
    since its first attempt started). Once no job is open, the clock stops at the last
    attempt's end."""
    done = n_jobs - n_open
    eta = elapsed = None
    if first_started is not None:
        if first_started.tzinfo is None:
            first_started = first_started.replace(tzinfo=timezone.utc)
        end = datetime.now(timezone.utc)
        if not n_open and last_finished is not None:
            end = last_finished if last_finished.tzinfo else last_finished.replace(tzinfo=timezone.utc)
        elapsed = max(0.0, (end - first_started).total_seconds())
        if done and n_open and elapsed > 0:
            eta = n_open * elapsed / done
    return {"done": done, "open": n_open, "elapsed_s": round(elapsed, 1) if elapsed is not None else None,
            "eta_s": round(eta, 1) if eta is not None else None}


def _get_batch(s, batch_id: str) -> Batch:
    batch = s.get(Batch, batch_id)
    if batch is None:
        known = [b for b in s.scalars(select(Batch.id).order_by(Batch.created_at.desc()).limit(5))]
        raise SubmitError(
            f"batch {batch_id!r}: no such batch"
            + (f"; recent batches: {', '.join(known)}" if known else "; no batches yet")
        )
    return batch


def batch_summary(db: Database, batch_id: str) -> dict:
    """One batch's counts by state, progress and ETA, computed in the database (a few index
    scans, whatever the batch's size): what `clipmill status BATCH --watch` prints."""
    with db.session() as s:
        batch = _get_batch(s, batch_id)
        in_batch = Job.batch_id == batch_id
        counts = dict(s.execute(select(Job.state, func.count()).where(in_batch).group_by(Job.state)).all())
        passed_on_retry = s.scalar(select(func.count()).select_from(Job).where(
            in_batch, Job.state == JobState.PASSED.value, Job.attempts_made - Job.attempts_lost > 1))  # QC retries
        out_of_attempts = s.scalar(select(func.count()).select_from(Job).where(
            in_batch, Job.state.in_((JobState.REJECTED.value, JobState.FAILED.value)),
            Job.attempts_made - Job.attempts_lost >= batch.max_attempts))
        first_started, last_finished = s.execute(
            select(func.min(Attempt.started_at), func.max(Attempt.finished_at)).join(Job).where(in_batch)).one()
    n_jobs = sum(counts.values())
    return {
        "progress": progress(n_jobs, sum(counts.get(st, 0) for st in OPEN_STATES), first_started, last_finished),
        "max_attempts": batch.max_attempts,
        "max_lost": batch.max_lost,
        "passed_on_retry": passed_on_retry,
        "out_of_attempts": out_of_attempts,
        "batch": batch.id,
        "source": batch.source,
        "model": batch.model,
        "sampler": batch.sampler,
        "guidance": batch.guidance,
        "out": batch.out,
        "created_at": batch.created_at.isoformat(),
        "jobs": n_jobs,
        "states": {st.value: counts.get(st.value, 0) for st in JobState},
    }


def run_counts(db: Database, batch_id: str) -> dict:
    """What a run's progress shows: the batch's jobs, how many are done (in a final state) and
    open, and its renders (attempts), of which retries (attempts after the first)."""
    with db.session() as s:
        in_batch = Job.batch_id == batch_id
        counts = dict(s.execute(select(Job.state, func.count()).where(in_batch).group_by(Job.state)).all())
        renders, retries = s.execute(
            select(func.count(Attempt.id), func.count(Attempt.id).filter(Attempt.number > 1)).join(Job).where(in_batch)
        ).one()
    jobs = sum(counts.values())
    n_open = sum(counts.get(st, 0) for st in OPEN_STATES)
    return {"jobs": jobs, "done": jobs - n_open, "open": n_open, "renders": renders, "retries": retries}


def batch_status(db: Database, batch_id: str, limit: int | None = None) -> dict:
    """One batch: its summary (see batch_summary) and its jobs with their attempts, in job
    order; the first ``limit`` jobs only if given."""
    st = batch_summary(db, batch_id)
    with db.session() as s:
        q = select(Job.id, Job.client_id, Job.line, Job.state, Job.prompt, Job.prompt_raw, Job.seed, Job.tier,
                   Job.frames, Job.fps, Job.width, Job.height, Job.attempts_made, Job.attempts_lost, Job.error
                   ).where(Job.batch_id == batch_id).order_by(Job.id)
        jobs = s.execute(q if limit is None else q.limit(limit)).all()
        aq = (select(Attempt.job_id, Attempt.number, Attempt.state, Attempt.tier, Attempt.steps, Attempt.seed,
                     Attempt.verdict, Attempt.reasons, Attempt.location, Attempt.error, Attempt.group_size,
                     Attempt.timings, Attempt.adherence)
              .join(Job).where(Job.batch_id == batch_id).order_by(Attempt.job_id, Attempt.number))
        if limit is not None:
            aq = aq.where(Attempt.job_id <= (jobs[-1].id if jobs else -1))
        by_job: dict[int, list] = {}
        for a in s.execute(aq):
            by_job.setdefault(a.job_id, []).append(a)
    final_fail = (JobState.REJECTED.value, JobState.FAILED.value)
    rows = []
    for j in jobs:
        atts = by_job.get(j.id, [])
        last = atts[-1] if atts else None
        rows.append(
            {
                "job": j.id,
                "id": j.client_id,
                "line": j.line,
                "state": j.state,
                "prompt": j.prompt,
                "prompt_raw": j.prompt_raw,
                "seed": j.seed,
                "tier": j.tier,
                "frames": j.frames,
                "fps": j.fps,
                "size": f"{j.width}x{j.height}",
                "attempts": [
                    {
                        "number": a.number,
                        "state": a.state,
                        "tier": a.tier,
                        "steps": a.steps,
                        "seed": a.seed,
                        "verdict": a.verdict,
                        "reasons": a.reasons or [],
                        "location": a.location,
                        "error": a.error,
                        "group_size": a.group_size,
                        "timings": a.timings,
                        "adherence": a.adherence,
                    }
                    for a in atts
                ],
                "passed_on_retry": j.state == JobState.PASSED.value and len(atts) - j.attempts_lost > 1,  # QC retries
                "attempts_lost": j.attempts_lost,  # lost with their worker: not counted against max_attempts
                "out_of_attempts": j.state in final_fail and j.attempts_made - j.attempts_lost >= st["max_attempts"],
                "verdict": last.verdict if last else None,
                "reasons": (last.reasons or []) if last else [],
                "location": last.location if last else None,
                "adherence": last.adherence if last else None,
                "error": j.error,
            }
        )
    st["rows"] = rows
    return st
