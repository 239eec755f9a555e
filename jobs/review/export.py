"""Delivering a batch's approved clips (or, for an ad batch, its approved ads in every format),
with a manifest, to a folder or an S3 prefix.

Each clip is copied only if the destination does not already hold the same bytes (same size
and SHA-256), so running an export again copies nothing twice, and an interrupted export picks
up where it stopped. Copies are atomic (local: temp file and rename; S3: one verified PUT), and
the manifest is written last.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from dataclasses import dataclass, field

from sqlalchemy import func, select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, AdDecision, Attempt, Batch, Decision, Job
from clipmill.jobs.core.states import JobState
from clipmill.storage import LocalStorage, open_storage
from clipmill.storage.base import StorageError, sha256_file

MANIFEST_FIELDS = ("job_id", "client_id", "file", "bytes", "sha256", "prompt", "prompt_raw", "seed", "tier", "model",
                   "qc_verdict", "qc_metrics", "approver", "approved_at")
# an ad batch: one row per approved ad and format
AD_MANIFEST_FIELDS = ("ad_id", "row_id", "line", "values", "format", "width", "height", "duration", "file", "bytes",
                      "sha256", "shot_seeds", "approver", "approved_at")


class ExportError(ValueError):
    pass


@dataclass
class ExportResult:
    destination: str
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    manifest: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def _approved(db: Database, batch_id: str):
    with db.session() as s:
        batch = s.get(Batch, batch_id)
        if batch is None:
            raise ExportError(f"batch {batch_id!r}: no such batch")
        jobs = s.scalars(
            select(Job).where(Job.batch_id == batch_id, Job.state == JobState.APPROVED.value).order_by(Job.id)
        ).all()
        out = []
        for j in jobs:
            attempt = s.scalars(
                select(Attempt).where(Attempt.job_id == j.id, Attempt.clip_key.is_not(None)).order_by(Attempt.number.desc())
            ).first()
            decision = s.scalars(
                select(Decision).where(Decision.job_id == j.id, Decision.decision == JobState.APPROVED.value)
                .order_by(Decision.id.desc())
            ).first()
            if attempt is None:
                raise ExportError(f"job {j.id} is approved but has no clip")
            out.append((j, attempt, decision))
        return batch, out


def approved_count(db: Database, batch_id: str) -> tuple[int, str]:
    """How many of the batch's clips (or, for an ad batch, ads) are approved, and which of the
    two it counted; ExportError if there is no such batch."""
    with db.session() as s:
        batch = s.get(Batch, batch_id)
        if batch is None:
            raise ExportError(f"batch {batch_id!r}: no such batch")
        if batch.ad_template is not None:
            return s.scalar(select(func.count()).select_from(Ad).where(
                Ad.batch_id == batch_id, Ad.state == "approved")), "ad"
        return s.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == batch_id, Job.state == JobState.APPROVED.value)), "clip"


def _deliver(src, dest, key: str, name: str, result: ExportResult, what: str,
             expect_sha256: str | None = None) -> tuple[int, str]:
    """Copy ``key`` of ``src`` to ``name`` of ``dest`` unless the same bytes are there. A stored
    file that is missing, or whose SHA-256 is not ``expect_sha256``, is refused before anything
    is written (``what`` names it: "job 12", "ad 3 square")."""
    with _local_copy(src, key, what) as path:
        size, digest = os.path.getsize(path), sha256_file(path)
        if expect_sha256 is not None and digest != expect_sha256:
            raise ExportError(f"{what}: the stored file's SHA-256 {digest[:12]}... is not the one its assembly "
                              f"recorded ({expect_sha256[:12]}...); assemble it again before delivery")
        if dest.stat(name) == (size, digest):
            result.skipped.append(name)
        else:
            dest.put_file(name, path)
            result.copied.append(name)
    return size, digest


def _manifest(dest, batch_id: str, fields: tuple[str, ...], rows: list[dict], kind: str, result: ExportResult) -> None:
    """manifest.csv and manifest.json, last: their presence says every file in them is in place."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v, ensure_ascii=False, sort_keys=True) if isinstance(v, (dict, list)) else v
                         for k, v in row.items()})
    base = f"{batch_id}/manifest"
    result.manifest = [
        dest.put_bytes(base + ".csv", buf.getvalue().encode()),
        dest.put_bytes(base + ".json", json.dumps({"batch": batch_id, kind: rows}, ensure_ascii=False,
                                                  indent=2, sort_keys=True).encode()),
    ]


