"""Batch commands: run (embedded), submit, status and prompts check."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.markup import escape

from clipmill.jobs.cli.common import (EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED, BadInput, FiniteRange, SetupError,
                                      batch_options,
                                      default_device, domain_errors, duration, err, interruptible, open_db, out,
                                      print_table, qc_config_options,
                                      redact_url, settings, stop_if_interrupted, submit_options, warn, warn_model)
from clipmill.jobs.core.defaults import DEFAULT_DRAWS, MAX_DRAWS
from clipmill.pipeline.models import TINY_MODELS, TINY_WARNING


def _report(bf) -> None:
    for w in bf.warnings:
        warn(str(w))


def _problems(checked, valid: str) -> None:
    """``prompts check``'s tail: the warnings, every error, and the counts."""
    _report(checked)
    for p in checked.errors:
        err.print(f"[red]error:[/] {escape(str(p))}", soft_wrap=True)
    err.print(f"{valid}, {len(checked.errors)} error(s), {len(checked.warnings)} warning(s)")


def _submit(path: str, opts, farm: bool = False, ad_template: str | None = None):
    """Submit a prompt batch, or with ``ad_template`` an ad batch; in farm mode, send its jobs."""
    from clipmill.jobs.ads.submit import check_ad_submission, submit_ads
    from clipmill.jobs.core.batches import check_submission, submit
    from clipmill.jobs.core.prompts import BatchInvalid

    try:
        with domain_errors():  # every check before the job table is opened: bad input creates no clipmill.db
            checked = check_ad_submission(path, ad_template, opts) if ad_template else check_submission(path, opts)
        db = open_db()
        with domain_errors():
            res = (submit_ads(db, path, ad_template, opts, ads=checked) if ad_template
                   else submit(db, path, opts, checked=checked))
    except BatchInvalid as e:
        _report(e.batch)
        raise BadInput(str(e))
    _report(res.ads if ad_template else res.file)
    if farm:
        send_to_farm(db, res.job_ids)
    if not ad_template and res.file.errors:
        err.print(f"[yellow]skipped {len(res.file.bad_lines)} invalid row(s):[/]")
        for p in res.file.errors:
            err.print(f"  {p}", soft_wrap=True, markup=False)
    what = f"{len(res.ad_ids)} ad(s), {len(res.job_ids)} shot job(s)" if ad_template else f"{len(res.job_ids)} job(s)"
    err.print(f"batch [bold]{res.batch_id}[/]: {what} queued in {escape(redact_url(db.url))}", soft_wrap=True)
    return res


def _ads_summary(db, batch_id: str) -> int:
    """Each ad's state and files; returns how many failed."""
    from clipmill.jobs.ads.assembly import ads_of

    ads = ads_of(db, batch_id)
    if not ads:
        return 0
    out.print(f"ads ({len(ads)}): " + ", ".join(f"{k} {sum(a.state == k for a in ads)}"
                                              for k in ("done", "rejected", "failed", "waiting") if any(a.state == k for a in ads)),
              markup=False, highlight=False)
    for a in ads:
        head = f"  ad {a.id} (line {a.line}{', ' + a.client_id if a.client_id else ''}) {a.state}"
        fmts = (a.outputs or {}).get("formats", {})
        files = "; ".join(f"{n} {f['width']}x{f['height']} {f['seconds']:.2f} s {f['location']}" for n, f in fmts.items())
        out.print(head + (f": {files}" if files else "") + (f" ({a.error.splitlines()[-1]})" if a.error else ""),
                  soft_wrap=True, markup=False, highlight=False)
    return sum(a.state == "failed" for a in ads)


def _notify(db, batch_id: str) -> None:
    """The batch-finished callback, when the batch has a URL (after the work: it never holds up
    rendering); a receiver that fails every try is reported, not an error of the run."""
    from clipmill.jobs.core.notify import notify_once

    res = notify_once(db, batch_id, settings().notify_secret)
    if res is None:
        return
    if res["ok"]:
        err.print(f"notified: HTTP {res['status']} after {res['tries']} try(ies)", markup=False, highlight=False)
    else:
        warn(f"the --notify callback failed after {res['tries']} tries: {res['error']}")


