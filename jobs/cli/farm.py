"""Farm commands: worker, beat, reconcile, cancel, retry and nightly."""

from __future__ import annotations

import os

import click

from clipmill.jobs.cli.batch import send_to_farm
from clipmill.jobs.cli.common import (EXIT_INTERRUPTED, EXIT_JOB_FAILED, BadInput, FiniteRange, SetupError, default_device,
                                      domain_errors, err, interruptible, open_db, out, redact_url, settings)


def _need_broker(what: str) -> str:
    url = settings().broker_url
    if not url:
        raise SetupError(f"CLIPMILL_BROKER_URL is not set; {what} (e.g. redis://127.0.0.1:6379/0)")
    return url


@click.command()
@click.option("--queues", type=click.Choice(["render", "preview", "post"]), required=True,
              help="render (GPU; serves previews first, between groups), preview (GPU, previews alone) or post (CPU).")
@click.option("--gpu", type=int, default=None,
              help="With --queues render or preview: the GPU this worker owns (sets CUDA_VISIBLE_DEVICES).")
@click.option("--concurrency", type=click.IntRange(1, 64), default=2, show_default=True, help="With --queues post: threads.")
@click.option("--loglevel", default="INFO", show_default=True)
def worker(queues, gpu, concurrency, loglevel):
    """Run a farm worker (needs CLIPMILL_BROKER_URL and a shared CLIPMILL_DATABASE_URL).

    A render worker is one process per GPU (solo pool: CUDA cannot be re-initialised in forked
    children); it keeps the model warm and renders groups of up to CLIPMILL_GROUP_SIZE (default 4)
    compatible queued jobs.
    Between two groups it takes a waiting streaming preview first (the preview queue, at top
    priority) and streams it until its page closes (or CLIPMILL_PREVIEW_MAX seconds). A
    preview worker streams previews alone. A post worker interpolates, encodes, checks and
    stores, on threads.

    \b
    Example:
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill worker --queues render --gpu 0
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill worker --queues preview --gpu 1
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill worker --queues post --concurrency 4
    """
    _need_broker("a worker needs the broker")
    from clipmill.jobs.farm.app import app

    if gpu is not None:
        if queues == "post":
            raise click.UsageError("--gpu is for --queues render or preview")
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        import torch

        if not torch.cuda.is_available():  # it would render on the CPU, a hundred times slower, saying nothing
            raise SetupError(f"--gpu {gpu}: torch sees no CUDA device {gpu} on this host (CUDA_VISIBLE_DEVICES={gpu}); "
                             "a container given one GPU sees it as device 0")
    name = f"{queues}{'' if gpu is None else gpu}-{os.getpid()}@%h"
    # solo: one task at a time, and concurrency 1 so that prefetch 1 reserves no second message
    # (Celery reserves multiplier x concurrency, and concurrency defaults to the CPU count)
    pool = (["--pool", "solo", "--concurrency", "1"] if queues != "post"
            else ["--pool", "threads", "--concurrency", str(concurrency)])
    # a render worker serves the preview queue first (queue_order_strategy "priority": in order)
    consume = "preview,render" if queues == "render" else queues
    app.worker_main(["worker", "-Q", consume, "-n", name, "--loglevel", loglevel, "--without-gossip",
                     "--without-mingle", *pool])


