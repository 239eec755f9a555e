"""The ``clipmill`` command line: a thin layer over jobs.batches, jobs.embedded and qc.

Domain errors become ``click.ClickException`` here and nowhere else.
"""

from __future__ import annotations

import functools
from dataclasses import replace
import json
import logging
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jobs.batches import (SubmitError, SubmitOptions, SubmitResult, batch_status, batch_summary, check_file, list_batches,
                          submit)
from jobs.prompts import BatchFile, BatchInvalid, Defaults, parse_size
from pipeline.models import TINY, TINY_MODELS, TINY_WARNING, ModelError
from pipeline.sampler import SAMPLERS, TIERS

err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _db():
    from jobs.db import Database

    return Database()


def batch_options(fn):
    """Options shared by run, submit and prompts check."""

    @click.option("--model", default=TINY, show_default=True, envvar="CLIPMILL_MODEL",
                  help="'tiny' or 'tiny-wan' (random weights, smoke runs only), or a local diffusers AnimateDiff or Wan folder.")
    @click.option("--template", default=None,
                  help='Build each prompt from columns, e.g. "{dish} on a table in {store}, {camera}".')
    @click.option("--truncate", is_flag=True, help="Cut prompts longer than the tokenizer's limit instead of refusing them.")
    @click.option("--tier", type=click.Choice(list(TIERS)), default="fast", show_default=True,
                  help="Tier for rows without a tier column: fast = 6 steps, quality = 8 steps.")
    @click.option("--frames", type=int, default=None,
                  help="Frames to render, for rows without frames [default: the model's, 16 for AnimateDiff, 17 for Wan].")
    @click.option("--fps", type=int, default=30, show_default=True, help="Output frame rate, for rows without fps.")
    @click.option("--size", default=None, help="WIDTHxHEIGHT for rows without size [default: the model's].")
    @functools.wraps(fn)
    def wrapper(*args, model, template, truncate, tier, frames, fps, size, **kwargs):
        opts = SubmitOptions(model=model, template=template, truncate=truncate)
        size_t = None
        if size is not None or frames is not None:
            try:
                from pipeline.models import model_info

                info = model_info(model)
            except ModelError as e:
                raise click.ClickException(str(e))
            if size is not None:
                size_t, msg = parse_size(size, info)
                if msg:
                    raise click.BadParameter(f"{size!r} {msg}", param_hint="--size")
            if frames is not None and (msg := info.check_frames(frames)):
                raise click.BadParameter(f"{frames}: {msg}", param_hint="--frames")
        opts.defaults = Defaults(tier=tier, frames=frames, fps=fps, size=size_t)
        return fn(*args, opts=opts, **kwargs)

    return wrapper


def submit_options(fn):
    """Options that only matter once jobs are written."""

    @click.option("--out", default="clipmill-out", show_default=True, envvar="CLIPMILL_OUT",
                  help="Storage root: clips go under OUT/BATCH/JOB/.")
    @click.option("--batch", "batch_name", default=None, help="Batch name [default: FILE's stem and the time].")
    @click.option("--skip-invalid", is_flag=True, help="Submit the valid rows and list the invalid ones (default: all or nothing).")
    @click.option("--sampler", type=click.Choice(SAMPLERS), default=None,
                  help="lightning (Euler, trailing) or lcm [default: what the model folder's scheduler is].")
    @click.option("--guidance", type=float, default=1.0, show_default=True, help="CFG scale; 1.0 turns guidance off (distilled models).")
    @click.option("--max-attempts", type=int, default=2, show_default=True, help="Render tries per job before it fails.")
    @click.option("--priority", type=int, default=0, show_default=True, help="Higher goes first.")
    @functools.wraps(fn)
    def wrapper(*args, opts: SubmitOptions, out, batch_name, skip_invalid, sampler, guidance, max_attempts, priority, **kw):
        opts.out, opts.batch, opts.skip_invalid = out, batch_name, skip_invalid
        opts.sampler, opts.guidance, opts.max_attempts, opts.priority = sampler, guidance, max_attempts, priority
        return fn(*args, opts=opts, **kw)

    return wrapper


def _warn_model(opts: SubmitOptions) -> None:
    if opts.model in TINY_MODELS:
        err.print(f"[yellow]warning:[/] {TINY_WARNING.format(name=opts.model)}", soft_wrap=True)
    if opts.guidance > 6.0:
        err.print(
            f"[yellow]warning:[/] --guidance {opts.guidance:g}: distilled few-step models over-expose "
            "(blown-out, saturated frames) above about 6; they are made for 1.0-2.0",
            soft_wrap=True,
        )


def _report(bf: BatchFile) -> None:
    for w in bf.warnings:
        err.print(f"[yellow]warning:[/] {escape(str(w))}", soft_wrap=True)


def _submit(path: str, opts: SubmitOptions, farm: bool = False) -> SubmitResult:
    db = _db()
    try:
        res = submit(db, path, opts)
    except BatchInvalid as e:
        _report(e.batch)
        raise click.ClickException(str(e))
    except (SubmitError, ModelError) as e:
        raise click.ClickException(str(e))
    _report(res.file)
    if farm:
        _send_to_farm(db, res.job_ids)
    if res.file.errors:
        err.print(f"[yellow]skipped {len(res.file.bad_lines)} invalid row(s):[/]")
        for p in res.file.errors:
            err.print(f"  {p}", soft_wrap=True, markup=False)
    err.print(f"batch [bold]{res.batch_id}[/]: {len(res.job_ids)} job(s) queued in {db.url}")
    return res