def send_to_farm(db, job_ids: list[int]) -> None:
    """In farm mode (CLIPMILL_BROKER_URL set), send the committed jobs to the render queue."""
    url = settings().broker_url
    if not url or not job_ids:
        return
    from clipmill.jobs.farm.dispatch import BrokerDown, send_render

    try:
        n = send_render(db, job_ids)
        err.print(f"sent {n} job(s) to the render queue at {redact_url(url)}", soft_wrap=True, markup=False)
    except BrokerDown as e:
        warn(f"broker {redact_url(url)} unreachable ({e}); the jobs stay queued in the database: "
             "run `clipmill reconcile` once it is back")


@click.command()
@click.argument("file", required=False, type=click.Path(dir_okay=False))
@click.option("--resume", "resume", default=None, metavar="BATCH",
              help="Finish an existing batch (after a crash or a submit) instead of reading FILE.")
@click.option("--group-size", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Compatible jobs rendered in one call.")
@click.option("--device", default=None, help="torch device [default: cuda if available, else cpu].")
@click.option("--ad", "ad_template", type=click.Path(dir_okay=False), default=None, metavar="TEMPLATE",
              help="FILE's rows are ads made with this ad template (TOML; see README, Finished ads): its shots are "
                   "jobs, and each ad is assembled in every format once its shots have passed QC.")
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
@click.option("--draws", type=click.IntRange(1, MAX_DRAWS), default=DEFAULT_DRAWS, envvar="CLIPMILL_DRAWS",
              show_default=True,
              help="Renders a clip of a shapes-world model may take: a clip the world's analyzer does not read "
                   "clearly as its prompt asks (a wrong word, or motion or camera too near a boundary) is rendered "
                   "again from the next seed, and the first read clearly right is kept (1: every clip rendered "
                   "once; other models always render once). See README, Draws.")
def run(file, resume, group_size, device, ad_template, opts, qc_cfg, feature_cache, guidance_mode, decoder, compile_how,
        draws):
    """Submit FILE and render, post-process and QC it in this process.

    FILE is a CSV or JSONL batch, one clip per row, or a .txt file, one prompt per line
    (README, Prompt batches).

    Every option, the device, the model folder and the storage root are checked before the
    job table changes; a bad row leaves it unchanged too. Exits 0 when every job ended passed
    or rejected by QC, 1 when a job failed or an ad could not be assembled, 2 on bad input
    (nothing submitted), 3 when the model, device or storage cannot be used (the run stops
    once; jobs stay queued), 130 when interrupted (Ctrl-C or SIGTERM: the group being rendered
    goes back to queued with its attempts unspent). --resume BATCH keeps the batch's own
    settings: the options that set a batch (--model, --template, --tier, --fps, --out, ...)
    go with FILE only. Jobs of the batch that another live worker holds (a second run, a farm
    worker) are waited for, so the run ends when no job of the batch is open.

    \b
    Example:
      clipmill run examples/shapes-batch.csv
      clipmill run examples/ad-batch.csv --model tiny --template "{dish} on a table in {store}, {camera}"
      clipmill run examples/ad/ads.csv --ad examples/ad/local-life.toml
      clipmill run --resume ad-batch-20261129-210000
    """
    from clipmill.jobs.core.batches import batch_status, batch_summary
    from clipmill.jobs.core.preflight import (BadOption, check_device, check_group_size, check_input_file, check_model,
                                              check_storage, check_submit_options)

    if (file is None) == (resume is None):
        raise click.UsageError("give FILE or --resume BATCH (one of them)")
    if ad_template is not None and resume is not None:
        raise click.UsageError("--ad goes with FILE; a resumed ad batch keeps its own template")
    if resume is not None:
        given = _given_on_command_line(click.get_current_context(), FILE_ONLY_OPTIONS)
        if given:
            raise click.UsageError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with FILE; "
                                   f"a resumed batch keeps the settings it was submitted with")
    with domain_errors():  # every check before the job table changes and before any render
        # first the checks that need no torch, so that a bad option is refused at once
        check_group_size(group_size)
        if resume is None:
            try:
                check_input_file(file)
            except BadOption as e:
                raise BadOption(f"{e}; nothing submitted")
            check_submit_options(opts)
            if ad_template is not None:
                from clipmill.jobs.ads.template import load

                load(ad_template)  # a bad template is refused before anything loads
            model, guidance, root, where = opts.model, opts.guidance, opts.out, "--out"
        else:
            info = batch_summary(open_db(existing=True), resume)
            model, guidance, root, where = info["model"], info["guidance"], info["out"], f"batch {resume}'s storage"
        check_model(model, decoder)
        check_storage(root, where)
        from clipmill.jobs.runner.embedded import run_batch
        from clipmill.jobs.runner.stages import WorkerContext
        from clipmill.pipeline.guidance import effective_mode
        from clipmill.pipeline.render import RenderOptions

        try:
            effective_mode(guidance_mode, guidance)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--guidance-mode")
        device = check_device(device or default_device())
    if resume is None:
        warn_model(opts)
        batch_id = _submit(file, opts, ad_template=ad_template).batch_id
    else:
        batch_id = resume
        if model in TINY_MODELS:
            warn(TINY_WARNING.format(name=model))
    db = open_db()
    ctx = WorkerContext(db, device=device, qc_config=qc_cfg, guidance_mode=guidance_mode, draws=draws,
                        render_options=RenderOptions(feature_cache=feature_cache, decoder=decoder, compile=compile_how))
    t0 = time.perf_counter()
    with _RunProgress(db, batch_id, group_size, device) as progress, interruptible():
        try:
            with domain_errors():
                run_batch(ctx, batch_id, group_size, progress)
        except SetupError as e:
            progress.stopped = True
            raise SetupError(f"{e.message}; the run stopped and the batch's jobs stay queued "
                             f"(`clipmill run --resume {batch_id}` continues it)")
        except KeyboardInterrupt:
            progress.stopped = True
            err.print(f"interrupted: the jobs being rendered went back to queued with their attempts unspent; "
                      f"`clipmill run --resume {batch_id}` continues the batch", markup=False, highlight=False)
            sys.exit(EXIT_INTERRUPTED)
    from clipmill.jobs.ads.assembly import assemble_batch

    assembled = assemble_batch(ctx, batch_id)  # the ads whose shots are all in (none for a prompt batch)
    if assembled:
        err.print(f"assembled {sum(v is not None for v in assembled.values())} ad(s)", markup=False, highlight=False)
    wall = time.perf_counter() - t0
    st = batch_status(db, batch_id)
    _summary(st, wall)
    failed_ads = _ads_summary(db, batch_id)
    _notify(db, batch_id)
    if st["states"]["failed"] or failed_ads:
        sys.exit(EXIT_JOB_FAILED)


