"""The two stages of a clip, as functions of ids: render a group, post-process one attempt.

The embedded runner calls these in process; Celery tasks wrap the same functions. Each is safe
to run twice: a stage whose attempt already moved on does nothing, and every attempt writes
only under its own storage keys (``{batch}/{job}/a{n}.*``), so a rerun overwrites its own
files atomically and never duplicates a clip.
"""

from __future__ import annotations

import io
import json
import logging
import os
import tempfile
import time
import traceback
from datetime import datetime, timezone
from typing import Callable

import numpy as np
from sqlalchemy import select

from jobs.db import Database
from jobs.logs import ids
from jobs.models import Attempt, Batch, Job
from jobs.states import AttemptState, JobState, MoveConflict, move_attempt, move_job
from pipeline.models import model_info
from pipeline.render import ClipRequest, GroupSettings, Renderer, RenderOptions
from pipeline.interpolate import interpolate
from pipeline.video import decode, encode_h264, poster_jpeg
from qc import QCConfig, check_frames_with_series
from qc.report import contact_sheet
from storage import Storage, open_storage

log = logging.getLogger("clipmill.stages")
RETRY_TIER = "quality"  # a clip QC rejected is rendered again at this tier


def now() -> datetime:
    return datetime.now(timezone.utc)


class WorkerContext:
    """What a worker keeps between tasks: the database, warm models and storage backends."""

    def __init__(self, db: Database, device: str = "cpu", qc_config: QCConfig = QCConfig(),
                 render_options: RenderOptions | None = None, guidance_mode: str | None = None):
        self.db = db
        self.device = device
        self.qc_config = qc_config
        env_options, env_mode = render_setup_from_env()
        self.render_options = render_options or env_options
        self.guidance_mode = guidance_mode or env_mode
        self._renderer: tuple[str, Renderer] | None = None
        self._storages: dict[str, Storage] = {}

    def renderer(self, model: str) -> Renderer:
        """The renderer for ``model``, loaded once and kept warm (one model at a time)."""
        if self._renderer is None or self._renderer[0] != model:
            self._renderer = None  # drop the old model before loading the next
            self._renderer = (model, Renderer(model_info(model), device=self.device, options=self.render_options))
        return self._renderer[1]

    def storage(self, out: str) -> Storage:
        if out not in self._storages:
            self._storages[out] = open_storage(out)
        return self._storages[out]


def render_setup_from_env() -> tuple[RenderOptions, str]:
    """Render options from the environment (how `clipmill worker` hosts are configured):
    CLIPMILL_FEATURE_CACHE=1, CLIPMILL_DECODER=vae|tiny, CLIPMILL_COMPILE=none|torch|tensorrt,
    CLIPMILL_GUIDANCE_MODE=cfg|rcfg-self|rcfg-onetime. Unset: the defaults."""
    env = os.environ
    flag = env.get("CLIPMILL_FEATURE_CACHE", "0").strip().lower()
    if flag not in ("0", "1", "true", "false", "yes", "no", ""):
        raise ValueError(f"CLIPMILL_FEATURE_CACHE={flag!r}; allowed: 0 or 1")
    options = RenderOptions(
        feature_cache=flag in ("1", "true", "yes"),
        decoder=env.get("CLIPMILL_DECODER", "vae"),
        compile=env.get("CLIPMILL_COMPILE", "none"),
    )
    mode = env.get("CLIPMILL_GUIDANCE_MODE", "cfg")
    from pipeline.guidance import GUIDANCE_MODES

    if mode not in GUIDANCE_MODES:
        raise ValueError(f"CLIPMILL_GUIDANCE_MODE={mode!r}; allowed: {', '.join(GUIDANCE_MODES)}")
    return options, mode


def attempt_key(job: Job, attempt: Attempt, suffix: str) -> str:
    return f"{job.batch_id}/{job.id}/a{attempt.number}{suffix}"


def _fail(db: Database, attempt_id: int, error: str) -> None:
    """Mark an attempt failed; its job goes back to queued with attempts left, else to failed."""
    with db.session() as s, s.begin():
        a = s.get(Attempt, attempt_id)
        job = s.get(Job, a.job_id)
        batch = s.get(Batch, job.batch_id)
        src_attempt = AttemptState(a.state)
        if src_attempt not in (AttemptState.RENDERING, AttemptState.RENDERED):
            return
        move_attempt(s, a.id, src_attempt, AttemptState.FAILED, error=error[-4000:], finished_at=now())
        src = JobState(job.state)
        if src not in (JobState.RENDERING, JobState.POST):
            return
        retry = job.attempts_made < batch.max_attempts
        move_job(
            s, job.id, src, JobState.QUEUED if retry else JobState.FAILED,
            lease_owner=None, lease_expires_at=None, error=None if retry else error.splitlines()[-1][-500:],
        )