def _send_to_farm(db, job_ids: list[int]) -> None:
    """In farm mode (CLIPMILL_BROKER_URL set), send the committed jobs to the render queue."""
    from jobs.celery_app import broker_url

    if not broker_url() or not job_ids:
        return
    from jobs.dispatch import BrokerDown, send_render

    try:
        n = send_render(db, job_ids)
        err.print(f"sent {n} job(s) to the render queue at {broker_url()}", soft_wrap=True)
    except BrokerDown as e:
        err.print(f"[yellow]warning:[/] broker {broker_url()} unreachable ({escape(str(e))}); the jobs stay queued "
                  "in the database: run `clipmill reconcile` once it is back", soft_wrap=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="clipmill")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--log-json", is_flag=True, envvar="CLIPMILL_LOG_JSON", help="Log one JSON object per line, with batch/job/attempt ids.")
def main(verbose: int, log_json: bool) -> None:
    """Bulk-render short ad clips from prompt batches, check them, and store them.

    \b
    Example:
      clipmill run examples/ad-batch.csv      # embedded: SQLite, no broker
      clipmill status

    The job table is SQLite at ./clipmill.db unless CLIPMILL_DATABASE_URL says otherwise.
    """
    from jobs.logs import setup

    setup(max(logging.WARNING - 10 * verbose, logging.DEBUG), log_json)


def _qc_config(config: str | None, sets: tuple[str, ...]):
    from qc import QCConfig

    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--set")
        overrides[key.strip()] = value.strip()
    try:
        return QCConfig.load(config, overrides)
    except ValueError as e:
        raise click.ClickException(str(e))


def qc_config_options(fn):
    @click.option("--qc-config", "qc_config", type=click.Path(dir_okay=False), default=None,
                  envvar="CLIPMILL_QC_CONFIG", help="TOML file of QC thresholds (keys of qc.QCConfig).")
    @click.option("--set", "qc_set", multiple=True, metavar="KEY=VALUE", help="Override one QC threshold; repeatable.")
    @functools.wraps(fn)
    def wrapper(*args, qc_config, qc_set, **kw):
        return fn(*args, qc_cfg=_qc_config(qc_config, qc_set), **kw)

    return wrapper


@main.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--resume", "resume", default=None, metavar="BATCH",
              help="Finish an existing batch (after a crash or a submit) instead of reading FILE.")
