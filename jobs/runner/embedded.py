"""The embedded default: render, post-process and check a batch in one process, no broker.

Rendering runs on the calling thread; post-processing of one group runs on a second thread
while the next group renders. Both call the same stage functions a Celery worker calls, and a
group's leases are kept alive by the same heartbeat (core.queue.Heartbeat) while it renders.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol

from clipmill.jobs.core.operations import release
from clipmill.jobs.core.batches import run_counts
from clipmill.jobs.core.queue import DEFAULT_LEASE_S, Heartbeat, claim_group, pending_post, reclaim, worker_name
from clipmill.jobs.runner.stages import WorkerContext, post_attempt, render_group


class Events(Protocol):
    def group_started(self, size: int, steps: int) -> None: ...
    def step(self, done: int, total: int) -> None: ...
    def rendered(self, n: int) -> None: ...
    def checked(self, verdict: str | None) -> None: ...
    def waiting(self, held: int) -> None: ...


@dataclass
class RunStats:
    groups: int = 0
    rendered: int = 0
    checked: int = 0
    reclaimed: list[int] = field(default_factory=list)
    wall_s: float = 0.0


class _Quiet:
    def group_started(self, size, steps): pass
    def step(self, done, total): pass
    def rendered(self, n): pass
    def checked(self, verdict): pass
    def waiting(self, held): pass


def run_batch(
    ctx: WorkerContext,
    batch_id: str | None,
    group_size: int = 4,
    events: Events | None = None,
    before_group: Callable[[], bool] | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    poll_s: float = 2.0,
) -> RunStats:
    """Work a batch (every batch if None) until no job of it is queued, rendering or waiting
    for post-processing. ``before_group()`` runs before each claim; returning False stops
    rendering (post-processing of what was rendered still finishes). A group holds leases of
    ``lease_s`` seconds, renewed every third of that while it renders.

    With a batch named, jobs of it that another worker holds (a second run, a farm worker) are
    waited for, polling every ``poll_s`` seconds: their QC retries are claimed here, and what a
    worker that died leaves behind is taken back once its lease is lost. Every batch (None) is
    an open set: its run ends when it finds nothing to claim."""
    if not 1 <= group_size <= 16:
        raise ValueError(f"group_size={group_size}: allowed 1 to 16")
    ev = events or _Quiet()
    stats = RunStats()
    t0 = time.perf_counter()
    me = worker_name()
    stats.reclaimed = reclaim(ctx.db, batch_id)  # jobs left behind by a crashed run
    futures: list[Future] = []

    def post(attempt_id: int) -> None:
        ev.checked(post_attempt(ctx, attempt_id))

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clipmill-post")
    claimed = []
    try:
        for attempt_id in pending_post(ctx.db, batch_id):  # rendered before a crash, not yet checked
            futures.append(pool.submit(post, attempt_id))
        while True:
            claimed = []
            if before_group is not None and not before_group():
                break
            claimed = claim_group(ctx.db, me, batch_id, group_size, lease_s)
            if not claimed:
                running = [f for f in futures if not f.done()]
                if running:
                    wait(running, return_when=FIRST_COMPLETED)  # a QC reject may queue a retry
                    continue
                # nothing to claim and nothing of this run's in flight: what is still open is another worker's
                if batch_id is None or not (held := run_counts(ctx.db, batch_id)["open"]):
                    break
                ev.waiting(held)
                time.sleep(poll_s)
                stats.reclaimed += reclaim(ctx.db, batch_id)  # a holder that died: its lease is lost
                for attempt_id in pending_post(ctx.db, batch_id):
                    # returns at once while another live worker holds the post lease; a lost one is taken here
                    if (verdict := post_attempt(ctx, attempt_id)) is not None:
                        ev.checked(verdict)
                continue
            stats.groups += 1
            ev.group_started(len(claimed), claimed[0].steps)
            with Heartbeat(ctx.db, [c.job_id for c in claimed], me, lease_s):
                done = render_group(ctx, [c.attempt_id for c in claimed], ev.step)
            stats.rendered += len(done)
            ev.rendered(len(claimed))
            for attempt_id in done:
                futures.append(pool.submit(post, attempt_id))
        for f in futures:
            f.result()
    except (KeyboardInterrupt, SystemExit):
        # An operator's interrupt (Ctrl-C; SIGTERM where the CLI turns it into one) is no fault of
        # the jobs: the group being rendered goes back to queued with its attempts unspent, not
        # left to be taken back later as lost. Clips rendered but not yet checked keep their
        # stored frames and are checked by the next run; the one being checked now finishes.
        release(ctx.db, [c.attempt_id for c in claimed])
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    stats.checked = len(futures)
    stats.wall_s = time.perf_counter() - t0
    return stats
