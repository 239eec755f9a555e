"""The assembly stage: when every shot of an ad has passed QC, make each of its formats, check
it with the ad-level QC, store it with a poster and a sidecar, and record what was made.

Exactly once, and atomic: an ad moves ``waiting -> assembling`` by a compare-and-set that also
takes back an ``assembling`` ad whose lease has expired (its assembler was killed), so one
assembler at a time works an ad. Every file goes under keys fixed by the batch, the ad and the
format (``BATCH/ads/AD/FORMAT.mp4``), written to a temporary file first and moved into place by
the storage, so a killed assembly leaves either nothing or a complete older file, and running it
again writes the same keys: one file per ad and format, never two.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
from sqlalchemy import select, update

from clipmill.jobs.core.models import Ad, Attempt, Batch, Job
from clipmill.jobs.core.queue import lease_lost, now, worker_name
from clipmill.jobs.core.states import JobState
from clipmill.pipeline.video import decode, poster_jpeg
from clipmill.storage.base import sha256_file

from . import build, rows, template

log = logging.getLogger("clipmill.ads")
LEASE_S = 600.0
DONE_JOB_STATES = (JobState.PASSED.value, JobState.APPROVED.value)
LOST_JOB_STATES = (JobState.REJECTED.value, JobState.FAILED.value, JobState.CANCELLED.value, JobState.DECLINED.value)


def ad_key(batch_id: str, ad_id: int, name: str) -> str:
    """The storage key of one of an ad's files: ``BATCH/ads/AD/NAME``."""
    return f"{batch_id}/ads/{ad_id}/{name}"


@dataclass
class Readiness:
    state: str  # ready | waiting | lost
    reason: str = ""


def readiness(session, ad_id: int) -> Readiness:
    """Whether an ad's shots are all delivered (``ready``), one can no longer be (``lost``: it
    ran out of attempts, failed or was cancelled), or some are still on their way."""
    jobs = session.scalars(select(Job).where(Job.ad_id == ad_id).order_by(Job.shot, Job.id)).all()
    lost = [j for j in jobs if j.state in LOST_JOB_STATES]
    if lost:
        j = lost[0]
        return Readiness("lost", f"shot {j.shot} (job {j.id}, {j.width}x{j.height}) ended {j.state}"
                         + (f": {j.error}" if j.error else ""))
    if jobs and all(j.state in DONE_JOB_STATES for j in jobs):
        return Readiness("ready")
    return Readiness("waiting")


def _take(db, ad_id: int, me: str, lease_s: float) -> bool:
    """Compare-and-set an ad to ``assembling`` under ``me``: from ``waiting``, or from an
    ``assembling`` whose lease expired or whose assembler (a process on this host) is dead."""
    t = now()
    with db.session() as s, s.begin():
        ad = s.get(Ad, ad_id)
        if ad is None or ad.state not in ("waiting", "assembling"):
            return False
        if ad.state == "assembling":
            if not lease_lost(ad.lease_expires_at, ad.lease_owner):
                return False
            log.warning("ad %s: taking it back from %s (lease expired or process gone)", ad_id, ad.lease_owner)
        res = s.execute(update(Ad).where(Ad.id == ad_id, Ad.version == ad.version)
                        .values(state="assembling", lease_owner=me, lease_expires_at=t + timedelta(seconds=lease_s),
                                version=Ad.version + 1, updated_at=t))
        return res.rowcount == 1


def _finish(db, ad_id: int, me: str, **values) -> bool:
    with db.session() as s, s.begin():
        res = s.execute(update(Ad).where(Ad.id == ad_id, Ad.state == "assembling", Ad.lease_owner == me)
                        .values(lease_owner=None, lease_expires_at=None, version=Ad.version + 1, updated_at=now(),
                                **values))
        return res.rowcount == 1


def _footage(storage, job: Job, attempt: Attempt, tmpdir: str) -> np.ndarray:
    path = os.path.join(tmpdir, f"shot-{job.id}.mp4")
    with open(path, "wb") as f:
        f.write(storage.get_bytes(attempt.clip_key))
    frames, _ = decode(path)
    return frames


def assemble_ad(ctx, ad_id: int, lease_s: float = LEASE_S) -> str | None:
    """Assemble one ad if its shots are ready and nobody else is assembling it. Returns its new
    state (``done``, ``rejected``, ``failed``), or None when there was nothing to do."""
    me = worker_name()
    with ctx.db.session() as s:
        ad = s.get(Ad, ad_id)
        if ad is None or ad.state not in ("waiting", "assembling"):
            return None
        ready = readiness(s, ad_id)
        batch = s.get(Batch, ad.batch_id)
    if ready.state == "waiting":
        return None
    if not _take(ctx.db, ad_id, me, lease_s):
        return None  # another assembler holds it, or it moved on
    if ready.state == "lost":
        _finish(ctx.db, ad_id, me, state="rejected", error=ready.reason)
        log.info("ad %s rejected: %s", ad_id, ready.reason)
        return "rejected"
    try:
        state, outputs, error = _assemble(ctx, ad, batch)
    except Exception:
        err = traceback.format_exc()
        log.error("assembling ad %s failed: %s", ad_id, err.splitlines()[-1])
        _finish(ctx.db, ad_id, me, state="failed", error=err[-4000:])
        return "failed"
    if not _finish(ctx.db, ad_id, me, state=state, outputs=outputs, error=error):
        log.warning("ad %s was taken back while it was assembled; its files stay under its own keys", ad_id)
        return None
    return state