@click.option("--group-size", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Compatible jobs rendered in one call.")
@click.option("--device", default=None, help="torch device [default: cuda if available, else cpu].")
@batch_options
@submit_options
@qc_config_options
@click.option("--feature-cache/--no-feature-cache", default=False, envvar="CLIPMILL_FEATURE_CACHE", show_default=True,
              help="Approximate step-feature caching (DeepCache on AnimateDiff, FirstBlockCache on Wan); see README.")
@click.option("--guidance-mode", type=click.Choice(["cfg", "rcfg-self", "rcfg-onetime"]), default="cfg",
              envvar="CLIPMILL_GUIDANCE_MODE", show_default=True, help="How guidance above 1.0 is computed.")
@click.option("--decoder", type=click.Choice(["vae", "tiny"]), default="vae", envvar="CLIPMILL_DECODER", show_default=True,
              help="tiny: the model folder's AutoencoderTiny (vae_tiny/), faster and rougher.")
@click.option("--compile", "compile_how", type=click.Choice(["none", "torch", "tensorrt"]), default="none",
              envvar="CLIPMILL_COMPILE", show_default=True, help="Compile the denoiser (GPU only).")
def run(file, resume, group_size, device, opts: SubmitOptions, qc_cfg, feature_cache, guidance_mode, decoder, compile_how):
    """Submit FILE and render, post-process and QC it in this process.

    Exits 0 when the batch completed, even if QC rejected clips; 1 on bad input.

    \b
    Example:
      clipmill run examples/ad-batch.csv --template "{dish} on a table in {store}, {camera}"
      clipmill run --resume ad-batch-20261129-210000
    """
    from jobs.embedded import run_batch
    from jobs.stages import WorkerContext

    if (file is None) == (resume is None):
        raise click.UsageError("give FILE or --resume BATCH (one of them)")
    if resume is None:
        _warn_model(opts)
        batch_id = _submit(file, opts).batch_id
    else:
        batch_id = resume
    db = _db()
    try:
        info = batch_summary(db, batch_id)
    except SubmitError as e:
        raise click.ClickException(str(e))
    if resume is not None and info["model"] in TINY_MODELS:
        err.print(f"[yellow]warning:[/] {TINY_WARNING.format(name=info['model'])}", soft_wrap=True)
    device = device or _default_device()
    from pipeline.guidance import effective_mode
    from pipeline.render import RenderOptions

    try:
        effective_mode(guidance_mode, info["guidance"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--guidance-mode")

    ctx = WorkerContext(db, device=device, qc_config=qc_cfg, guidance_mode=guidance_mode,
                        render_options=RenderOptions(feature_cache=feature_cache, decoder=decoder, compile=compile_how))
    todo = sum(info["states"][s] for s in ("queued", "rendering", "post"))
    t0 = time.perf_counter()
    with Progress(
        TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=False,
    ) as progress:
        render_t = progress.add_task("render", total=todo)
        steps_t = progress.add_task("  steps", total=1)
        qc_t = progress.add_task("post+qc", total=todo)

        class Ev:
            def group_started(self, size, steps):
                progress.update(steps_t, completed=0, total=steps, description=f"  group {size}")

            def step(self, done, total):
                progress.update(steps_t, completed=done)

            def rendered(self, n):
                task = progress.tasks[render_t]
                if task.completed + n > (task.total or 0):  # QC retries render more than once
                    progress.update(render_t, total=task.completed + n)
                    progress.update(qc_t, total=task.completed + n)
                progress.advance(render_t, n)

            def checked(self, verdict):
                progress.advance(qc_t, 1)

        try:
            run_batch(ctx, batch_id, group_size, Ev())
        except ModelError as e:
            raise click.ClickException(str(e))
    wall = time.perf_counter() - t0
    _summary(batch_status(db, batch_id), wall)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _summary(st: dict, wall: float) -> None:
    s = st["states"]
    done = s["passed"] + s["rejected"] + s["failed"]
    t = Table(title=f"batch {st['batch']}", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("passed", f"[green]{s['passed']}[/]" + (f" ({st['passed_on_retry']} on a retry)" if st["passed_on_retry"] else ""))
    t.add_row("rejected by QC", f"[yellow]{s['rejected']}[/]" + (f" (out of attempts: {st['max_attempts']} each)" if s["rejected"] else ""))
    t.add_row("failed", f"[red]{s['failed']}[/]")
    if s["queued"] + s["rendering"] + s["post"]:
        t.add_row("still open", str(s["queued"] + s["rendering"] + s["post"]))
    t.add_row("wall time", f"{wall:.1f} s")
    t.add_row("seconds per clip", f"{wall / done:.2f}" if done else "-")
    t.add_row("files", str(Path(st["out"]) / st["batch"]) if "://" not in st["out"] else f"{st['out']}/{st['batch']}")
    out.print(t)
    rejected = [r for r in st["rows"] if r["state"] in ("rejected", "failed")]
    for r in rejected[:20]:
        why = "; ".join(r["reasons"]) or (r["error"] or "")
        out.print(f"  job {r['job']} (line {r['line']}) {r['state']}: {why}", soft_wrap=True, markup=False)


@main.command()
@click.option("--queues", type=click.Choice(["render", "post"]), required=True, help="render (GPU) or post (CPU).")
@click.option("--gpu", type=int, default=None, help="With --queues render: the GPU this worker owns (sets CUDA_VISIBLE_DEVICES).")
@click.option("--concurrency", type=click.IntRange(1, 64), default=2, show_default=True, help="With --queues post: threads.")
@click.option("--loglevel", default="INFO", show_default=True)
def worker(queues, gpu, concurrency, loglevel):
    """Run a farm worker (needs CLIPMILL_BROKER_URL and a shared CLIPMILL_DATABASE_URL).

    A render worker is one process per GPU (solo pool: CUDA cannot be re-initialised in forked
    children); it keeps the model warm and renders groups of up to 4 compatible queued jobs.
    A post worker interpolates, encodes, checks and stores, on threads.

    \b
    Example:
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill worker --queues render --gpu 0
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill worker --queues post --concurrency 4
    """
    from jobs.celery_app import app, broker_url

    if not broker_url():
        raise click.ClickException("CLIPMILL_BROKER_URL is not set; a worker needs the broker (e.g. redis://127.0.0.1:6379/0)")
    if gpu is not None:
        if queues != "render":
            raise click.UsageError("--gpu is for --queues render")
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    name = f"{queues}{'' if gpu is None else gpu}-{os.getpid()}@%h"
    # solo: one task at a time, and concurrency 1 so that prefetch 1 reserves no second message
    # (Celery reserves multiplier x concurrency, and concurrency defaults to the CPU count)
    pool = (["--pool", "solo", "--concurrency", "1"] if queues == "render"
            else ["--pool", "threads", "--concurrency", str(concurrency)])
    app.worker_main(["worker", "-Q", queues, "-n", name, "--loglevel", loglevel, "--without-gossip",
                     "--without-mingle", *pool])


@main.command()
@click.option("--schedule", "schedule_file", default="celerybeat-schedule", show_default=True,
              help="File where beat keeps the last run of each entry.")
@click.option("--loglevel", default="INFO", show_default=True)
def beat(schedule_file, loglevel):
    """Send the farm's periodic tasks (run exactly one per farm): reconcile every
    CLIPMILL_RECONCILE_EVERY seconds (default 60; 0 turns it off) with CLIPMILL_RECONCILE_STALE
    (600), and with CLIPMILL_NIGHTLY_AT=HH:MM the nightly run every day at that time, draining
    the queue by CLIPMILL_NIGHTLY_DEADLINE (default 07:00). Times of day are in
    CLIPMILL_TIMEZONE (default this host's zone). Post workers run both tasks.

    \b
    Example:
      CLIPMILL_NIGHTLY_AT=21:00 CLIPMILL_NIGHTLY_DEADLINE=07:00 clipmill beat --schedule /data/beat-schedule
    """
    from jobs.celery_app import SCHEDULE_ERROR, app, broker_url

    if not broker_url():
        raise click.ClickException("CLIPMILL_BROKER_URL is not set; beat sends its tasks through the broker")
    if SCHEDULE_ERROR is not None:
        raise click.ClickException(str(SCHEDULE_ERROR))
    for name, entry in app.conf.beat_schedule.items():
        err.print(f"beat: {name}: {entry['task']} {entry['schedule']} {entry.get('kwargs', {})}", soft_wrap=True, markup=False)
    app.start(["beat", "--schedule", schedule_file, "--loglevel", loglevel])


@main.command()
@click.option("--stale", type=float, default=600, show_default=True, help="Seconds after which a sent job is sent again.")
def reconcile(stale):
    """Make the broker agree with the job table: take back jobs whose worker lease expired, send
    again queued jobs that were never sent (broker down at submit) or sent long ago, and rendered
    clips still waiting for post-processing. Safe to run any time; also run it periodically.

    \b
    Example:
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill reconcile
    """
    from jobs.celery_app import broker_url
    from jobs.dispatch import BrokerDown, reconcile as run_reconcile

    if not broker_url():
        raise click.ClickException("CLIPMILL_BROKER_URL is not set; reconcile sends work to the broker")
    try:
        res = run_reconcile(_db(), stale)
    except BrokerDown as e:
        raise click.ClickException(f"broker {broker_url()} unreachable: {e}")
    out.print(f"taken back {res['taken_back']}, render messages sent {res['render_sent']}, "
              f"post messages sent {res['post_sent']}")


@main.command()
@click.argument("target", metavar="BATCH|JOB")
def cancel(target):
    """Cancel the queued and running jobs of a batch, or one job.

    \b
    Example:
      clipmill cancel ad-batch-20261129-210000
      clipmill cancel 42
    """
    from jobs.operations import TargetError, cancel as do_cancel

    try:
        ids = do_cancel(_db(), target)
    except TargetError as e:
        raise click.ClickException(str(e))
    out.print(f"cancelled {len(ids)} job(s)" + (f": {', '.join(map(str, ids))}" if ids else ""))


@main.command()
@click.argument("target", metavar="BATCH|JOB")
@click.option("--failed", is_flag=True, help="Queue failed jobs again.")
@click.option("--cancelled", is_flag=True, help="Queue cancelled jobs again.")
def retry(target, failed, cancelled):
    """Queue the failed (or cancelled) jobs of a batch, or one job, again for one more attempt.
    In farm mode they are sent to the render queue.

    \b
    Example:
      clipmill retry ad-batch-20261129-210000 --failed
    """
    from jobs.operations import TargetError, retry as do_retry

    db = _db()
    try:
        ids = do_retry(db, target, failed=failed, cancelled=cancelled)
    except TargetError as e:
        raise click.ClickException(str(e))
    out.print(f"queued {len(ids)} job(s) again" + (f": {', '.join(map(str, ids))}" if ids else ""))
    _send_to_farm(db, ids)


@main.command()
@click.option("--deadline", required=True, help="HH:MM (next such local time), +SECONDS, or an ISO date-time.")
@click.option("--out", "out_root", default="clipmill-out", show_default=True, envvar="CLIPMILL_OUT",
              help="Storage root; the report goes to OUT/reports/nightly-DATE.{md,json}.")
@click.option("--interval", type=float, default=30.0, show_default=True, help="Farm mode: seconds between checks.")
@click.option("--group-size", type=click.IntRange(1, 16), default=4, show_default=True, help="Embedded mode: jobs per render call.")
@click.option("--device", default=None, help="Embedded mode: torch device.")
def nightly(deadline, out_root, interval, group_size, device):
    """Drain the queue by a deadline, moving `quality` jobs to `fast` when the measured render
    speed says the rest will not fit (and back when there is time), then write the morning
    report (Markdown and JSON): clips produced, passed, rejected and failed, GPU-seconds per
    passed clip, every tier change and why, every failure with its reason.

    In farm mode (CLIPMILL_BROKER_URL set) it supervises the workers and runs reconcile;
    otherwise it renders here. The Celery beat starts it in the evening when CLIPMILL_NIGHTLY_AT
    is set (see `clipmill beat`); a cron entry can too.

    \b
    Example:
      clipmill nightly --deadline 07:00
    """
    from jobs.celery_app import broker_url
    from jobs.nightly import Supervisor, parse_deadline, report_name, write_report
    from storage import open_storage

    try:
        when = parse_deadline(deadline)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--deadline")
    db = _db()
    sup = Supervisor(db, when)
    from jobs.nightly import NightlyRunning, single_run

    try:
        with single_run(db):
            err.print(f"nightly run until {when.isoformat(timespec='minutes')} ({sup.time_left() / 3600:.1f} h)")
            if broker_url():
                from jobs.nightly import run_farm

                run_farm(db, sup, interval)
            else:
                from jobs.embedded import run_batch
                from jobs.stages import WorkerContext

                ctx = WorkerContext(db, device=device or _default_device())

                def before_group() -> bool:
                    sup.step(1)
                    return sup.time_left() > 0

                run_batch(ctx, None, group_size, before_group=before_group)
    except NightlyRunning as e:
        raise click.ClickException(str(e))
    report = sup.report()
    paths = write_report(report, open_storage(out_root), report_name(report))
    out.print(f"passed {report['passed']}, rejected {report['rejected']}, failed {report['failed']}, "
              f"not finished {report['not_finished']}, tier changes {len(report['tier_changes'])}")
    for p in paths:
        out.print(f"report: {p}", soft_wrap=True)


@main.command("submit")
@click.argument("file", type=click.Path(dir_okay=False))
@batch_options
@submit_options
def submit_cmd(file, opts: SubmitOptions):
    """Validate FILE and queue its jobs in the job table, rendering nothing.

    All or nothing: a file with a bad row leaves the database unchanged, unless --skip-invalid.
    With CLIPMILL_BROKER_URL set, the committed jobs are then sent to the farm's render queue
    (if the broker is down they stay queued; `clipmill reconcile` sends them later); without it,
    `clipmill run --resume BATCH` renders them here.

    \b
    Example:
      clipmill submit examples/ad-batch.csv --batch friday-ads --tier quality
    """
    _warn_model(opts)
    res = _submit(file, opts, farm=True)
    out.print(res.batch_id)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


@main.command()
@click.argument("batch", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--watch", type=click.FloatRange(0.5, 3600), default=None, metavar="SECONDS",
              help="With BATCH: print progress and ETA every SECONDS until no job is open.")
@click.option("--limit", type=click.IntRange(0), default=200, show_default=True,
              help="With BATCH: jobs in the table (0: all); --json always lists every job.")
def status(batch, as_json, watch, limit):
    """Show batches, or one BATCH's jobs with their attempts, verdicts and files, its progress
    and an ETA from its own pace so far.

    \b
    Example:
      clipmill status
      clipmill status ad-batch-20261129-210000 --json
      clipmill status ad-batch-20261129-210000 --watch 10
    """
    db = _db()
    if watch is not None:
        if batch is None:
            raise click.UsageError("--watch needs a BATCH")
        import time as _time

        while True:
            try:
                st = batch_summary(db, batch)
            except SubmitError as e:
                raise click.ClickException(str(e))
            p = st["progress"]
            s = st["states"]
            out.print(f"{batch}: {p['done']}/{st['jobs']} done (passed {s['passed']}, rejected {s['rejected']}, "
                      f"failed {s['failed']}), {p['open']} open, elapsed {_duration(p['elapsed_s'])}, "
                      f"ETA {_duration(p['eta_s'])}", soft_wrap=True)
            if not p["open"]:
                return
            _time.sleep(watch)
    if batch is None:
        rows = list_batches(db)
        if as_json:
            out.print_json(data=rows) if sys.stdout.isatty() else click.echo(json.dumps(rows))
            return
        t = Table("batch", "jobs", "queued", "running", "passed", "rejected", "failed", "created")
        for r in rows:
            s = r["states"]
            t.add_row(r["batch"], str(r["jobs"]), str(s["queued"]), str(s["rendering"] + s["post"]),
                      str(s["passed"]), str(s["rejected"]), str(s["failed"]), r["created_at"][:19])
        out.print(t)
        return
    try:
        st = batch_status(db, batch, limit=None if as_json or not limit else limit)
    except SubmitError as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(st, ensure_ascii=False))
        return
    t = Table("job", "id", "line", "state", "tries", "tier", "seed", "verdict / reasons", "clip", title=f"batch {batch}")
    for r in st["rows"]:
        why = r["verdict"] or ""
        if r["reasons"]:
            why += ": " + "; ".join(r["reasons"])
        elif r["error"]:
            why = r["error"]
        if r["passed_on_retry"]:
            why = f"passed on retry {len(r['attempts'])} (" + "; ".join(
                f"a{a['number']} {a['tier']} {a['verdict'] or a['state']}" for a in r["attempts"]) + ")"
        elif r["out_of_attempts"]:
            why = f"out of attempts ({len(r['attempts'])}/{st['max_attempts']}): " + why
        last = r["attempts"][-1] if r["attempts"] else None
        t.add_row(str(r["job"]), r["id"] or "", str(r["line"]), r["state"], str(len(r["attempts"])),
                  last["tier"] if last else r["tier"], str(last["seed"] if last else r["seed"]), why, r["location"] or "")
    out.print(t)
    if len(st["rows"]) < st["jobs"]:
        out.print(f"{st['jobs'] - len(st['rows'])} more job(s) not shown (--limit 0 shows all)")
    s = st["states"]
    out.print(" ".join(f"{k}={v}" for k, v in s.items() if v)
              + f"; passed on a retry: {st['passed_on_retry']}; out of attempts: {st['out_of_attempts']}")
    p = st["progress"]
    out.print(f"progress: {p['done']}/{st['jobs']} done, {p['open']} open, elapsed {_duration(p['elapsed_s'])}, "
              f"ETA {_duration(p['eta_s'])}")


@main.command()
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="JSON Lines: one {path, verdict, reasons, metrics} per file.")
@click.option("--explain", is_flag=True, help="Also print the metric curves over time (with --json: a 'series' key).")
@click.option("--sheet", is_flag=True, help="Write a contact sheet PNG (frames and metric curves) beside each file.")
@click.option("--bench", is_flag=True, help="Measure QC instead: confusion table on the synthetic labelled set, and 720p speed.")
@qc_config_options
def qc(files, as_json, explain, sheet, bench, qc_cfg):
    """Check video FILES for broken clips: flicker, garbage or block-corrupted frames, black or
    flat frames, frozen stretches, cuts, over-exposure, boiling texture, collapse into blur.

    Frames are compared with their motion-compensated neighbours, so fast pans and zooms pass.
    Exits 0 when every file could be read (whatever the verdicts), 1 otherwise.

    \b
    Example:
      clipmill qc clipmill-out/*/*/a1.mp4 --json
      clipmill qc clip.mp4 --explain --sheet --set min_pair_ssim=0.4
      clipmill qc --bench
    """
    if bench:
        _qc_bench(qc_cfg, as_json)
        return
    if not files:
        raise click.UsageError("give one or more FILES, or --bench")
    from pipeline.video import VideoError, decode
    from qc import check_frames_with_series
    from qc.report import contact_sheet, explain_lines

    unreadable = 0
    for f in files:
        series = None
        try:
            frames, fps = decode(f)
            res, series = check_frames_with_series(frames, fps, qc_cfg)
            rec = {"path": f, "verdict": res.verdict, "reasons": res.reasons, "metrics": res.metrics}
            if sheet:
                Path(f + ".sheet.png").write_bytes(contact_sheet(frames, series, res))
        except (VideoError, FileNotFoundError, IsADirectoryError) as e:
            unreadable += 1
            rec = {"path": f, "verdict": "reject", "reasons": [f"unreadable: {e}"], "metrics": {}}
        if as_json:
            if explain and series is not None:
                rec["series"] = series.as_lists()
            click.echo(json.dumps(rec, ensure_ascii=False))
            continue
        colour = "green" if rec["verdict"] == "pass" else "red"
        out.print(f"[{colour}]{rec['verdict']}[/] {escape(f)}", soft_wrap=True)
        for r in rec["reasons"]:
            out.print(f"    {r}", markup=False, soft_wrap=True)
        if explain and series is not None:
            for line in explain_lines(series, fps):
                out.print("    " + line, markup=False, soft_wrap=True)
    if unreadable:
        sys.exit(1)


def _qc_bench(cfg, as_json: bool) -> None:
    from qc.bench import confusion, speed_720p

    with err.status("QC on the synthetic labelled set (good and broken clips)..."):
        conf = confusion(cfg)
    with err.status("QC speed on a 5-second 720p clip..."):
        speed = speed_720p(cfg)
    if as_json:
        click.echo(json.dumps({"confusion": conf, "speed": speed}))
        return
    t = Table("", "QC pass", "QC reject", title=f"QC on {conf['good_passed'] + conf['good_rejected']} good and "
              f"{conf['broken_rejected'] + conf['broken_passed']} broken clips (seeds {conf['seeds']}, {conf['size']})")
    t.add_row("good", str(conf["good_passed"]), str(conf["good_rejected"]))
    t.add_row("broken", str(conf["broken_passed"]), str(conf["broken_rejected"]))
    out.print(t)
    out.print(f"broken caught: {conf['broken_caught']:.1%}   good falsely rejected: {conf['good_false_reject']:.1%}")
    out.print("caught per defect: " + ", ".join(f"{k} {v}" for k, v in conf["per_defect"].items()))
    for m in conf["misses"]:
        out.print(f"  miss: {m['clip']} -> {m['verdict']} {'; '.join(m['reasons'])}", markup=False, soft_wrap=True)
    out.print(f"speed, {speed['clip']}: decode {speed['decode_s']} s + QC {speed['qc_s']} s = {speed['total_s']} s")


@main.command()
@click.argument("src", required=False, type=click.Path(dir_okay=False))
@click.argument("dst", required=False, type=click.Path(dir_okay=False))
@click.option("--fps", type=click.FloatRange(1, 240), default=None, help="Output frame rate (any ratio to the input's).")
@click.option("--bench", is_flag=True, help="Measure instead: PSNR of interpolated frames against dropped ground truth, "
              "vs linear blending and frame repetition, and speed at 720p.")
@click.option("--json", "as_json", is_flag=True, help="With --bench: print JSON.")
def interpolate(src, dst, fps, bench, as_json):
    """Convert SRC to --fps N by optical-flow frame interpolation; write DST as H.264 MP4.

    DST has exactly round((n-1)*N/fps_in)+1 frames and starts on SRC's first frame. At a cut
    the nearest frame is repeated instead of blending two scenes.

    \b
    Example:
      clipmill interpolate clip24.mp4 clip60.mp4 --fps 60
      clipmill interpolate --bench
    """
    if bench:
        _interp_bench(as_json)
        return
    if not (src and dst and fps):
        raise click.UsageError("give SRC DST --fps N, or --bench")
    from pipeline.interpolate import interpolate as interp
    from pipeline.video import VideoError, decode, encode_h264

    try:
        frames, fps_in = decode(src)
    except (VideoError, FileNotFoundError) as e:
        raise click.ClickException(str(e))
    if fps_in <= 0:
        raise click.ClickException(f"{src}: the file states no frame rate")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise click.ClickException(f"{src}: {frames.shape[2]}x{frames.shape[1]} has an odd side; H.264 yuv420p needs even sides")
    t0 = time.perf_counter()
    with Progress(TextColumn("interpolate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err) as p:
        task = p.add_task("", total=None)
        out_frames = interp(frames, fps_in, fps, progress=lambda d, t: p.update(task, completed=d, total=t))
    encode_h264(out_frames, fps, dst)
    secs = time.perf_counter() - t0
    err.print(f"{src}: {len(frames)} frames at {fps_in:g} fps -> {dst}: {len(out_frames)} frames at {fps:g} fps "
              f"({len(out_frames) / secs:.1f} frames/s)")


def _interp_bench(as_json: bool) -> None:
    from pipeline.interp_eval import evaluate, speed_720p

    with err.status("interpolating dropped frames of smooth 120 fps sequences..."):
        res = evaluate()
    with err.status("speed at 720p..."):
        speed = speed_720p()
    if as_json:
        click.echo(json.dumps({"quality": res, "speed": speed}))
        return
    t = Table("case", "in -> out fps", "new frames", "PSNR flow", "linear", "repeat", "gain vs linear", "gain vs repeat",
              title=f"interpolated vs dropped frames ({res['size']})")
    for r in res["rows"]:
        t.add_row(r["case"], f"{r['fps_in']} -> {r['fps_out']}", str(r["new_frames"]), f"{r['psnr_flow']:.2f}",
                  f"{r['psnr_linear']:.2f}", f"{r['psnr_repeat']:.2f}", f"{r['gain_vs_linear']:+.2f} dB",
                  f"{r['gain_vs_repeat']:+.2f} dB")
    out.print(t)
    out.print(f"mean gain: {res['mean_gain_vs_linear']:+.2f} dB over linear blending, "
              f"{res['mean_gain_vs_repeat']:+.2f} dB over frame repetition")
    out.print(f"speed, {speed['clip']}: {speed['seconds']} s, {speed['output_fps']} output frames/s")


@main.command("bench")
@click.option("--model", default=TINY, show_default=True, help="'tiny', 'tiny-wan' or a local diffusers model folder.")
@click.option("--arch", type=click.Choice(["sd15"]), default=None,
              help="Instead of --model: build this full-size architecture with random weights (GPU figures "
                   "without a download; about 38 s per UNet call on a 2-core CPU).")
@click.option("--size", default=None, help="WIDTHxHEIGHT or N [default: 128 for tiny models, else the model's default size, 512 for --arch sd15].")
@click.option("--frames", type=int, default=None, help="Frames per clip [default: the model's].")
@click.option("--guidance", type=float, default=1.0, show_default=True,
              help="Guidance of rows 1-7 (1.0: off, as distilled models run; row 0 always uses CFG, 7.5, or 5.0 on Wan).")
@click.option("--clips", type=click.IntRange(4, 16), default=4, show_default=True, help="Clips per row (row 0 renders one).")
@click.option("--repeat", type=click.IntRange(1, 10), default=3, show_default=True,
              help="Rounds over all rows, interleaved; each row reports its fastest round (and all of them).")
@click.option("--compile", "compile_how", type=click.Choice(["torch", "tensorrt"]), default="torch", show_default=True,
              help="What row 7 compiles with (GPU only; elsewhere row 7 says why and runs uncompiled).")
@click.option("--device", default=None, help="cpu, cuda or cuda:N [default: cuda if available].")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def bench_cmd(model, arch, size, frames, guidance, clips, repeat, compile_how, device, as_json):
    """Measure the speed ladder: 50-step baseline to distilled, cached, batched rendering.

    Every row is measured side by side in this one run: seconds per clip (render and end to
    end, with interpolation, H.264 and QC), speed-up over row 0, PSNR against the row it adds a
    layer to, peak memory, and the denoiser evaluations, K/V projections and blocks each row did
    or skipped. Absolute seconds mean something only on a GPU; on a CPU read the ratios.

    \b
    Example:
      clipmill bench --model tiny --json
      clipmill bench --arch sd15 --device cuda --size 512 --frames 16
    """
    from jobs.bench import bench
    from pipeline.models import arch_path, model_info

    device = device or _default_device()
    try:
        info = model_info(str(arch_path(arch)) if arch else model)
        if arch:
            info = replace(info, name=f"arch:{arch}")
        size_t = (128, 128) if size is None and info.is_tiny else info.default_size
        if size is not None:
            size_t, msg = parse_size(size, info)
            if msg:
                raise click.BadParameter(f"{size!r} {msg}", param_hint="--size")
        n_frames = frames or info.default_frames
        if msg := info.check_frames(n_frames):
            raise click.BadParameter(f"{n_frames}: {msg}", param_hint="--frames")
        result = bench(info, size_t, n_frames, guidance, device, compile_how, clips, repeat,
                       progress=None if as_json else (lambda m: err.print(f"[dim]{m}[/]")))
    except (ModelError, ValueError) as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps(result))
        return
    t = Table("row", "what", "evals/clip", "render s/clip", "end-to-end s/clip", "speed-up", "e2e speed-up",
              "PSNR vs twin", "peak MiB", "skipped", title=f"{result['model']} ({result['family']}), {result['size'][0]}x"
              f"{result['size'][1]}, {result['frames']} frames, {result['device']}")
    for r in result["rows"]:
        w = r["work"]
        skipped = ", ".join(f"{k} {v}" for k, v in w.items() if k in ("kv_rows_avoided", "blocks_skipped", "cached_steps") and v)
        p = "" if r["twin"] is None else ("identical" if r["psnr_vs_twin_db"] is None else f"{r['psnr_vs_twin_db']} dB")
        t.add_row(r["row"], r["name"] + (f" [dim]({r['note']})[/]" if r["note"] else ""), f"{r['denoiser_evaluations_per_clip']:g}",
                  f"{r['render_s_per_clip']:.3f}", f"{r['end_to_end_s_per_clip']:.3f}", f"{r['speedup_render']:.1f}x",
                  f"{r['speedup_end_to_end']:.1f}x", p, f"{r['peak_memory_mib']:.0f}", skipped)
    out.print(t)
    out.print(f"best: row {result['best_row']}, {result['best_speedup_render']}x render, "
              f"{result['best_speedup_end_to_end']}x end to end ({result['seconds']} s in all)")
    for g in result["guidance_modes"]:
        p = "reference" if g["psnr_vs_cfg_db"] is None and g["mode"] == "cfg" else f"{g['psnr_vs_cfg_db']} dB vs CFG"
        out.print(f"guidance {g['mode']} {g['guidance']:g}: {g['render_s_per_clip']:.3f} s/clip, "
                  f"{g['denoiser_evaluations_per_clip']:g} evals/clip, {p}")
    for d in result["decoders"]:
        out.print(f"decoder {d['decoder']}: {d['decode_s_per_clip']:.3f} s/clip"
                  + ("" if d["psnr_vs_vae_db"] is None else f", {d['psnr_vs_vae_db']} dB vs the VAE"))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@main.command()
@click.argument("batch", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback needs a token.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--token", envvar="CLIPMILL_REVIEW_TOKEN", default=None,
              help="Require this token (open /?token=TOKEN once, or send 'Authorization: Bearer TOKEN').")
def review(batch, host, port, token):
    """Serve the review page: play QC survivors, approve (a) or decline (d), move with j/k.

    Rejected clips can be shown with their reasons and contact sheets, and approved as an
    override; every decision is recorded. Two operators never overwrite each other silently.

    \b
    Example:
      clipmill review ad-batch-20261129-210000
      clipmill review --host 0.0.0.0 --port 8080 --token "$(openssl rand -hex 16)"
    """
    from jobs.web import serve

    if host not in LOOPBACK and not token:
        raise click.ClickException(
            f"--host {host}: binding beyond this machine needs --token (or CLIPMILL_REVIEW_TOKEN)"
        )
    if token is not None and len(token) < 12:
        raise click.ClickException("--token: use at least 12 characters")
    db = _db()
    if batch is not None:
        try:
            batch_summary(db, batch)
        except SubmitError as e:
            raise click.ClickException(str(e))
    where = f"http://{host}:{port}/" + (f"batch/{batch}" if batch else "")
    err.print(f"review at {where}" + (" (token required)" if token else ""), soft_wrap=True)
    serve(db, host, port, token, batch)


@main.command()
@click.argument("batch")
@click.option("--to", "dest", required=True, metavar="DIR|s3://BUCKET/PREFIX", help="Where to deliver.")
def export(batch, dest):
    """Deliver BATCH's approved clips to a folder or S3 prefix, with manifest.csv and manifest.json.

    Files already there with the same bytes are not copied again, so a rerun copies nothing
    twice and an interrupted export resumes.

    \b
    Example:
      clipmill export ad-batch-20261129-210000 --to delivery/
      clipmill export ad-batch-20261129-210000 --to s3://ads-bucket/approved
    """
    from jobs.export import ExportError, export_batch
    from storage import StorageError

    db = _db()
    try:
        res = export_batch(db, batch, dest)
    except (ExportError, StorageError) as e:
        raise click.ClickException(str(e))
    out.print(f"{len(res.rows)} approved clip(s): {len(res.copied)} copied, {len(res.skipped)} already there")
    for m in res.manifest:
        out.print(f"manifest: {m}", soft_wrap=True)


@main.group()
def prompts():
    """Work with prompt batch files without submitting them."""


@prompts.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the cleaned rows and problems as JSON.")
@batch_options
def prompts_check(file, as_json, opts: SubmitOptions):
    """Print FILE's cleaned prompts and every problem; submit nothing.

    Exits 1 if any row is invalid.

    \b
    Example:
      clipmill prompts check examples/ad-batch.csv --template "{dish} on a table in {store}, {camera}"
    """
    try:
        _, bf = check_file(file, opts)
    except ModelError as e:
        raise click.ClickException(str(e))
    if as_json:
        click.echo(json.dumps({
            "rows": [r.__dict__ for r in bf.rows],
            "errors": [str(p) for p in bf.errors],
            "warnings": [str(p) for p in bf.warnings],
        }, ensure_ascii=False))
    else:
        t = Table("line", "id", "tier", "frames", "fps", "size", "seed", "tokens", "cleaned prompt", title=file)
        for r in bf.rows:
            t.add_row(str(r.line), r.client_id or "", r.tier, str(r.frames), str(r.fps), f"{r.width}x{r.height}",
                      str(r.seed), str(r.tokens), r.prompt)
        out.print(t)
        _report(bf)
        for p in bf.errors:
            err.print(f"[red]error:[/] {escape(str(p))}", soft_wrap=True)
        err.print(f"{len(bf.rows)} valid row(s), {len(bf.errors)} error(s), {len(bf.warnings)} warning(s)")
    if bf.errors:
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
