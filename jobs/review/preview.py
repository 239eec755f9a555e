"""The streaming preview behind the review server's /preview page and `clipmill preview`.

Embedded (no broker), one preview streams at a time in the review server's process (the model
is shared): a session holds a ``pipeline.stream.StreamBatch`` and a
``pipeline.adaptive.FrameScheduler`` that sets the steps of every call from the measured frame
times. The page steers the prompt of the running session, and can queue it (prompt, seed, tier)
as a one-job batch. A session ends when its page goes away, or after ``max_s`` seconds
(``CLIPMILL_PREVIEW_MAX``: a page left open does not stream all night; the page is told why):
the stream's hook comes off the model and the next preview may start. In farm mode the same session runs on a render worker
between its groups, and its frames come to the page through Redis (``jobs.farm.preview``).

Every preview is kept in ``preview_sessions`` (when it started and ended, where, its frames):
the nightly scheduler counts that time as taken from the render workers.
"""

from __future__ import annotations

import base64
import csv
import io
import logging
import queue
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError

from clipmill.jobs.core.batches import SubmitOptions, submit
from clipmill.jobs.core.prompts import MAX_SEED
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import PREVIEW_SEEN_EVERY_S, PreviewSession, utcnow
from clipmill.jobs.core.queue import worker_name
from clipmill.pipeline.adaptive import AdaptiveConfig, FrameScheduler, PreviewTier
from clipmill.pipeline.stream import StreamBatch

# the preview's quality tiers for a 64 x 64 model (it draws well at its own size only): the
# steps each frame gets, and the batch tier "queue this" asks for
log = logging.getLogger("clipmill.preview")

PREVIEW_TIERS = (PreviewTier("quality", 64, 4, 8), PreviewTier("fast", 64, 2, 4), PreviewTier("draft", 64, 1, 2))
BATCH_TIER = {"quality": "quality", "fast": "fast", "draft": "fast"}
MAX_PROMPT = 500


class PreviewError(ValueError):
    pass