def _option_names(*decorators) -> frozenset[str]:
    """The parameter names the option decorators add."""
    def f():
        pass

    for d in decorators:
        f = d(f)
    return frozenset(p.name for p in f.__click_params__)


FILE_ONLY_OPTIONS = _option_names(batch_options, submit_options)  # what a submit sets: meaningless to a resume


def _given_on_command_line(ctx: click.Context, names: frozenset[str]) -> list[str]:
    """The options of ``names`` typed on the command line (an environment variable or a default is
    not a choice made for this run), as the user wrote them."""
    return [p.opts[0] for p in ctx.command.params if p.name in names
            and ctx.get_parameter_source(p.name) is click.core.ParameterSource.COMMANDLINE]


class _RunProgress:
    """The embedded runner's events, shown as bars on a terminal and as one plain line per
    group otherwise (a rich bar prints nothing useful into a pipe or a log file). Both count
    jobs (done means passed, rejected, failed or cancelled) and name renders separately when QC
    retries or render errors add some. The clock stops when the batch ends."""

    def __init__(self, db, batch_id: str, group_size: int, device: str):
        import threading

        self.db, self.batch_id, self.group_size, self.device = db, batch_id, group_size, device
        self.tty = err.is_terminal
        self.lock = threading.Lock()
        self.groups = 0
        self.held = 0
        self.stopped = False
        self.t0 = time.perf_counter()

    def counts(self) -> dict:
        from clipmill.jobs.core.batches import run_counts

        return run_counts(self.db, self.batch_id)

    @staticmethod
    def renders(c: dict) -> str:
        return f"{c['renders']} renders ({c['retries']} retries)" if c["retries"] else f"{c['renders']} renders"

    def __enter__(self):
        c = self.counts()
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[note]}"), TimeElapsedColumn(), console=err)
            self.bar.start()
            self.jobs_t = self.bar.add_task("jobs", total=c["jobs"], completed=c["done"], note=self.renders(c))
            self.steps_t = self.bar.add_task("  steps", total=None, note="")
        else:
            err.print(f"batch {self.batch_id}: {c['done']}/{c['jobs']} jobs done; rendering groups of up to "
                      f"{self.group_size} on {self.device}", soft_wrap=True, markup=False, highlight=False)
        return self

    def _update_jobs(self) -> dict:
        c = self.counts()
        if self.tty:
            self.bar.update(self.jobs_t, total=c["jobs"], completed=c["done"], note=self.renders(c))
        return c

    def group_started(self, size, steps):
        stop_if_interrupted()
        with self.lock:
            self.groups += 1
            if self.tty:
                self.bar.update(self.steps_t, completed=0, total=steps, description=f"  group {self.groups}",
                                note=f"{size} clip(s)")

    def step(self, done, total):
        stop_if_interrupted()
        if self.tty:
            self.bar.update(self.steps_t, completed=done, total=total)

    def rendered(self, n):
        stop_if_interrupted()
        with self.lock:
            c = self._update_jobs()
            if not self.tty:
                err.print(f"group {self.groups}: {n} clip(s) rendered; jobs done {c['done']}/{c['jobs']}, "
                          f"{self.renders(c)}, {time.perf_counter() - self.t0:.1f} s", soft_wrap=True, markup=False,
                          highlight=False)

    def checked(self, verdict):
        with self.lock:
            if self.tty:
                self._update_jobs()

    def waiting(self, held):
        stop_if_interrupted()
        with self.lock:
            if self.tty:
                self.bar.update(self.steps_t, description="  waiting", note=f"{held} job(s) held by another worker")
            elif held != self.held:  # one line when the count changes, not one a poll
                err.print(f"waiting for {held} job(s) of batch {self.batch_id} held by another worker (another run "
                          "or a farm worker); jobs it gives back are rendered here", soft_wrap=True, markup=False,
                          highlight=False)
            self.held = held

    def __exit__(self, *exc):
        with self.lock:
            c = self._update_jobs()
            wall = time.perf_counter() - self.t0
            if self.tty:
                for t in self.bar.tasks:  # the clock stops with the batch
                    self.bar.stop_task(t.id)
                self.bar.refresh()
                self.bar.stop()
            else:
                err.print(f"batch {self.batch_id}: jobs done {c['done']}/{c['jobs']}, {self.renders(c)}, "
                          f"{wall:.1f} s" + (" (stopped)" if self.stopped or exc[0] else ""),
                          soft_wrap=True, markup=False, highlight=False)


