"""Review and delivery commands: review (the web page) and export."""

from __future__ import annotations

import os

import click

from clipmill.jobs.cli.common import EXIT_JOB_FAILED, BadInput, domain_errors, err, open_db, out
from clipmill.jobs.review import LOOPBACK


@click.command()
@click.argument("batch", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback needs a token.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--token", envvar="CLIPMILL_REVIEW_TOKEN", default=None,
              help="Require this token (open /?token=TOKEN once, or send 'Authorization: Bearer TOKEN').")
def review(batch, host, port, token):
    """Serve the review page: play QC survivors, approve (a) or decline (d), move with j/k.

    Rejected clips can be shown with their reasons and contact sheets, and approved as an
    override; every decision is recorded. Two operators never overwrite each other silently.
    An ad batch lists its ads: each format to play, the shots with their QC, approve or
    decline, and re-render one shot with a new seed, which reassembles its ad (in this
    process, or by the farm when CLIPMILL_BROKER_URL is set; CLIPMILL_QC_CONFIG sets QC).
    /preview streams a prompt as you write it (see clipmill preview): in this process, or on
    a farm render worker when CLIPMILL_BROKER_URL is set; for CLIPMILL_PREVIEW_MAX seconds at
    most (900; 0: no limit).

    \b
    Example:
      clipmill review ad-batch-20261129-210000
      clipmill review --host 0.0.0.0 --port 8080 --token "$(openssl rand -hex 16)"
    """
    from clipmill.jobs.core.batches import SubmitError, batch_summary

    if host not in LOOPBACK and not token:
        raise BadInput(f"--host {host}: binding beyond this machine needs --token (or CLIPMILL_REVIEW_TOKEN)")
    if token is not None and len(token) < 12:
        raise BadInput("--token: use at least 12 characters")
    db = open_db(existing=batch is not None)
    if batch is not None:
        try:
            batch_summary(db, batch)
        except SubmitError as e:
            raise BadInput(str(e))
    where = f"http://{host}:{port}/" + (f"batch/{batch}" if batch else "")
    err.print(f"review at {where}" + (" (token required)" if token else ""), soft_wrap=True)
    _serve(db, host, port, token, batch)


def _serve(db, host: str, port: int, token: str | None, batch: str | None, model: str | None = None) -> None:
    """The review server with its shot re-renders and its preview (the model loads on first use)."""
    from clipmill.jobs.cli.common import settings
    from clipmill.jobs.review.preview import Previews
    from clipmill.jobs.review.web import serve

    from clipmill.pipeline.models import SHAPES

    env = settings()
    model = model or os.environ.get("CLIPMILL_MODEL") or SHAPES

    def renderer():  # frames decoded with the folder's tiny autoencoder when it has one
        from clipmill.jobs.runner.stages import default_device
        from clipmill.pipeline.models import model_info
        from clipmill.pipeline.render import Renderer, RenderOptions

        info = model_info(model)
        return Renderer(info, device=env.device or default_device(),
                        options=RenderOptions(decoder="tiny" if info.has_tiny_vae else "vae"))

    send_render, runner = _rerenders(db, env)
    if env.broker_url:  # farm mode: each preview streams on a render worker, its frames through Redis
        from clipmill.jobs.farm.preview import FarmPreviews

        previews = FarmPreviews(env.broker_url, db, model, env.out)
    else:
        previews = Previews(renderer, model, env.out, db=db, max_s=env.preview_max_s)
    serve(db, host, port, token, batch, send_render, runner, previews)