def export_batch(db: Database, batch_id: str, dest_url: str, progress=None) -> ExportResult:
    with db.session() as s:
        batch = s.get(Batch, batch_id)
    if batch is not None and batch.ad_template is not None:
        return export_ads(db, batch_id, dest_url, progress)
    batch, items = _approved(db, batch_id)
    src = open_storage(batch.out)
    dest = open_storage(dest_url)
    result = ExportResult(dest_url)
    for n, (job, attempt, decision) in enumerate(items, start=1):
        name = f"{batch_id}/{job.id}" + (f"-{job.client_id}" if job.client_id else "") + ".mp4"
        size, digest = _deliver(src, dest, attempt.clip_key, name, result, f"job {job.id}")
        result.rows.append({
            "job_id": job.id, "client_id": job.client_id or "", "file": name, "bytes": size, "sha256": digest,
            "prompt": job.prompt, "prompt_raw": job.prompt_raw, "seed": attempt.seed, "tier": attempt.tier,
            "model": attempt.model, "qc_verdict": attempt.verdict or "", "qc_metrics": attempt.qc_metrics or {},
            "approver": decision.operator if decision else "",
            "approved_at": decision.created_at.isoformat(timespec="seconds") if decision else "",
        })
        if progress is not None:
            progress(n, len(items))
    _manifest(dest, batch_id, MANIFEST_FIELDS, result.rows, "clips", result)
    return result


def export_ads(db: Database, batch_id: str, dest_url: str, progress=None) -> ExportResult:
    """An ad batch's approved ads, every format: ``BATCH/ROW-ID/FORMAT.mp4`` (``ad-N``, N the ad's
    number, when its row has none), one manifest row per ad and format with the row's placeholder values,
    the duration, the SHA-256 and the seeds of its shots in order."""
    with db.session() as s:
        batch = s.get(Batch, batch_id)
        ads = s.scalars(select(Ad).where(Ad.batch_id == batch_id, Ad.state == "approved").order_by(Ad.id)).all()
        approvals = {}
        for d in s.scalars(select(AdDecision).where(AdDecision.ad_id.in_([a.id for a in ads]),
                                                    AdDecision.decision == "approved").order_by(AdDecision.id)):
            approvals[d.ad_id] = d  # the last approval of each
    folders = _ad_folders(batch_id, ads)
    src = open_storage(batch.out)
    dest = open_storage(dest_url)
    result = ExportResult(dest_url)
    for n, ad in enumerate(ads, start=1):
        formats = (ad.outputs or {}).get("formats") or {}
        if not formats:
            raise ExportError(f"ad {ad.id} is approved but has no assembled files")
        folder = folders[ad.id]
        d = approvals.get(ad.id)
        for name, f in formats.items():
            target = f"{folder}/{name}.mp4"
            size, digest = _deliver(src, dest, f["file"], target, result, f"ad {ad.id} {name}", f["sha256"])
            result.rows.append({
                "ad_id": ad.id, "row_id": ad.client_id or "", "line": ad.line, "values": ad.values, "format": name,
                "width": f["width"], "height": f["height"], "duration": f["seconds"], "file": target, "bytes": size,
                "sha256": digest, "shot_seeds": [u["seed"] for u in sorted(f.get("shots", []), key=lambda u: u["shot"])],
                "approver": d.operator if d else "",
                "approved_at": d.created_at.isoformat(timespec="seconds") if d else "",
            })
        if progress is not None:
            progress(n, len(ads))
    _manifest(dest, batch_id, AD_MANIFEST_FIELDS, result.rows, "ads", result)
    return result


def _ad_folders(batch_id: str, ads) -> dict[int, str]:
    """Each ad's folder: its row id, or ``ad-N`` (N its number) for a row without one. Two ads
    that would share a folder (a row whose id is another ad's ``ad-N``) are refused: one would
    overwrite the other's files."""
    folders, seen = {}, {}
    for ad in ads:
        folder = f"{batch_id}/{ad.client_id or f'ad-{ad.id}'}"
        if folder in seen:
            raise ExportError(f"ads {seen[folder]} and {ad.id} would both be delivered to {folder}/; "
                              "give the rows distinct ids")
        folders[ad.id], seen[folder] = folder, ad.id
    return folders


class _local_copy:
    """A local path for a stored key: the file itself for local storage, a temp copy for S3."""

    def __init__(self, store, key: str, what: str):
        self.store, self.key, self.what, self.tmp = store, key, what, None

    def __enter__(self) -> str:
        try:
            if isinstance(self.store, LocalStorage):
                path = self.store.path(self.key)
                if not path.is_file():
                    raise FileNotFoundError(2, "no such file")
                return str(path)
            data = self.store.get_bytes(self.key)
        except (OSError, StorageError) as e:  # a missing or unreadable clip: one line, nothing of it delivered
            raise ExportError(f"{self.what}: its file {self.key} cannot be read from the batch's storage "
                              f"({getattr(e, 'strerror', None) or e}); nothing of it was delivered") from None
        fd, self.tmp = tempfile.mkstemp(suffix=".mp4", prefix="clipmill-export-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return self.tmp

    def __exit__(self, *exc) -> None:
        if self.tmp:
            os.unlink(self.tmp)