@dataclass
class Session:
    id: str
    stream: StreamBatch
    scheduler: FrameScheduler | None  # None: every call at the stream's own steps (fixed)
    seed: int
    frames: int = 0
    pending_prompt: str | None = None
    closed: bool = False
    ended: str | None = None  # why it ended, when not at its own page's request (the page is told)
    queued: dict | None = None  # what "Queue this" made of it (queue_once)
    max_s: float = 0.0  # it ends itself after this long (0: no limit; farm workers keep their own)
    seen: Callable[[], None] | None = None  # called as it streams (Seen: its row's seen_at)
    lock: threading.Lock = field(default_factory=threading.Lock)
    queue_lock: threading.Lock = field(default_factory=threading.Lock)  # apart: a submit never holds up a frame

    @property
    def prompt(self) -> str:
        return self.pending_prompt or self.stream.prompt

    def step(self) -> tuple[list, dict]:
        """One call of the stream at the steps the scheduler plans; the frames it finished and
        what the page shows about them."""
        with self.lock:
            if self.closed:
                return [], {}
            if self.pending_prompt is not None:
                self.stream.set_prompt(self.pending_prompt)
                self.pending_prompt = None
            plan = self.scheduler.plan() if self.scheduler is not None else None
            if plan is not None and plan.steps != self.stream.steps:
                self.stream.set_steps(plan.steps)
            t0 = time.perf_counter()
            out = self.stream.next()
            call_s = time.perf_counter() - t0
            if out and self.scheduler is not None:
                self.scheduler.record(call_s / len(out), self.stream.steps)
            self.frames += len(out)
            return out, {"steps": self.stream.steps, "tier": plan.tier.name if plan else PREVIEW_TIERS[0].name,
                         "call_ms": round(call_s * 1000, 1), "switched": bool(plan and plan.switched),
                         "drop": bool(plan and plan.drop), "reason": plan.reason if plan else "fixed steps"}

    def start(self) -> None:
        """Render ahead in a thread of its own into a small queue (one window of frames), so a
        call that finishes several frames at once does not stall their delivery at the budget."""
        self.frames_q: queue.Queue = queue.Queue(maxsize=self.stream.window)
        self.started = time.monotonic()
        self._producer = threading.Thread(target=self._produce, name=f"clipmill-preview-{self.id}", daemon=True)
        self._producer.start()

    def _produce(self) -> None:
        while not self.closed:
            if self.max_s and time.monotonic() - self.started > self.max_s:
                self.ended = self.ended or (f"its time on this review server is up ({self.max_s:g} s, "
                                            "CLIPMILL_PREVIEW_MAX); press Stream to start again")
                self.close()  # the page's stream sees it closed and says why (Session.ended)
                return
            if self.seen is not None:
                self.seen()
            try:
                frames, info = self.step()
            except Exception as e:  # noqa: BLE001 - the page is told, the session ends
                self.frames_q.put((None, {"error": f"{e.__class__.__name__}: {e}"}))
                return
            for f in frames:
                while not self.closed:
                    try:
                        self.frames_q.put((f, info), timeout=0.1)
                        break
                    except queue.Full:
                        continue

    def steer(self, prompt: str) -> None:
        """Follow ``prompt`` from the next call on, dropping the frames rendered ahead under the
        old one (so the new prompt shows sooner)."""
        self.pending_prompt = prompt
        self.flush()

    def flush(self) -> None:
        """Drop the frames rendered ahead under the old prompt (a steer shows the new one sooner)."""
        while True:
            try:
                self.frames_q.get_nowait()
            except queue.Empty:
                return

    def next_frame(self, timeout: float = 0.5):
        """The next rendered frame and what the page shows about it, or (None, {}) after
        ``timeout`` seconds without one."""
        try:
            return self.frames_q.get(timeout=timeout)
        except queue.Empty:
            return None, {}

    def next_payload(self, timeout: float = 0.5) -> tuple[dict | None, dict]:
        """The next frame as the page's ``frame`` event (see :func:`payload`), or None and why
        not (``{"error": ...}`` when the stream failed)."""
        f, info = self.next_frame(timeout)
        return (None, info) if f is None else (payload(f.index, f.prompt, jpeg(f.image), info), {})

    def describe(self) -> dict:
        return {"session": self.id, "prompt": self.prompt, "frames": self.frames, "steps": self.stream.steps,
                "tier": self.scheduler.tier.name if self.scheduler is not None else PREVIEW_TIERS[0].name}

    def close(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                self.stream.close()


def new_session(renderer, prompt: str, seed: int, budget_s: float, sid: str | None = None,
                max_s: float = 0.0) -> Session:
    """A started preview session of ``prompt`` on ``renderer`` at the frame-time budget, that
    ends itself after ``max_s`` seconds (0: no limit)."""
    sched = FrameScheduler(PREVIEW_TIERS, AdaptiveConfig(budget_s=budget_s))
    stream = StreamBatch(renderer, prompt, seed=seed, steps=PREVIEW_TIERS[0].min_steps)
    session = Session(sid or new_id(), stream, sched, seed, max_s=max_s)
    session.start()
    return session


def new_id() -> str:
    return secrets.token_urlsafe(9)


class SessionTable:
    """The preview sessions of a review server, by id (embedded or farm)."""

    sessions: dict

    @property
    def active(self) -> int:
        return sum(not s.closed for s in self.sessions.values())

    def get(self, sid: str):
        s = self.sessions.get(sid)
        if s is None or s.closed:
            raise PreviewError(f"preview {sid!r} is not streaming (closed, or replaced by a newer page); reload")
        return s

    def describe(self) -> list[dict]:
        return [s.describe() for s in self.sessions.values() if not s.closed]


class Previews(SessionTable):
    """The process's preview sessions (embedded mode): at most one streaming, the renderer
    loaded once, each for at most ``max_s`` seconds (``CLIPMILL_PREVIEW_MAX``; 0: no limit).
    ``db``: where the sessions are recorded (see the module)."""

    pace_s: float  # the review server sends frames at this interval (they are rendered ahead here)

    def __init__(self, make_renderer: Callable[[], object], model: str, out: str, budget_s: float = 0.125,
                 db: Database | None = None, max_s: float = 900.0):
        self._make_renderer = make_renderer
        self._renderer = None
        self.model, self.out = model, out  # what "Queue this" submits with
        self.budget_s = self.pace_s = budget_s
        self.max_s = max_s
        self.db = db
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, prompt: str, seed: int = 0) -> Session:
        prompt, seed = check_prompt(prompt), check_seed(seed)  # before the stream streaming now ends
        with self._lock:
            for s in list(self.sessions.values()):  # one stream at a time: the newest page wins
                self._end(s, "replaced by a newer page")
            self.sessions.clear()
            if self._renderer is None:
                self._renderer = self._make_renderer()
            session = new_session(self._renderer, prompt, seed, self.budget_s, max_s=self.max_s)
            self.sessions[session.id] = session
            if self.db is not None:
                record_open(self.db, session.id, self.model, "embedded", worker=worker_name())
                session.seen = Seen(self.db, session.id)
            return session

    def _end(self, s: Session, why: str) -> None:
        s.ended = s.ended or why  # a session that ended itself (its time limit) keeps its reason
        s.close()
        if self.db is not None:  # once: a row already ended keeps its end
            record_end(self.db, s.id, s.frames, s.ended)

    def close(self, sid: str, why: str = "the page closed") -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            self._end(s, why)

    def queue(self, db: Database, sid: str, tier: str) -> dict:
        """Queue the session's prompt, with its seed and ``tier``, as a one-job batch."""
        return queue_once(db, self.get(sid), tier, self.model, self.out)[0]

    def steer(self, sid: str, prompt: str) -> dict:
        s = self.get(sid)
        s.steer(check_prompt(prompt))
        return {"session": sid, "prompt": s.pending_prompt}


def check_seed(seed: int) -> int:
    if not 0 <= seed <= MAX_SEED:
        raise PreviewError(f"seed {seed}: allowed an integer from 0 to {MAX_SEED}")
    return seed


