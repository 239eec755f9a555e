"""Job and attempt states, and every legal move between them. The one place they are defined.

A move is a compare-and-set: ``UPDATE ... SET state = :to WHERE id = :id AND state = :from``.
If another process moved the row first, no row matches and the move fails with ``MoveConflict``,
so two processes can never both take the same job.
"""

from __future__ import annotations

import enum

from sqlalchemy import update
from sqlalchemy.orm import Session

from clipmill.jobs.core.models import Attempt, Job


class JobState(str, enum.Enum):
    QUEUED = "queued"  # waiting for a render worker
    RENDERING = "rendering"  # claimed by a worker, which holds a lease
    POST = "post"  # rendered; interpolation, encoding, QC and storage pending
    PASSED = "passed"  # QC passed; waits for an operator
    REJECTED = "rejected"  # QC rejected its last attempt
    FAILED = "failed"  # an error, out of attempts
    CANCELLED = "cancelled"
    APPROVED = "approved"  # an operator approved it for delivery
    DECLINED = "declined"  # an operator declined it, with a note


class AttemptState(str, enum.Enum):
    RENDERING = "rendering"
    RENDERED = "rendered"  # raw frames stored, post-processing pending
    PASSED = "passed"
    REJECTED = "rejected"
    FAILED = "failed"  # error, or abandoned when its worker's lease expired


JOB_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RENDERING, JobState.CANCELLED}),
    # back to QUEUED: render error with attempts left, or an expired lease
    JobState.RENDERING: frozenset({JobState.POST, JobState.QUEUED, JobState.FAILED, JobState.CANCELLED}),
    # back to QUEUED: post-processing error with attempts left, or a QC retry
    JobState.POST: frozenset(
        {JobState.PASSED, JobState.REJECTED, JobState.FAILED, JobState.QUEUED, JobState.CANCELLED}
    ),
    # back to QUEUED (from here and from approved/declined): an operator re-rendering an ad's
    # shot with a new seed (review.ads)
    JobState.PASSED: frozenset({JobState.APPROVED, JobState.DECLINED, JobState.QUEUED}),
    # an explicit retry, or an operator rescuing a false reject (recorded as an override)
    JobState.REJECTED: frozenset({JobState.QUEUED, JobState.APPROVED, JobState.DECLINED}),
    JobState.APPROVED: frozenset({JobState.DECLINED, JobState.QUEUED}),  # an operator changing a decision
    JobState.DECLINED: frozenset({JobState.APPROVED, JobState.QUEUED}),
    JobState.FAILED: frozenset({JobState.QUEUED}),  # an explicit retry
    JobState.CANCELLED: frozenset({JobState.QUEUED}),
}

ATTEMPT_MOVES: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.RENDERING: frozenset({AttemptState.RENDERED, AttemptState.FAILED}),
    AttemptState.RENDERED: frozenset({AttemptState.PASSED, AttemptState.REJECTED, AttemptState.FAILED}),
    AttemptState.PASSED: frozenset(),
    AttemptState.REJECTED: frozenset(),
    AttemptState.FAILED: frozenset(),
}

class IllegalMove(ValueError):
    """A move that the state table does not allow."""


class MoveConflict(RuntimeError):
    """The row was not in the expected state: another process moved it first."""


def _check(table: dict, src, dst, what: str) -> None:
    if dst not in table[src]:
        allowed = ", ".join(sorted(s.value for s in table[src])) or "none (final)"
        raise IllegalMove(f"{what}: {src.value} -> {dst.value} is not a legal move; from {src.value}: {allowed}")


def move_job(
    session: Session, job_id: int, src: JobState, dst: JobState, *, version: int | None = None, **values
) -> None:
    """Compare-and-set a job from ``src`` to ``dst``, with other column ``values``.

    With ``version``, the row must also still be at that version (nobody touched it since).
    """
    _check(JOB_MOVES, src, dst, f"job {job_id}")
    cond = [Job.id == job_id, Job.state == src.value]
    if version is not None:
        cond.append(Job.version == version)
    res = session.execute(
        update(Job)
        .where(*cond)
        .values(state=dst.value, version=Job.version + 1, **values)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:
        raise MoveConflict(
            f"job {job_id}: not in state {src.value}"
            + (f" at version {version}" if version is not None else "")
            + "; another process moved it"
        )


def move_attempt(session: Session, attempt_id: int, src: AttemptState, dst: AttemptState, **values) -> None:
    _check(ATTEMPT_MOVES, src, dst, f"attempt {attempt_id}")
    res = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.state == src.value)
        .values(state=dst.value, **values)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:
        raise MoveConflict(f"attempt {attempt_id}: not in state {src.value}; another process moved it")
