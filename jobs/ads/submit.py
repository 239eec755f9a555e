"""Submitting an ad batch: the template and every row are checked first, then the batch, its ads
and their shot jobs are written in one transaction (all or nothing, as a prompt batch).

Each shot is one job per render size its formats need (``rows.render_sizes``): formats made by
``crop`` or ``pad`` share the model's default size; a ``render`` format has footage of its own
shape. A job knows its ad, its shot and the formats made from its footage.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import insert, select

from clipmill.jobs.core.batches import SubmitOptions, _batch_name, _token_counter
from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, Batch, Job
from clipmill.jobs.core.preflight import check_model, check_submit_options
from clipmill.jobs.core.prompts import BatchFile, BatchInvalid
from clipmill.jobs.core.states import JobState
from clipmill.pipeline.models import BUILTIN_MODELS
from clipmill.storage import open_storage

from . import rows, template


@dataclass
class AdSubmitResult:
    batch_id: str
    ads: rows.AdBatch
    ad_ids: list[int]
    job_ids: list[int]


def check_ads(path: str | Path, template_path: str | Path, opts: SubmitOptions) -> rows.AdBatch:
    """The template, then every row against it; submits nothing. Raises TemplateError (a bad
    template), BadOption or SetupProblem."""
    check_submit_options(opts)
    info = check_model(opts.model)
    tpl = template.load(template_path)
    return rows.read_ads(path, tpl, info, _token_counter(opts.model))


def invalid(ads: rows.AdBatch) -> BatchInvalid:
    """The prompt batch's all-or-nothing error, for an ad batch's problems."""
    return BatchInvalid(BatchFile(ads.path, errors=list(ads.errors), warnings=list(ads.warnings)))


def check_ad_submission(path: str | Path, template_path: str | Path, opts: SubmitOptions) -> rows.AdBatch:
    """Everything ``submit_ads`` checks before it writes, with no job table needed (``check_ads``);
    raises ``BatchInvalid`` when a row or the template has a problem."""
    ads = check_ads(path, template_path, opts)
    if ads.errors:
        raise invalid(ads)
    return ads


ASSETS = "_assets"  # the storage root's folder of ad files, by content (a batch name starts with a letter or digit)
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9]{1,8}")


def store_assets(ads: rows.AdBatch, out: str) -> dict[str, str]:
    """Copy every font, logo and music file the ads use into the storage root by content
    (``_assets/SHA256.ext``, written once however many batches use it), so that assembly reads
    them as they were at submit, on any host: {name as the template gives it, filled: key}."""
    storage = open_storage(out)
    keys: dict[str, str] = {}
    for ad in ads.ads:
        for _, name, _ in rows.file_names(ads.template, ad.values):
            if name in keys:
                continue
            local = ads.template.resolve(name)
            data = local.read_bytes()  # what is hashed is what is stored
            suffix = local.suffix.lower() if _SUFFIX_RE.fullmatch(local.suffix) else ""
            key = f"{ASSETS}/{hashlib.sha256(data).hexdigest()}{suffix}"
            if not storage.exists(key):
                storage.put_bytes(key, data)
            keys[name] = key
    return keys


def submit_ads(db: Database, path: str | Path, template_path: str | Path, opts: SubmitOptions,
               ads: rows.AdBatch | None = None) -> AdSubmitResult:
    """Check everything (``check_ad_submission``, unless ``ads`` is its result), then write the
    batch, its ads and their shot jobs; with any problem, raise ``BatchInvalid`` and write
    nothing. The batch keeps the template's text and a copy of each file its ads use
    (``store_assets``): assembly reads those, not the files at their paths."""
    if ads is None:
        ads = check_ad_submission(path, template_path, opts)
    notify = opts.notify or ads.template.notify  # --notify, else the template's
    info = check_model(opts.model)
    assets = store_assets(ads, opts.out)  # before the batch is written: a batch never names a missing copy
    with db.session() as session, session.begin():
        name = _batch_name(session, Path(path), opts.batch)
        session.add(Batch(
            id=name, source=str(path),
            model=opts.model if opts.model in BUILTIN_MODELS else str(Path(opts.model).expanduser().resolve()),
            sampler=opts.sampler or info.scheduler, guidance=opts.guidance,
            out=str(Path(opts.out).expanduser().resolve()) if "://" not in opts.out else opts.out,
            priority=opts.priority, max_attempts=opts.max_attempts, max_lost=opts.max_lost,
            ad_template=str(Path(template_path).expanduser().resolve()), notify_url=notify,
            ad_template_text=ads.template.text, ad_assets=assets,
        ))
        session.flush()
        ad_ids, job_rows = [], []
        for ad in ads.ads:
            row = Ad(batch_id=name, line=ad.line, client_id=ad.client_id, values=ad.values, seed=ad.seed,
                     state="waiting", version=0)
            session.add(row)
            session.flush()
            ad_ids.append(row.id)
            for shot in ad.shots:
                by_size: dict[tuple[int, int], list[str]] = {}
                for fmt, size in shot.sizes.items():
                    by_size.setdefault(size, []).append(fmt)
                for (w, h), formats in by_size.items():
                    r = shot.row
                    # a job's id names its ad, shot and size (ids are unique in a batch)
                    cid = f"{ad.client_id}.s{shot.index}.{w}x{h}" if ad.client_id else None
                    job_rows.append(dict(
                        batch_id=name, line=ad.line, client_id=cid if cid and len(cid) <= 64 else None, prompt_raw=r.prompt_raw, prompt=r.prompt,
                        negative_prompt=r.negative_prompt, elements=r.elements, seed=r.seed, tier=r.tier,
                        tier_requested=r.tier, frames=r.frames, fps=r.fps, width=w, height=h, priority=opts.priority,
                        state=JobState.QUEUED.value, ad_id=row.id, shot=shot.index, formats=formats,
                    ))
        if job_rows:
            session.execute(insert(Job), job_rows)
        job_ids = list(session.scalars(select(Job.id).where(Job.batch_id == name).order_by(Job.id)))
    return AdSubmitResult(name, ads, ad_ids, job_ids)