def batch_template(batch: Batch, values: dict[str, str], storage, folder: str) -> template.AdTemplate:
    """The batch's template as it was accepted at submit, for the ad of row ``values``: the
    files that ad uses read from their copies in storage (written into ``folder``). A batch
    submitted before templates were kept (no text): the template and files at their paths now."""
    if batch.ad_template_text is None:
        return template.load(batch.ad_template, stored=True)
    tpl = template.loads(batch.ad_template_text, batch.ad_template, stored=True)
    copies = {}
    os.makedirs(os.path.join(folder, "assets"), exist_ok=True)
    for _, name, _ in rows.file_names(tpl, values):
        key = (batch.ad_assets or {}).get(name)
        if key is None:
            continue  # not stored at submit: layout() names the file as missing
        local = os.path.join(folder, "assets", key.rsplit("/", 1)[-1])
        if not os.path.exists(local):  # one read a file, however many texts use it
            with open(local, "wb") as f:
                f.write(storage.get_bytes(key))
        copies[name] = Path(local)
    return dataclasses.replace(tpl, copies=copies)


def _assemble(ctx, ad: Ad, batch: Batch) -> tuple[str, dict, str | None]:
    storage = ctx.storage(batch.out)
    with tempfile.TemporaryDirectory(prefix="clipmill-ad-") as tmp:
        tpl = batch_template(batch, ad.values, storage, tmp)
        return _assemble_with(ctx, ad, batch, tpl, storage, tmp)


def _assemble_with(ctx, ad: Ad, batch: Batch, tpl: template.AdTemplate, storage, tmp: str
                   ) -> tuple[str, dict, str | None]:
    texts, files, text_px, errs = rows.layout(tpl, ad.values, stored=True)
    if errs:
        raise ValueError("; ".join(str(e) for e in errs))
    with ctx.db.session() as s:
        jobs = s.scalars(select(Job).where(Job.ad_id == ad.id).order_by(Job.shot, Job.id)).all()
        passed = {}
        for j in jobs:  # the clip that made the job passed (or that an operator approved)
            q = select(Attempt).where(Attempt.job_id == j.id, Attempt.clip_key.is_not(None))
            if j.state == JobState.PASSED.value:
                q = q.where(Attempt.state == "passed")
            passed[j.id] = s.scalars(q.order_by(Attempt.number.desc())).first()
            if passed[j.id] is None:
                raise ValueError(f"shot {j.shot} (job {j.id}) is {j.state} but has no clip")
    ad_row = rows.AdRow(ad.line, ad.client_id, ad.values, ad.seed,
                        [rows.Shot(i, None, spec.seconds, spec.transition, spec.crossfade) for i, spec in enumerate(tpl.shots)],
                        texts, files, text_px)
    outputs: dict = {"formats": {}, "shots": []}
    reasons: list[str] = []
    decoded: dict[int, np.ndarray] = {}  # a job's clip serves every format made from it: read it once
    for fmt in tpl.formats:
        footage, used = {}, []
        for j in jobs:
            if fmt.name in (j.formats or []):
                a = passed[j.id]
                if j.id not in decoded:
                    decoded[j.id] = _footage(storage, j, a, tmp)
                footage[j.shot] = decoded[j.id]
                used.append({"shot": j.shot, "job": j.id, "attempt": a.number, "seed": a.seed, "tier": a.tier,
                             "clip": a.clip_key})
        dest = os.path.join(tmp, f"{fmt.name}.mp4")
        t0 = time.perf_counter()
        built = build.make_format(tpl, ad_row, fmt, footage, dest)
        key = ad_key(batch.id, ad.id, f"{fmt.name}.mp4")
        location = storage.put_file(key, dest)
        storage.put_bytes(ad_key(batch.id, ad.id, f"{fmt.name}.jpg"), poster_jpeg(built.poster[None]))
        outputs["formats"][fmt.name] = {
            "file": key, "location": location, "poster": ad_key(batch.id, ad.id, f"{fmt.name}.jpg"),
            "width": built.width, "height": built.height, "frames": built.frames, "seconds": round(built.seconds, 4),
            "bytes": built.bytes, "reencoded": built.reencoded, "sha256": sha256_file(dest),
            "qc": {"verdict": built.qc.verdict, "reasons": built.qc.reasons, "metrics": built.qc.metrics},
            "shots": used, "timings": {k: round(v, 3) for k, v in built.timings.items()},
            "assemble_s": round(time.perf_counter() - t0, 3),
        }
        reasons += [f"{fmt.name}: {r}" for r in built.qc.reasons]
    outputs["shots"] = sorted({(u["shot"], u["job"], u["seed"]) for f in outputs["formats"].values() for u in f["shots"]})
    sidecar = {"batch": batch.id, "ad": ad.id, "id": ad.client_id, "line": ad.line, "values": ad.values,
               "template": batch.ad_template, "seconds": tpl.seconds, "fps": tpl.fps, "formats": outputs["formats"],
               "created_at": now().isoformat()}
    storage.put_bytes(ad_key(batch.id, ad.id, "ad.json"),
                      json.dumps(sidecar, ensure_ascii=False, indent=2).encode())
    outputs["sidecar"] = ad_key(batch.id, ad.id, "ad.json")
    if reasons:
        return "rejected", outputs, "; ".join(reasons)
    return "done", outputs, None


def assemble_batch(ctx, batch_id: str) -> dict[int, str | None]:
    """Assemble every ad of a batch whose shots are ready (or lost): {ad id: its new state}."""
    with ctx.db.session() as s:
        ids = list(s.scalars(select(Ad.id).where(Ad.batch_id == batch_id, Ad.state.in_(("waiting", "assembling")))
                             .order_by(Ad.id)))
    return {i: assemble_ad(ctx, i) for i in ids}


def ads_of(db, batch_id: str) -> list[Ad]:
    with db.session() as s:
        return list(s.scalars(select(Ad).where(Ad.batch_id == batch_id).order_by(Ad.id)))
