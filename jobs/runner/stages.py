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
import threading
import time
import traceback
from datetime import datetime, timezone
from typing import Callable

import numpy as np
import torch
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.logs import ids
from clipmill.jobs.core.models import Attempt, Batch, Job, attempt_key, attempt_keys
from clipmill.jobs.core.operations import release, sweep_lost
from clipmill.jobs.core.preflight import SetupProblem
from clipmill.jobs.core.queue import (POST_LEASE_S, POST_MAX_S, Heartbeat, attempts_left, claim_post, holds_post,
                                      worker_name)
from clipmill.jobs.core.settings import Settings
from clipmill.jobs.runner.checks import VERDICT_KINDS, clip_decode_check, with_render_check
from clipmill.jobs.runner.draws import DEFAULT_DRAWS, check_draws, render_drawing
from clipmill.jobs.core.states import AttemptState, JobState, MoveConflict, move_attempt, move_job
from clipmill.pipeline import shapes
from clipmill.pipeline.models import model_info
from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer, RenderOptions
from clipmill.pipeline.interpolate import interpolate
from clipmill.pipeline.video import decode, encode_h264, poster_jpeg
from clipmill.qc import QCConfig, check_frames_with_series
from clipmill.qc.adherence import report as adherence_report
from clipmill.qc.margin import reason_kinds, risk
from clipmill.qc.report import contact_sheet
from clipmill.storage import Storage, open_storage

log = logging.getLogger("clipmill.stages")
RETRY_TIER = "quality"  # a clip QC rejected is rendered again at this tier


def now() -> datetime:
    return datetime.now(timezone.utc)


class WorkerContext:
    """What a worker keeps between tasks: the database, warm models and storage backends."""

    def __init__(self, db: Database, device: str = "cpu", qc_config: QCConfig = QCConfig(),
                 render_options: RenderOptions | None = None, guidance_mode: str = "cfg", draws: int = DEFAULT_DRAWS):
        self.db = db
        self.draws = check_draws(draws)  # renders a checkable clip may take (jobs.runner.draws)
        self.device = device
        self.qc_config = qc_config
        self.render_options = render_options or RenderOptions()
        self.guidance_mode = guidance_mode
        self._renderer: tuple[str, Renderer] | None = None
        self._storages: dict[str, Storage] = {}

    @classmethod
    def from_settings(cls, settings: Settings, db: Database | None = None) -> WorkerContext:
        """A farm worker's context: its database, device and render options from ``settings``."""
        return cls(
            db or Database(settings.database_url),
            device=settings.device or default_device(),
            qc_config=QCConfig.load(settings.qc_config, name="CLIPMILL_QC_CONFIG"),
            render_options=RenderOptions(feature_cache=settings.feature_cache, decoder=settings.decoder,
                                         compile=settings.compile),
            guidance_mode=settings.guidance_mode,
            draws=settings.draws,
        )

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