def _summary(st: dict, wall: float) -> None:
    from rich.table import Table

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
    print_table(t)
    rejected = [r for r in st["rows"] if r["state"] in ("rejected", "failed")]
    for r in rejected[:20]:
        why = "; ".join(r["reasons"]) or (r["error"] or "")
        out.print(f"  job {r['job']} (line {r['line']}) {r['state']}: {why}", soft_wrap=True, markup=False)
    _adherence(st["rows"])


def _adherence(rows: list[dict]) -> None:
    """Each delivered clip's adherence, for prompts in the shapes grammar: what the analyzer
    read against what the prompt asked, and the share right per attribute."""
    from clipmill.pipeline.shapes import ATTRIBUTES

    scored = [r for r in rows if r["adherence"]]
    if not scored:
        return
    out.print(f"adherence ({len(scored)} clip(s) with prompts in the shapes grammar; what the analyzer reads in each):",
              markup=False, highlight=False)
    for r in scored[:20]:
        a = r["adherence"]
        words = [f"{k} {'ok' if a['match'][k] else 'NO (read ' + str(a['read'][k]) + ')'}" for k in ATTRIBUTES]
        out.print(f"  job {r['job']} (line {r['line']}) {r['state']}: " + ", ".join(words), soft_wrap=True,
                  markup=False, highlight=False)
    if len(scored) > 20:
        out.print(f"  ... and {len(scored) - 20} more (clipmill status BATCH --json lists every one)", markup=False,
                  highlight=False)
    share = {k: sum(r["adherence"]["match"][k] for r in scored) / len(scored) for k in ATTRIBUTES}
    out.print("  all: " + ", ".join(f"{k} {v:.0%}" for k, v in share.items()), markup=False, highlight=False)


