"""The ``clipmill`` command line: one thin module per command group over the Python API.

- ``batch``: run (embedded), submit, status, prompts check
- ``farm``: worker, beat, reconcile, cancel, retry, nightly
- ``review``: review, export
- ``media``: qc, interpolate
- ``bench``: the speed ladder
- ``train``: train-model (the built-in shapes model)

Domain errors become ``click.ClickException`` here and nowhere else, with the exit codes of
``common`` (0 done, 1 a job failed, 2 usage or bad input, 3 setup, 130 a run interrupted).
"""

from __future__ import annotations

import logging

import click

from clipmill.jobs.cli import batch, bench, farm, media, review, train


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="clipmill")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.option("--log-json", is_flag=True, envvar="CLIPMILL_LOG_JSON", help="Log one JSON object per line, with batch/job/attempt ids.")
def main(verbose: int, log_json: bool) -> None:
    """Bulk-render short ad clips from prompt batches, check them, and store them.

    \b
    Example:
      clipmill run examples/shapes-batch.csv
      clipmill status

    The job table is SQLite at ./clipmill.db unless CLIPMILL_DATABASE_URL says otherwise.

    \b
    Exit codes (every command):
      0  done: every job passed or was rejected by QC
      1  a job failed, an ad could not be assembled, or export found nothing approved
      2  usage or bad input: nothing was done, the job table is unchanged
      3  setup: model, device or storage unusable, no broker configured (or, for
         reconcile, unreachable), or another nightly run holds the lock (another
         train-model run the checkpoint folder); the run stops once and its jobs
         stay queued (clipmill run --resume BATCH continues)
      130  run, nightly or train-model interrupted (Ctrl-C or SIGTERM): the group being
         rendered went back to queued with its attempts unspent (clipmill run --resume
         BATCH); train-model keeps its checkpoints (run it again to resume)
    """
    from clipmill.jobs.core.logs import setup

    setup(max(logging.WARNING - 10 * verbose, logging.DEBUG), log_json)


for command in (batch.run, batch.submit_cmd, batch.status, batch.prompts, farm.worker, farm.beat, farm.reconcile,
                farm.cancel, farm.retry, farm.nightly, review.review, review.preview, review.export, media.qc, media.interpolate,
                bench.bench_cmd, train.train_model):
    main.add_command(command)