@click.command()
@click.argument("prompt")
@click.option("--model", default="shapes", show_default=True, envvar="CLIPMILL_MODEL",
              help="An AnimateDiff-family model: 'shapes' (built in), 'tiny' or a local folder.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
def preview(prompt, model, port):
    """Stream PROMPT as an endless shot to a local page: edit the prompt there and the frames
    follow it; "Queue this" adds it (with its seed and tier) to the job table as a batch.

    The page is the review server's /preview (Server-Sent Events); closing it stops the stream
    and frees the model, and so does CLIPMILL_PREVIEW_MAX (seconds a preview streams, 900;
    0: no limit). Steps per frame follow a frame-time budget (pipeline.adaptive). With
    CLIPMILL_BROKER_URL set, the stream runs on a farm render worker (the preview queue, served
    first between groups) and its frames come through Redis; without it, in this process.

    \b
    Example:
      clipmill preview "a red circle moves right on a beige background, pan right"
      clipmill preview "a bowl of ramen, steam rising" --model tiny --port 8001
    """
    from urllib.parse import quote

    from clipmill.jobs.core.preflight import check_model

    with domain_errors():
        info = check_model(model, "vae")
    if info.family != "animatediff":
        raise BadInput(f"--model {model}: the preview streams AnimateDiff-family models; {info.name} is {info.family}")
    db = open_db()
    err.print(f"preview at http://127.0.0.1:{port}/preview?prompt={quote(prompt)}", soft_wrap=True, markup=False)
    _serve(db, "127.0.0.1", port, None, None, model)


def _rerenders(db, s):
    """Where a shot re-rendered from the page goes: the farm's render queue when
    CLIPMILL_BROKER_URL is set (``s``: the settings), else a thread of this server (the model
    loads on first use)."""
    from clipmill.jobs.cli.common import redact_url
    if s.broker_url:
        def send(job_ids: list[int]) -> str:
            from clipmill.jobs.farm.dispatch import BrokerDown, send_render

            try:
                n = send_render(db, job_ids)
                return f"sent {n} job(s) to the render queue; the ad is assembled again when they pass QC"
            except BrokerDown as e:
                return (f"queued, but the broker {redact_url(s.broker_url)} is unreachable ({e}): "
                        "clipmill reconcile sends them once it is back")

        return send, None
    from clipmill.jobs.runner.background import BackgroundRunner

    def context():
        from clipmill.jobs.runner.stages import WorkerContext

        return WorkerContext.from_settings(s, db)

    return None, BackgroundRunner(context)


@click.command()
@click.argument("batch")
@click.option("--to", "dest", required=True, metavar="DIR|s3://BUCKET/PREFIX", help="Where to deliver.")
def export(batch, dest):
    """Deliver BATCH's approved clips to a folder or S3 prefix, with manifest.csv and manifest.json.

    For an ad batch: its approved ads, each in every format (BATCH/ROW-ID/FORMAT.mp4), one
    manifest row per ad and format (row id, placeholder values, format, duration, file,
    SHA-256, shot seeds, approver).

    Files already there with the same bytes are not copied again, so a rerun copies nothing
    twice and an interrupted export resumes. The destination is checked first (a folder is
    created and written, an S3 bucket must be reachable with the credentials in use). A batch
    with no approved clip delivers nothing, says so and exits 1.

    \b
    Example:
      clipmill export ad-batch-20261129-210000 --to delivery/
      clipmill export ad-batch-20261129-210000 --to s3://ads-bucket/approved
    """
    from clipmill.jobs.core.preflight import check_storage
    from clipmill.jobs.review.export import ExportError, approved_count, export_batch

    db = open_db(existing=True)
    with domain_errors():
        try:
            n, kind = approved_count(db, batch)
        except ExportError as e:
            raise BadInput(str(e))
        check_storage(dest, "--to")
        if n == 0:
            err.print(f"batch {batch}: no approved {kind}s, nothing exported; approve {kind}s on the review page "
                      f"(clipmill review {batch}) first", soft_wrap=True, markup=False, highlight=False)
            raise SystemExit(EXIT_JOB_FAILED)
        try:
            res = export_batch(db, batch, dest)
        except ExportError as e:
            raise BadInput(str(e))
    if kind == "ad":
        out.print(f"{n} approved ad(s), {len(res.rows)} file(s): {len(res.copied)} copied, {len(res.skipped)} already there")
    else:
        out.print(f"{len(res.rows)} approved clip(s): {len(res.copied)} copied, {len(res.skipped)} already there")
    for m in res.manifest:
        out.print(f"manifest: {m}", soft_wrap=True, markup=False)