@click.command("submit")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--ad", "ad_template", type=click.Path(dir_okay=False), default=None, metavar="TEMPLATE",
              help="FILE's rows are ads made with this ad template (see `clipmill run --ad`); in the farm each ad is "
                   "assembled on the post queue once its shots have passed QC.")
@batch_options
@submit_options
def submit_cmd(file, ad_template, opts):
    """Validate FILE (CSV, JSONL, or .txt with one prompt per line) and queue its jobs in the job
    table, rendering nothing.

    All or nothing: a file with a bad row leaves the database unchanged, unless --skip-invalid.
    The options, the model folder and the storage root (--out) are checked first.
    With CLIPMILL_BROKER_URL set, the committed jobs are then sent to the farm's render queue
    (if the broker is down they stay queued; `clipmill reconcile` sends them later); without it,
    `clipmill run --resume BATCH` renders them here.

    \b
    Example:
      clipmill submit examples/shapes-batch.csv --batch friday-shapes --priority 5
      clipmill submit examples/ad/ads.csv --ad examples/ad/local-life.toml --batch friday-feed-ads
    """
    from clipmill.jobs.core.preflight import check_storage, check_submit_options

    with domain_errors():  # before the job table changes
        check_submit_options(opts)
        check_storage(opts.out)
    warn_model(opts)
    res = _submit(file, opts, farm=True, ad_template=ad_template)
    out.print(res.batch_id)


@click.command()
@click.argument("batch", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--watch", type=FiniteRange(0.5, 3600), default=None, metavar="SECONDS",
              help="With BATCH: print progress and ETA every SECONDS until no job is open.")