@click.command()
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
      CLIPMILL_BROKER_URL=redis://queue:6379/0 CLIPMILL_NIGHTLY_AT=21:00 clipmill beat --schedule beat-schedule
    """
    _need_broker("beat sends its tasks through the broker")
    from clipmill.jobs.farm.app import app

    for name, entry in app.conf.beat_schedule.items():
        err.print(f"beat: {name}: {entry['task']} {entry['schedule']} {entry.get('kwargs', {})}", soft_wrap=True, markup=False)
    app.start(["beat", "--schedule", schedule_file, "--loglevel", loglevel])


@click.command()
@click.option("--stale", type=FiniteRange(0), default=600, show_default=True, help="Seconds after which a job's render or post message is sent again.")
def reconcile(stale):
    """Make the broker agree with the job table: take back jobs whose worker lease expired, send
    again queued jobs that were never sent (broker down at submit) or sent over --stale seconds
    ago, rendered clips waiting for post-processing whose post message is as old and whose
    post no live worker is doing, ads whose shots are all in but not assembled, and finished
    batches' --notify callbacks not yet sent. Safe to run any time; also run it periodically.

    \b
    Example:
      CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill reconcile
    """
    url = _need_broker("reconcile sends work to the broker")
    from clipmill.jobs.farm.dispatch import BrokerDown, reconcile as run_reconcile

    try:
        res = run_reconcile(open_db(), stale)
    except BrokerDown as e:
        raise SetupError(f"broker {redact_url(url)} unreachable: {e}")
    out.print(f"taken back {res['taken_back']}, render messages sent {res['render_sent']}, "
              f"post messages sent {res['post_sent']}, assembly messages sent {res['assemble_sent']}, "
              f"batch callbacks sent {res['notify_sent']}")


@click.command()
@click.argument("target", metavar="BATCH|JOB")
def cancel(target):
    """Cancel the queued and running jobs of a batch, or one job.

    \b
    Example:
      clipmill cancel ad-batch-20261129-210000
      clipmill cancel 3
    """
    from clipmill.jobs.core.operations import TargetError, cancel as do_cancel

    try:
        ids = do_cancel(open_db(existing=True), target)
    except TargetError as e:
        raise BadInput(str(e))
    out.print(f"cancelled {len(ids)} job(s)" + (f": {', '.join(map(str, ids))}" if ids else ""))


@click.command()
@click.argument("target", metavar="BATCH|JOB")
@click.option("--failed", is_flag=True, help="Queue failed jobs again.")
@click.option("--rejected", is_flag=True, help="Queue jobs QC rejected again (at the quality tier, with a new seed).")
@click.option("--cancelled", is_flag=True, help="Queue cancelled jobs again.")
def retry(target, failed, rejected, cancelled):
    """Queue again the jobs of a batch (or one job) in the states given, --failed, --rejected
    and/or --cancelled (at least one), for one more attempt each. Each job is queued once,
    however often this runs at the same time. In farm mode they are sent to the render queue.

    \b
    Example:
      clipmill retry ad-batch-20261129-210000 --failed
      clipmill retry ad-batch-20261129-210000 --rejected
    """
    from clipmill.jobs.core.operations import TargetError, retry as do_retry

    db = open_db(existing=True)
    try:
        ids = do_retry(db, target, failed=failed, cancelled=cancelled, rejected=rejected)
    except TargetError as e:
        raise BadInput(str(e))
    out.print(f"queued {len(ids)} job(s) again" + (f": {', '.join(map(str, ids))}" if ids else ""))
    send_to_farm(db, ids)


@click.command()
@click.option("--deadline", required=True,
              help="HH:MM (next such time in CLIPMILL_TIMEZONE, default this host's zone), +SECONDS, or an ISO date-time.")
@click.option("--out", "out_root", default="clipmill-out", show_default=True, envvar="CLIPMILL_OUT",
              help="Storage root; the report goes to OUT/reports/nightly-DATE.{md,json}.")
@click.option("--interval", type=FiniteRange(0.1, 3600), default=30.0, show_default=True, help="Farm mode: seconds between checks.")
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
    settings()  # a bad CLIPMILL_* value is one line (exit 2), before the farm's app reads them on import
    from clipmill.jobs.farm.nightly import NightlyRunning, Supervisor, parse_deadline, report_name, run_farm, single_run, write_report
    from clipmill.jobs.runner.embedded import run_batch
    from clipmill.jobs.runner.stages import WorkerContext
    from clipmill.storage import open_storage

    from clipmill.jobs.core.preflight import check_device, check_storage

    try:
        when = parse_deadline(deadline, settings().timezone)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--deadline")
    with domain_errors():
        check_storage(out_root)
        if not settings().farm:
            device = check_device(device or default_device())
    db = open_db()
    if not settings().farm:
        # rendering here: QC's thresholds, the draws and the render options from the CLIPMILL_*
        # variables, as a farm worker reads them (before, the defaults, whatever they said)
        try:
            ctx = WorkerContext.from_settings(settings(), db)
        except ValueError as e:
            raise BadInput(str(e))
        ctx.device = device
    sup = Supervisor(db, when, preview_max_s=settings().preview_max_s)
    try:
        with single_run(db), domain_errors(), interruptible():
            err.print(f"nightly run until {when.isoformat(timespec='minutes')} ({sup.time_left() / 3600:.1f} h)")
            if settings().farm:
                run_farm(db, sup, interval)
            else:
                def before_group() -> bool:
                    sup.step(1)
                    return sup.time_left() > 0

                run_batch(ctx, None, group_size, before_group=before_group)
    except NightlyRunning as e:
        raise SetupError(str(e))
    except KeyboardInterrupt:
        held = ("the render workers go on with the jobs they hold" if settings().farm else
                "the jobs being rendered went back to queued with their attempts unspent")
        err.print(f"interrupted: {held}; the next nightly run continues", markup=False, highlight=False)
        raise SystemExit(EXIT_INTERRUPTED)
    report = sup.report()
    paths = write_report(report, open_storage(out_root), report_name(report))
    out.print(f"passed {report['passed']}, rejected {report['rejected']}, failed {report['failed']}, "
              f"not finished {report['not_finished']}, tier changes {len(report['tier_changes'])}")
    for p in paths:
        out.print(f"report: {p}", soft_wrap=True)
    if report["failed"]:
        raise SystemExit(EXIT_JOB_FAILED)