def render_group(
    ctx: WorkerContext,
    attempt_ids: list[int],
    callback: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Render the attempts of one claimed group; store raw frames; move them to post.

    Returns the ids of attempts now waiting for post-processing.
    """
    with ctx.db.session() as s:
        rows = s.execute(
            select(Attempt, Job, Batch)
            .join(Job, Attempt.job_id == Job.id)
            .join(Batch, Job.batch_id == Batch.id)
            .where(Attempt.id.in_(attempt_ids), Attempt.state == AttemptState.RENDERING.value)
            .order_by(Attempt.id)
        ).all()
    if not rows:
        return []
    _, _, batch = rows[0]
    first_attempt = rows[0][0]
    settings = GroupSettings(tier=first_attempt.tier, sampler=first_attempt.sampler, guidance=first_attempt.guidance,
                             guidance_mode=ctx.guidance_mode)
    requests = [
        ClipRequest(
            key=a.id, prompt=j.prompt, seed=a.seed, frames=j.frames, width=j.width, height=j.height,
            negative_prompt=j.negative_prompt,
        )
        for a, j, _ in rows
    ]
    for a, j, _ in rows:
        log.info("rendering %s steps at %s in a group of %s", a.steps, a.tier, len(rows),
                 extra=ids(j, a, group=a.group_id, worker=a.worker))
    try:
        renderer = ctx.renderer(batch.model)
        results = renderer.render(requests, settings, callback)
    except Exception:  # a render error fails every attempt in the group; jobs retry if they can
        err = traceback.format_exc()
        log.error("render failed: %s", err.splitlines()[-1], extra=ids(batch=batch.id, group=first_attempt.group_id))
        for a, _, _ in rows:
            _fail(ctx.db, a.id, err)
        return []

    storage = ctx.storage(batch.out)
    done = []
    for (a, j, _), res in zip(rows, results):
        buf = io.BytesIO()
        np.save(buf, res.frames, allow_pickle=False)
        raw_key = attempt_key(j, a, ".frames.npy")
        storage.put_bytes(raw_key, buf.getvalue())
        timings = dict(res.timings, fps_in=res.fps)
        try:
            with ctx.db.session() as s, s.begin():
                move_attempt(s, a.id, AttemptState.RENDERING, AttemptState.RENDERED, raw_key=raw_key, timings=timings)
                move_job(s, j.id, JobState.RENDERING, JobState.POST)
        except MoveConflict:
            # the lease was taken back (or the job cancelled) while we rendered: drop our frames
            log.warning("the job moved while rendering; result dropped", extra=ids(j, a))
            storage.delete(raw_key)
            try:
                with ctx.db.session() as s, s.begin():
                    move_attempt(s, a.id, AttemptState.RENDERING, AttemptState.FAILED, finished_at=now(),
                                 error="dropped: the job was cancelled or taken back while rendering")
            except MoveConflict:
                pass  # already closed by whoever took the job back
            continue
        done.append(a.id)
    return done


def sidecar(job: Job, attempt: Attempt, fps_in: float, frames_out: int, qc: dict, files: dict, timings: dict) -> dict:
    return {
        "batch": job.batch_id,
        "job": job.id,
        "id": job.client_id,
        "line": job.line,
        "attempt": attempt.number,
        "prompt_raw": job.prompt_raw,
        "prompt": job.prompt,
        "negative_prompt": job.negative_prompt,
        "elements": job.elements,
        "seed": attempt.seed,
        "model": attempt.model,
        "sampler": attempt.sampler,
        "tier": attempt.tier,
        "steps": attempt.steps,
        "guidance": attempt.guidance,
        "width": job.width,
        "height": job.height,
        "frames_rendered": job.frames,
        "fps_rendered": fps_in,
        "fps": job.fps,
        "frames": frames_out,
        "group_size": attempt.group_size,
        "timings": timings,
        "qc": qc,
        "files": files,
        "created_at": now().isoformat(),
    }


def convert_and_check(raw: np.ndarray, fps_in: float, fps_out: float, path: str, qc_config: QCConfig):
    """The post stage's work on one clip's frames: interpolate to ``fps_out``, encode H.264 at
    ``path``, decode that file and QC it (QC looks at what viewers will see).

    Returns (decoded frames, QC result, QC series, seconds per step).
    """
    t0 = time.perf_counter()
    frames = interpolate(raw, fps_in, fps_out)
    t1 = time.perf_counter()
    encode_h264(frames, fps_out, path)
    t2 = time.perf_counter()
    decoded, fps = decode(path)
    result, series = check_frames_with_series(decoded, fps, qc_config)
    return decoded, result, series, {"retime_s": t1 - t0, "h264_s": t2 - t1, "qc_s": time.perf_counter() - t2}


def post_attempt(ctx: WorkerContext, attempt_id: int) -> str | None:
    """Frame-rate conversion, H.264 encoding, QC and storage for one rendered attempt.

    Returns the verdict ('pass' / 'reject'), or None if there was nothing to do or it failed.
    """
    with ctx.db.session() as s:
        a = s.get(Attempt, attempt_id)
        if a is None or a.state != AttemptState.RENDERED.value:
            return None  # already done (a rerun), or never rendered
        job = s.get(Job, a.job_id)
        batch = s.get(Batch, job.batch_id)
    storage = ctx.storage(batch.out)
    try:
        t0 = time.perf_counter()
        raw = np.load(io.BytesIO(storage.get_bytes(a.raw_key)), allow_pickle=False)
        fps_in = float(a.timings.get("fps_in", 24))
        loaded = time.perf_counter()
        fd, tmp = tempfile.mkstemp(suffix=".mp4", prefix="clipmill-")
        os.close(fd)
        try:
            decoded, result, series, steps = convert_and_check(raw, fps_in, job.fps, tmp, ctx.qc_config)
            steps["retime_s"] += loaded - t0  # reading the raw frames counts with the retime
            t3 = time.perf_counter()
            files = {
                "clip": attempt_key(job, a, ".mp4"),
                "poster": attempt_key(job, a, ".jpg"),
                "sidecar": attempt_key(job, a, ".json"),
                "sheet": attempt_key(job, a, ".sheet.png"),
            }
            location = storage.put_file(files["clip"], tmp)
        finally:
            os.unlink(tmp)
        storage.put_bytes(files["poster"], poster_jpeg(decoded))
        storage.put_bytes(files["sheet"], contact_sheet(decoded, series, result))
        timings = dict(a.timings, **steps, store_s=time.perf_counter() - t3)
        timings["post_s"] = time.perf_counter() - t0
        timings = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in timings.items()}
        qc = result.to_dict()
        storage.put_bytes(
            files["sidecar"],
            json.dumps(sidecar(job, a, fps_in, len(decoded), qc, files, timings), ensure_ascii=False, indent=2).encode(),
        )
    except Exception:
        err = traceback.format_exc()
        log.error("post-processing failed: %s", err.splitlines()[-1], extra=ids(job, a))
        _fail(ctx.db, attempt_id, err)
        return None

    passed = result.verdict == "pass"
    retry = not passed and job.attempts_made < batch.max_attempts
    try:
        with ctx.db.session() as s, s.begin():
            move_attempt(
                s, a.id, AttemptState.RENDERED, AttemptState.PASSED if passed else AttemptState.REJECTED,
                verdict=result.verdict, reasons=result.reasons, qc_metrics=result.metrics,
                clip_key=files["clip"], poster_key=files["poster"], sidecar_key=files["sidecar"],
                location=location, timings=timings, finished_at=now(), raw_key=None,
            )
            if retry:  # escalate: render again at the quality tier, with a new seed (see queue.attempt_seed)
                move_job(s, job.id, JobState.POST, JobState.QUEUED, tier=RETRY_TIER, lease_owner=None, lease_expires_at=None)
            else:
                move_job(
                    s, job.id, JobState.POST, JobState.PASSED if passed else JobState.REJECTED,
                    lease_owner=None, lease_expires_at=None,
                )
    except MoveConflict:
        log.warning("moved by another process during post-processing", extra=ids(job, a))
        return None
    storage.delete(a.raw_key)
    log.info("%s%s: %s", result.verdict, " (retry queued)" if retry else "", "; ".join(result.reasons) or "clean",
             extra=ids(job, a))
    return result.verdict