@click.option("--limit", type=click.IntRange(0, 10**9), default=200, show_default=True,
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
    from rich.table import Table

    from clipmill.jobs.core.batches import SubmitError, batch_status, batch_summary, list_batches

    db = open_db(existing=batch is not None)
    if watch is not None:
        if batch is None:
            raise click.UsageError("--watch needs a BATCH")
        while True:
            try:
                st = batch_summary(db, batch)
            except SubmitError as e:
                raise BadInput(str(e))
            p = st["progress"]
            s = st["states"]
            if as_json:  # one JSON object a line, as often as --watch says
                click.echo(json.dumps(st, default=str, ensure_ascii=False))
            else:
                out.print(f"{batch}: {p['done']}/{st['jobs']} done (passed {s['passed']}, rejected {s['rejected']}, "
                          f"failed {s['failed']}), {p['open']} open, elapsed {duration(p['elapsed_s'])}, "
                          f"ETA {duration(p['eta_s'])}", soft_wrap=True)
            if not p["open"]:
                return
            time.sleep(watch)
    if batch is None:
        rows = list_batches(db)
        if as_json:
            out.print_json(data=rows) if sys.stdout.isatty() else click.echo(json.dumps(rows))
            return
        t = Table("batch", "jobs", "queued", "running", "passed", "rejected", "failed", "approved", "declined",
                  "cancelled", "created")
        for r in rows:
            s = r["states"]
            t.add_row(escape(r["batch"]), str(r["jobs"]), str(s["queued"]), str(s["rendering"] + s["post"]),
                      str(s["passed"]), str(s["rejected"]), str(s["failed"]), str(s["approved"]), str(s["declined"]),
                      str(s["cancelled"]), r["created_at"][:19])
        print_table(t)
        return
    try:
        st = batch_status(db, batch, limit=None if as_json or not limit else limit)
    except SubmitError as e:
        raise BadInput(str(e))
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
            why = f"passed on retry {len(r['attempts']) - r['attempts_lost']} (" + "; ".join(
                f"a{a['number']} {a['tier']} {a['verdict'] or a['state']}" for a in r["attempts"]) + ")"
        elif r["out_of_attempts"]:
            why = f"out of attempts ({len(r['attempts']) - r['attempts_lost']}/{st['max_attempts']}): " + why
        last = r["attempts"][-1] if r["attempts"] else None
        t.add_row(str(r["job"]), escape(r["id"] or ""), str(r["line"]), r["state"], str(len(r["attempts"])),
                  last["tier"] if last else r["tier"], str(last["seed"] if last else r["seed"]), escape(why),
                  escape(r["location"] or ""))
    print_table(t)
    if len(st["rows"]) < st["jobs"]:
        out.print(f"{st['jobs'] - len(st['rows'])} more job(s) not shown (--limit 0 shows all)")
    s = st["states"]
    out.print(" ".join(f"{k}={v}" for k, v in s.items() if v)
              + f"; passed on a retry: {st['passed_on_retry']}; out of attempts: {st['out_of_attempts']}")
    p = st["progress"]
    out.print(f"progress: {p['done']}/{st['jobs']} done, {p['open']} open, elapsed {duration(p['elapsed_s'])}, "
              f"ETA {duration(p['eta_s'])}")


def _check_ads(file: str, ad_template: str, opts, as_json: bool) -> None:
    """``prompts check --ad``: every ad of FILE with its shots' cleaned prompts, and every problem."""
    from rich.table import Table

    from clipmill.jobs.ads.submit import check_ads

    with domain_errors():
        ads = check_ads(file, ad_template, opts)
    if as_json:
        click.echo(json.dumps({
            "ads": [{"line": a.line, "id": a.client_id, "seed": a.seed, "values": a.values, "texts": a.texts,
                     "shots": [{"shot": s.index, "prompt": s.row.prompt, "tier": s.row.tier, "frames": s.row.frames,
                                "seed": s.row.seed, "sizes": {k: list(v) for k, v in s.sizes.items()}} for s in a.shots]}
                    for a in ads.ads],
            "errors": [str(p) for p in ads.errors],
            "warnings": [str(p) for p in ads.warnings],
        }, ensure_ascii=False))
    else:
        t = Table("line", "id", "shot", "tier", "frames", "seed", "cleaned prompt", title=escape(file))
        for a in ads.ads:
            for s in a.shots:
                t.add_row(str(a.line), escape(a.client_id or ""), str(s.index), s.row.tier, str(s.row.frames),
                          str(s.row.seed), escape(s.row.prompt))  # a prompt's own brackets are text, not markup
        out.print(t)
        _problems(ads, f"{len(ads.ads)} valid ad(s)")
    if ads.errors:
        sys.exit(EXIT_BAD_INPUT)


@click.group()
def prompts():
    """Work with prompt batch files without submitting them.

    \b
    Example:
      clipmill prompts check examples/shapes-batch.csv
    """


@prompts.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the cleaned rows and problems as JSON.")
@click.option("--ad", "ad_template", type=click.Path(dir_okay=False), default=None, metavar="TEMPLATE",
              help="FILE's rows are ads made with this ad template: check the template and every row against it.")
@batch_options
def prompts_check(file, as_json, ad_template, opts):
    """Print FILE's cleaned prompts and every problem; submit nothing.

    Exits 2 if any row is invalid.

    \b
    Example:
      clipmill prompts check examples/ad-batch.csv --template "{dish} on a table in {store}, {camera}"
      clipmill prompts check examples/ad/ads.csv --ad examples/ad/local-life.toml
    """
    from rich.table import Table

    from clipmill.jobs.core.batches import check_file

    if ad_template is not None:
        _check_ads(file, ad_template, opts, as_json)
        return
    with domain_errors():
        _, bf = check_file(file, opts)
    if as_json:
        click.echo(json.dumps({
            "rows": [r.__dict__ for r in bf.rows],
            "errors": [str(p) for p in bf.errors],
            "warnings": [str(p) for p in bf.warnings],
        }, ensure_ascii=False))
    else:
        t = Table("line", "id", "tier", "frames", "fps", "size", "seed", "tokens", "cleaned prompt", title=escape(file))
        for r in bf.rows:
            t.add_row(str(r.line), escape(r.client_id or ""), r.tier, str(r.frames), str(r.fps), f"{r.width}x{r.height}",
                      str(r.seed), str(r.tokens), escape(r.prompt))  # a prompt's own brackets are text, not markup
        out.print(t)
        _problems(bf, f"{len(bf.rows)} valid row(s)")
    if bf.errors:
        sys.exit(EXIT_BAD_INPUT)