def default_device() -> str:
    """cuda when torch sees a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class LeaseLost(RuntimeError):
    """This worker no longer holds the lease of the job it was working on."""


def _fail(db: Database, attempt_id: int, error: str) -> bool:
    """Mark an attempt failed; its job goes back to queued with attempts left (see
    queue.attempts_left), else to failed with the error's last line as its reason. False when
    the attempt was no longer open (another worker finished it meanwhile): nothing changed."""
    with db.session() as s, s.begin():
        a = s.get(Attempt, attempt_id)
        job = s.get(Job, a.job_id)
        batch = s.get(Batch, job.batch_id)
        src_attempt = AttemptState(a.state)
        if src_attempt not in (AttemptState.RENDERING, AttemptState.RENDERED):
            return False
        move_attempt(s, a.id, src_attempt, AttemptState.FAILED, error=error[-4000:], finished_at=now())
        src = JobState(job.state)
        if src not in (JobState.RENDERING, JobState.POST):
            return True
        retry = attempts_left(job, batch)
        move_job(
            s, job.id, src, JobState.QUEUED if retry else JobState.FAILED,
            lease_owner=None, lease_expires_at=None, error=None if retry else error.splitlines()[-1][-500:],
        )
    if not retry:  # what its lost attempts stored is never delivered
        sweep_lost(db, job.id)
    return True


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
    except Exception as e:  # setup, not the jobs' own failure: hand the group back unspent and stop
        why = f"{e.__class__.__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        log.error("the model does not load: %s", why, extra=ids(batch=batch.id, group=first_attempt.group_id))
        release(ctx.db, [a.id for a, _, _ in rows])
        raise SetupProblem(f"the model {batch.model} does not load on {ctx.device} ({why})") from e
    try:
        drawn = render_drawing(renderer, requests, settings, ctx.draws, callback)
    except Exception:  # a render error fails every attempt in the group; jobs retry if they can
        err = traceback.format_exc()
        log.error("render failed: %s", err.splitlines()[-1], extra=ids(batch=batch.id, group=first_attempt.group_id))
        for a, _, _ in rows:
            _fail(ctx.db, a.id, err)
        return []

    done = []
    for (a, j, _), d in zip(rows, drawn):
        res = d.result
        if d.draws > 1:
            log.info("rendered %s draws to read as asked; kept seed %s (%s)", d.draws, d.seed,
                     " | ".join(_read_line(r) for r in d.reads), extra=ids(j, a))
        raw_key = attempt_key(j, a, ".frames.npy")
        try:  # a storage error fails the attempt now: the job must not sit in rendering until its lease expires
            storage = ctx.storage(batch.out)
            buf = io.BytesIO()
            np.save(buf, res.frames, allow_pickle=False)
            storage.put_bytes(raw_key, buf.getvalue())
        except Exception as e:  # noqa: BLE001 - any storage error: retry the job, or fail it with the reason
            reason = f"storing the raw frames at {raw_key} in {batch.out} failed: {e.__class__.__name__}: " + " ".join(
                str(e).split())
            log.error("%s", reason, extra=ids(j, a))
            _fail(ctx.db, a.id, f"{traceback.format_exc()}{reason}")  # the job's reason is the last line
            continue
        timings = dict(res.timings, fps_in=res.fps, draws=d.draws)
        timings.update(clip_decode_check(res, renderer.info))  # judged by the post stage
        if d.draws > 1:
            timings["draws_extra_s"] = d.extra_s  # rendering the draws that were not kept
        try:
            with ctx.db.session() as s, s.begin():
                # the seed the kept draw was rendered from (the attempt's own unless it was drawn again)
                move_attempt(s, a.id, AttemptState.RENDERING, AttemptState.RENDERED, raw_key=raw_key, timings=timings,
                             seed=d.seed)
                # the render lease ends here; the post stage takes its own (claim_post)
                move_job(s, j.id, JobState.RENDERING, JobState.POST, lease_owner=None, lease_expires_at=None)
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


def _read_line(read: dict) -> str:
    """One draw's reading for the log: its seed, the attributes read wrong and those read right
    but too near a boundary (``qc.adherence.clear``)."""
    if read["match"] is None:
        return f"seed {read['seed']}: not read"
    wrong = [k for k, ok in read["match"].items() if not ok]
    unclear = [k for k, ok in read["clear"].items() if not ok and read["match"][k]]
    parts = ([f"wrong {', '.join(wrong)}"] if wrong else []) + ([f"unclear {', '.join(unclear)}"] if unclear else [])
    return f"seed {read['seed']}: " + ("; ".join(parts) if parts else "right")


def clip_adherence(prompt: str, frames: np.ndarray) -> dict | None:
    """What the shapes world's analyzer reads in a delivered clip against what its prompt asks,
    for prompts in the shapes grammar (English or Chinese); None for any other prompt, and (with
    a warning) when the analyzer fails: it informs, it never fails a clip QC passed."""
    spec = shapes.parse(prompt)
    if spec is None:
        return None
    try:
        return adherence_report(frames, spec)
    except Exception as e:  # noqa: BLE001 - a report, not a verdict
        log.warning("adherence: the analyzer failed on a clip of %r: %s", prompt, e)
        return None


def sidecar(job: Job, attempt: Attempt, fps_in: float, frames_out: int, qc: dict, files: dict, timings: dict,
            adherence: dict | None = None) -> dict:
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
        "seed": attempt.seed,  # the seed of the kept draw: it renders this clip again with --draws 1
        "draws": timings.get("draws", 1),  # renders this clip took (jobs.runner.draws)
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
        "adherence": adherence,
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


def _drop(ctx: WorkerContext, job: Job, attempt: Attempt, out: str) -> None:
    """The job moved on while its attempt was post-processed (cancelled, say): unless another
    post worker finished the same attempt (a message delivered twice; its files are under the
    same keys and are kept), delete every file of the attempt and close it as failed."""
    with ctx.db.session() as s:
        state = s.scalar(select(Attempt.state).where(Attempt.id == attempt.id))
    if state in (AttemptState.PASSED.value, AttemptState.REJECTED.value):
        log.info("already post-processed by another worker; nothing to do", extra=ids(job, attempt))
        return
    log.warning("the job was %s during post-processing; the attempt's files are deleted",
                _job_state(ctx.db, job.id), extra=ids(job, attempt))
    _delete_files(ctx, job, attempt, out)
    try:
        with ctx.db.session() as s, s.begin():
            move_attempt(s, attempt.id, AttemptState.RENDERED, AttemptState.FAILED, finished_at=now(), raw_key=None,
                         error=f"dropped: the job was {_job_state(ctx.db, job.id)} during post-processing")
    except MoveConflict:
        pass  # already closed (by `clipmill cancel`)


def _delete_files(ctx: WorkerContext, job: Job, attempt: Attempt, out: str) -> None:
    """Delete every file the attempt may have written (raw frames included), best effort."""
    try:
        storage = ctx.storage(out)
        for key in attempt_keys(job, attempt):
            storage.delete(key)
    except Exception as e:  # noqa: BLE001 - the attempt is closed either way; say what may be left
        log.warning("deleting the attempt's files in %s failed (%s: %s); delete %s by hand", out,
                    e.__class__.__name__, e, ", ".join(attempt_keys(job, attempt)), extra=ids(job, attempt))


def _job_state(db: Database, job_id: int) -> str:
    with db.session() as s:
        return s.scalar(select(Job.state).where(Job.id == job_id)) or "deleted"


def post_attempt(ctx: WorkerContext, attempt_id: int, owner: str | None = None) -> str | None:
    """Frame-rate conversion, H.264 encoding, QC and storage for one rendered attempt, under the
    job's post lease held as ``owner`` (default: this process and thread).

    Returns the verdict ('pass' / 'reject'), or None if there was nothing to do or it failed.
    A job cancelled before or during post-processing keeps no files of this attempt: its raw
    frames, clip, poster, sidecar and contact sheet are deleted and the attempt is closed.
    """
    with ctx.db.session() as s:
        a = s.get(Attempt, attempt_id)
        if a is None or a.state != AttemptState.RENDERED.value:
            return None  # already done (a rerun), or never rendered
        job = s.get(Job, a.job_id)
        batch = s.get(Batch, job.batch_id)
    if job.state != JobState.POST.value:  # cancelled after rendering: nothing to deliver
        _drop(ctx, job, a, batch.out)
        return None
    owner = owner or f"{worker_name()}/{threading.get_ident()}"  # post workers run threads
    claim = claim_post(ctx.db, job.id, owner)
    if claim == "moved":  # cancelled since: nothing to deliver
        _drop(ctx, job, a, batch.out)
        return None
    if claim == "busy":
        # a second message for an attempt another live worker is post-processing: its encode is
        # not bit-identical, so two posts would store files that need not match the verdict kept
        log.info("another worker is post-processing this attempt; nothing to do", extra=ids(job, a))
        return None
    # the lease is renewed while this stage runs (up to POST_MAX_S), so that no other worker takes
    # the attempt over from a live one; a stage that stalled past it (a hung disk) stores nothing
    with Heartbeat(ctx.db, [job.id], owner, POST_LEASE_S, state=JobState.POST, max_s=POST_MAX_S):
        return _post(ctx, job, a, batch, owner)


def _post(ctx: WorkerContext, job: Job, a: Attempt, batch: Batch, owner: str) -> str | None:
    """``post_attempt``'s work once it holds the job's post lease as ``owner``."""
    attempt_id = a.id
    try:
        storage = ctx.storage(batch.out)
        t0 = time.perf_counter()
        raw = np.load(io.BytesIO(storage.get_bytes(a.raw_key)), allow_pickle=False)
        fps_in = float(a.timings.get("fps_in", 24))
        loaded = time.perf_counter()
        fd, tmp = tempfile.mkstemp(suffix=".mp4", prefix="clipmill-")
        os.close(fd)
        try:
            decoded, result, series, steps = convert_and_check(raw, fps_in, job.fps, tmp, ctx.qc_config)
            if not holds_post(ctx.db, job.id, owner):
                raise LeaseLost(f"post lease of job {job.id} lost to another worker (this one stalled past it)")
            result = with_render_check(result, a.timings)  # the decode's measures, recorded by the render stage
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
        t4 = time.perf_counter()
        adherence = clip_adherence(job.prompt, decoded)
        timings = dict(a.timings, **steps, store_s=t4 - t3, adherence_s=time.perf_counter() - t4)
        timings["post_s"] = time.perf_counter() - t0
        timings = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in timings.items()}
        qc = result.to_dict()
        storage.put_bytes(
            files["sidecar"],
            json.dumps(sidecar(job, a, fps_in, len(decoded), qc, files, timings, adherence), ensure_ascii=False,
                       indent=2).encode(),
        )
    except LeaseLost as e:  # the worker that took it over stores the files and the verdict
        log.warning("%s; nothing stored", e, extra=ids(job, a))
        return None
    except Exception:
        err = traceback.format_exc()
        log.error("post-processing failed: %s", err.splitlines()[-1], extra=ids(job, a))
        if _fail(ctx.db, attempt_id, err):  # not when another worker finished it meanwhile: those files are its
            _delete_files(ctx, job, a, batch.out)  # a failed attempt keeps no clip, poster or raw frames
        return None

    passed = result.verdict == "pass"
    retry = not passed and attempts_left(job, batch)
    try:
        with ctx.db.session() as s, s.begin():
            move_attempt(
                s, a.id, AttemptState.RENDERED, AttemptState.PASSED if passed else AttemptState.REJECTED,
                verdict=result.verdict, reasons=result.reasons, qc_metrics=result.metrics, adherence=adherence,
                clip_key=files["clip"], poster_key=files["poster"], sidecar_key=files["sidecar"],
                location=location, timings=timings, finished_at=now(), raw_key=None,
            )
            if retry:  # escalate: render again at the quality tier, with a new seed (see queue.attempt_seed)
                move_job(s, job.id, JobState.POST, JobState.QUEUED, tier=RETRY_TIER, lease_owner=None, lease_expires_at=None)
            else:
                margin, near = risk(result.metrics, ctx.qc_config)
                kinds = reason_kinds(result.reasons, VERDICT_KINDS)
                move_job(
                    s, job.id, JobState.POST, JobState.PASSED if passed else JobState.REJECTED,
                    lease_owner=None, lease_expires_at=None, qc_margin=margin, qc_near=near,
                    qc_kinds=f",{','.join(kinds)}," if kinds else None,
                )
    except MoveConflict:
        _drop(ctx, job, a, batch.out)
        return None
    try:
        storage.delete(a.raw_key)
    except Exception as e:  # noqa: BLE001 - the verdict stands; say what is left behind
        log.warning("deleting the raw frames %s in %s failed (%s: %s); delete them by hand", a.raw_key, batch.out,
                    e.__class__.__name__, e, extra=ids(job, a))
    if job.attempts_lost:  # what lost attempts stored is never delivered
        sweep_lost(ctx.db, job.id, ctx.storage(batch.out))
    log.info("%s%s: %s", result.verdict, " (retry queued)" if retry else "", "; ".join(result.reasons) or "clean",
             extra=ids(job, a))
    return result.verdict