def check_prompt(prompt: str) -> str:
    prompt = (prompt or "").strip()
    if not prompt:
        raise PreviewError("prompt: empty; type what the clip should show")
    if len(prompt) > MAX_PROMPT:
        raise PreviewError(f"prompt: {len(prompt)} characters; at most {MAX_PROMPT}")
    return prompt


def payload(index: int, prompt: str, jpeg_bytes: bytes, info: dict) -> dict:
    """A frame as the page's ``frame`` event: its index, the prompt it was made under, the JPEG
    (base64) and what the scheduler did (steps, tier, call time, switches, drops)."""
    return {"index": index, "prompt": prompt, "jpeg": base64.b64encode(jpeg_bytes).decode(), **info}


def record_open(db: Database, sid: str, model: str, mode: str, worker: str | None = None) -> None:
    """A preview asked for; with ``worker``, started there now."""
    now = utcnow() if worker else None
    with db.session() as s, s.begin():
        s.add(PreviewSession(id=sid, model=model, mode=mode, worker=worker, started_at=now, seen_at=now))


def record_start(db: Database, sid: str, worker: str) -> None:
    with db.session() as s, s.begin():
        row = s.get(PreviewSession, sid)
        if row is not None:
            row.worker, row.started_at = worker, utcnow()
            row.seen_at = row.started_at


class Seen:
    """Marks a streaming preview's row seen (``seen_at``) at most every ``PREVIEW_SEEN_EVERY_S``: call
    it as the stream goes. A row whose worker died stops being renewed, and the nightly
    scheduler stops counting it soon after (``jobs.farm.nightly.preview_seconds``). A database
    that cannot be reached is logged, not raised: the page's stream goes on."""

    def __init__(self, db: Database | None, sid: str, every_s: float = PREVIEW_SEEN_EVERY_S):
        self.db, self.sid, self.every_s = db, sid, every_s
        self.last: float | None = None  # the first call marks it (a model may have loaded since the start)

    def __call__(self) -> None:
        if self.db is None or self.last is not None and time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        try:
            with self.db.session() as s, s.begin():
                s.execute(update(PreviewSession).where(PreviewSession.id == self.sid,
                                                       PreviewSession.ended_at.is_(None)).values(seen_at=utcnow()))
        except SQLAlchemyError as e:
            log.warning("preview %s: could not mark its row seen (%s)", self.sid, e)


def record_end(db: Database, sid: str, frames: int, why: str) -> None:
    with db.session() as s, s.begin():
        row = s.get(PreviewSession, sid)
        if row is not None and row.ended_at is None:
            row.ended_at, row.frames, row.ended = utcnow(), frames, why[:200]


def record_unserved(db: Database, sid: str, why: str) -> bool:
    """End the row of a preview that no worker started (its page went while it waited: a row
    left open by a review server that died); whether it did. A started row is its worker's to end."""
    with db.session() as s, s.begin():
        row = s.get(PreviewSession, sid)
        if row is None or row.started_at is not None or row.ended_at is not None:
            return False
        row.ended_at, row.ended = utcnow(), why[:200]
        return True


def jpeg(image: np.ndarray, side: int = 256) -> bytes:
    """A frame as JPEG, scaled up (nearest) for the page."""
    import cv2

    big = cv2.resize(image, (side, side), interpolation=cv2.INTER_NEAREST)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(big, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 85])
    return buf.tobytes()


def queue_once(db: Database, s, tier: str, model: str, out: str) -> tuple[dict, bool]:
    """What "Queue this" makes of session ``s`` (embedded or farm): its prompt, seed and ``tier``
    as a one-job batch, once per prompt and tier (a double click answers the same batch); and
    whether it was made now."""
    with s.queue_lock:
        if s.queued is not None and (s.queued["prompt"], s.queued["tier"]) == (s.prompt, BATCH_TIER.get(tier)):
            return s.queued, False
        s.queued = queue_prompt(db, s.prompt, s.seed, tier, model, out)
        return s.queued, True


def queue_prompt(db: Database, prompt: str, seed: int, tier: str, model: str, out: str) -> dict:
    """Queue a previewed prompt as a one-job batch (its seed and the batch tier of the preview
    tier), through the same row checks as any batch file."""
    if tier not in BATCH_TIER:
        raise PreviewError(f"tier {tier!r}: allowed {', '.join(BATCH_TIER)}")
    prompt = check_prompt(prompt)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["prompt", "seed", "tier"])
    w.writerow([prompt, seed, BATCH_TIER[tier]])
    with tempfile.TemporaryDirectory(prefix="clipmill-preview-") as tmp:
        path = Path(tmp) / "preview.csv"
        path.write_text(buf.getvalue(), encoding="utf-8")
        # the second's name and a random tail: two previews queued in one second are two batches
        name = f"preview-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        res = submit(db, path, SubmitOptions(model=model, out=out, batch=name))
    return {"batch": res.batch_id, "jobs": res.job_ids, "prompt": prompt, "seed": seed, "tier": BATCH_TIER[tier]}
