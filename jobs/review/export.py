"""Delivering a batch's approved clips, with a manifest, to a folder or an S3 prefix.

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
from clipmill.jobs.core.models import Attempt, Batch, Decision, Job
from clipmill.jobs.core.states import JobState
from clipmill.storage import LocalStorage, open_storage
from clipmill.storage.base import sha256_file

MANIFEST_FIELDS = ("job_id", "client_id", "file", "bytes", "sha256", "prompt", "prompt_raw", "seed", "tier", "model",
                   "qc_verdict", "qc_metrics", "approver", "approved_at")


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


def approved_count(db: Database, batch_id: str) -> int:
    """How many of the batch's jobs are approved; ExportError if there is no such batch."""
    with db.session() as s:
        if s.get(Batch, batch_id) is None:
            raise ExportError(f"batch {batch_id!r}: no such batch")
        return s.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == batch_id, Job.state == JobState.APPROVED.value))


def export_batch(db: Database, batch_id: str, dest_url: str, progress=None) -> ExportResult:
    batch, items = _approved(db, batch_id)
    src = open_storage(batch.out)
    dest = open_storage(dest_url)
    result = ExportResult(dest_url)
    for n, (job, attempt, decision) in enumerate(items, start=1):
        name = f"{batch_id}/{job.id}" + (f"-{job.client_id}" if job.client_id else "") + ".mp4"
        with _local_copy(src, attempt.clip_key) as path:
            size, digest = os.path.getsize(path), sha256_file(path)
            have = dest.stat(name)
            if have == (size, digest):
                result.skipped.append(name)
            else:
                dest.put_file(name, path)
                result.copied.append(name)
        result.rows.append({
            "job_id": job.id, "client_id": job.client_id or "", "file": name, "bytes": size, "sha256": digest,
            "prompt": job.prompt, "prompt_raw": job.prompt_raw, "seed": attempt.seed, "tier": attempt.tier,
            "model": attempt.model, "qc_verdict": attempt.verdict or "", "qc_metrics": attempt.qc_metrics or {},
            "approver": decision.operator if decision else "",
            "approved_at": decision.created_at.isoformat(timespec="seconds") if decision else "",
        })
        if progress is not None:
            progress(n, len(items))
    # the manifest goes last: its presence says every file in it is in place
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=MANIFEST_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in result.rows:
        writer.writerow(dict(row, qc_metrics=json.dumps(row["qc_metrics"], sort_keys=True)))
    base = f"{batch_id}/manifest"
    result.manifest = [
        dest.put_bytes(base + ".csv", buf.getvalue().encode()),
        dest.put_bytes(base + ".json", json.dumps({"batch": batch_id, "clips": result.rows}, ensure_ascii=False,
                                                  indent=2, sort_keys=True).encode()),
    ]
    return result


class _local_copy:
    """A local path for a stored key: the file itself for local storage, a temp copy for S3."""

    def __init__(self, store, key: str):
        self.store, self.key, self.tmp = store, key, None

    def __enter__(self) -> str:
        if isinstance(self.store, LocalStorage):
            return str(self.store.path(self.key))
        fd, self.tmp = tempfile.mkstemp(suffix=".mp4", prefix="clipmill-export-")
        with os.fdopen(fd, "wb") as f:
            f.write(self.store.get_bytes(self.key))
        return self.tmp

    def __exit__(self, *exc) -> None:
        if self.tmp:
            os.unlink(self.tmp)
