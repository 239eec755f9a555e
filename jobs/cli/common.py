"""What the command modules share: consoles, exit codes, option groups, opening the database.

Only click, rich and light modules are imported here: ``clipmill --help`` must not load torch,
SQLAlchemy or OpenCV. The Python API each command calls is imported in the command's body,
because it brings those heavy libraries.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading

import click
from rich.console import Console
from rich.markup import escape

from clipmill.pipeline.models import SHAPES, TINY_MODELS, TINY_WARNING, ModelError
from clipmill.pipeline.choices import SAMPLERS, TIERS

for _stream in (sys.stdout, sys.stderr):  # a terminal that cannot show a character gets it escaped, not a traceback
    if callable(getattr(_stream, "reconfigure", None)):
        _stream.reconfigure(errors="backslashreplace")
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

# Exit codes, the same for every command (README "Exit codes").
EXIT_OK = 0  # the work ended: every job passed or was rejected by QC
EXIT_JOB_FAILED = 1  # a job failed, an ad could not be assembled, or `export` found nothing approved
EXIT_BAD_INPUT = 2  # usage or bad input: nothing was done, the job table is unchanged
EXIT_SETUP = 3  # setup: model, device, storage or broker unusable; jobs stay queued
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM during a run: the jobs being rendered went back to queued


@contextlib.contextmanager
def interruptible():
    """SIGTERM (`docker stop`, systemd, `kill`) stops a run as Ctrl-C does, with KeyboardInterrupt,
    so that the runner can put back what it holds before the process ends. Either signal is also
    remembered (:func:`stop_if_interrupted`): Python drops an exception raised while a finalizer
    runs ("Exception ignored in: ... __del__"), and a Ctrl-C that landed there let the run go on
    to its end."""
    def stop(signum, frame):
        INTERRUPTED.set()
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    INTERRUPTED.clear()
    before = signal.signal(signal.SIGTERM, stop)
    before_int = signal.getsignal(signal.SIGINT)
    if before_int is signal.default_int_handler:  # not where SIGINT is ignored (a job started with &)
        signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        if before_int is signal.default_int_handler:
            signal.signal(signal.SIGINT, before_int)


INTERRUPTED = threading.Event()  # a stop signal arrived while interruptible() was on


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt (again) in the main thread when a stop signal has arrived: the
    run's progress callbacks call it, so that a signal whose first raise was swallowed still
    stops the run at the next step."""
    if INTERRUPTED.is_set() and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt


class FiniteRange(click.FloatRange):
    """click.FloatRange that also refuses NaN (every comparison with NaN is false, so a plain
    range lets it through)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if rv != rv:
            self.fail(f"{value!r} is not a number in the range {self._describe_range()}", param, ctx)
        return rv


class BadInput(click.ClickException):
    """A bad option value, file or row: exit 2, nothing changed."""

    exit_code = EXIT_BAD_INPUT


class SetupError(click.ClickException):
    """The model, device, storage or broker cannot be used: exit 3, jobs stay queued."""

    exit_code = EXIT_SETUP


@contextlib.contextmanager
def domain_errors():
    """Turn the Python API's errors into one-line CLI errors with their exit codes: a bad option,
    file or row is bad input (2); a model, device or storage that cannot be used is setup (3).
    Anything else is a bug and keeps its traceback."""
    try:
        yield
    except click.ClickException:
        raise
    except Exception as e:
        from clipmill.jobs.core.preflight import BadOption, SetupProblem
        from clipmill.storage import StorageError, StorageUnavailable

        if isinstance(e, (SetupProblem, StorageUnavailable)):
            raise SetupError(str(e)) from None
        if isinstance(e, (BadOption, ModelError)):
            raise BadInput(str(e)) from None
        if isinstance(e, StorageError):
            raise SetupError(str(e)) from None
        if type(e).__module__.startswith(("botocore", "boto3")):
            from clipmill.storage.s3 import describe_error

            raise SetupError(describe_error(e)) from None
        raise


def settings():
    """The environment's settings (clipmill.jobs.core.settings); a bad value is bad input."""
    from clipmill.jobs.core.settings import Settings, SettingsError

    try:
        return Settings.from_env()
    except SettingsError as e:
        raise BadInput(str(e))


def open_db(existing: bool = False):
    """The job table, migrated; a URL that is not one is bad input (exit 2), a database that
    cannot be opened or reached a setup problem (exit 3), each one line naming it. ``existing``:
    for a command about batches already submitted, a SQLite file that is not there is bad input
    (exit 2), not made empty."""
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from clipmill.jobs.core.db import Database, sqlite_file, sqlite_in_memory

    url = settings().database_url
    try:
        path, memory = sqlite_file(url), sqlite_in_memory(url)
    except ArgumentError:
        path, memory = None, False  # Database() below names it
    if memory:  # each command is a process of its own: what one submitted, the next would not find
        raise BadInput(f"CLIPMILL_DATABASE_URL {url!r}: an in-memory SQLite database forgets every batch when the "
                       "command ends; give a file (sqlite:///clipmill.db) or a PostgreSQL URL")
    if existing and path is not None and not path.exists():
        raise BadInput(f"no job table at {redact_url(url)}: nothing was submitted there; set CLIPMILL_DATABASE_URL "
                       "to the job table that holds the batch")
    try:
        return Database(url)
    except ArgumentError as e:
        raise BadInput(f"CLIPMILL_DATABASE_URL {redact_url(url)!r}: not a database URL ({e}); "
                       "expected e.g. sqlite:///clipmill.db or postgresql+psycopg://user@host/db")
    except ImportError as e:  # a dialect or driver that is not installed (mysql://, postgresql+asyncpg://)
        raise BadInput(f"CLIPMILL_DATABASE_URL {redact_url(url)!r}: its database driver is not installed ({e}); "
                       "clipmill's job table is SQLite (sqlite:///clipmill.db) or PostgreSQL "
                       "(postgresql+psycopg://user@host/db)")
    except (SQLAlchemyError, OSError) as e:
        why = str(getattr(e, "orig", None) or e).strip().splitlines()
        raise SetupError(f"the job table at {redact_url(url)} cannot be opened: {why[0] if why else e.__class__.__name__}")


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", soft_wrap=True)


def batch_options(fn):
    """Options shared by run, submit and prompts check."""

    @click.option("--model", default=SHAPES, show_default=True, envvar="CLIPMILL_MODEL",
                  help="'shapes' (built in, trained on the shapes world: see README), 'tiny' or 'tiny-wan' (random "
                       "weights, smoke runs only), or a local diffusers AnimateDiff or Wan folder.")
    @click.option("--template", default=None,
                  help='Build each prompt from columns, e.g. "{dish} on a table in {store}, {camera}".')
    @click.option("--truncate", is_flag=True, help="Cut prompts longer than the tokenizer's limit instead of refusing them.")
    @click.option("--tier", type=click.Choice(list(TIERS)), default="fast", show_default=True,
                  help="Tier for rows without a tier column: fast = 6 steps, quality = 8 steps.")
    @click.option("--frames", type=int, default=None,
                  help="Frames to render, for rows without frames [default: the model's: 8 for shapes, 16 for tiny and "
                       "other AnimateDiff folders, 17 for Wan].")
    @click.option("--fps", type=int, default=30, show_default=True,
                  help="Output frame rate, for rows without fps (8-120).")
    @click.option("--size", default=None, help="WIDTHxHEIGHT or N for rows without size [default: the model's].")
    @functools.wraps(fn)
    def wrapper(*args, model, template, truncate, tier, frames, fps, size, **kwargs):
        from clipmill.jobs.core.batches import SubmitOptions
        from clipmill.jobs.core.prompts import Defaults, parse_size
        from clipmill.pipeline.models import model_info

        ctx = click.get_current_context()
        if ctx.params.get("ad_template") is not None:
            refuse_with_ad(ctx)
        opts = SubmitOptions(model=model, template=template, truncate=truncate)
        size_t = None
        if size is not None or frames is not None:
            try:
                info = model_info(model)
            except ModelError as e:
                raise BadInput(str(e))
            if size is not None:
                size_t, msg = parse_size(size, info)
                if msg:
                    raise click.BadParameter(f"{size!r} {msg}", param_hint="--size")
            if frames is not None and (msg := info.check_frames(frames)):
                raise click.BadParameter(f"{frames}: {msg}", param_hint="--frames")
        opts.defaults = Defaults(tier=tier, frames=frames, fps=fps, size=size_t)
        return fn(*args, opts=opts, **kwargs)

    return wrapper


# options of a prompt batch that an ad batch does not take, and why (they were accepted and ignored)
NOT_WITH_AD = {
    "template": "an ad template builds each shot's prompt",
    "tier": "an ad template sets each shot's tier", "frames": "an ad template sets each shot's length",
    "fps": "an ad template sets the frame rate", "size": "an ad template sets each format's size",
    "truncate": "an ad's prompts and texts are checked whole; shorten the rows named",
    "skip_invalid": "an ad batch is submitted whole; fix or remove the rows named",
}


def refuse_with_ad(ctx: click.Context) -> None:
    """UsageError (exit 2) for an option of :data:`NOT_WITH_AD` given (on the command line or
    through its variable) together with ``--ad``."""
    from click.core import ParameterSource

    for name, why in NOT_WITH_AD.items():
        if name in ctx.params and ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                                                     ParameterSource.ENVIRONMENT):
            raise click.UsageError(f"--{name.replace('_', '-')} cannot be used with --ad: {why}")


def submit_options(fn):
    """Options that only matter once jobs are written."""

    @click.option("--out", default="clipmill-out", show_default=True, envvar="CLIPMILL_OUT",
                  help="Storage root: clips go under OUT/BATCH/JOB/.")
    @click.option("--batch", "batch_name", default=None, help="Batch name [default: FILE's stem and the time].")
    @click.option("--skip-invalid", is_flag=True, help="Submit the valid rows and list the invalid ones (default: all or nothing).")
    @click.option("--sampler", type=click.Choice(SAMPLERS), default=None,
                  help="lightning (Euler, trailing) or lcm [default: what the model folder's scheduler is].")
    @click.option("--guidance", type=float, default=1.0, show_default=True,
                  help="CFG scale, 1-30; 1.0 turns guidance off (distilled models).")
    @click.option("--max-attempts", type=int, default=2, show_default=True,
                  help="Attempts per job, QC retries and render or post-processing errors together (1-10).")
    @click.option("--max-lost", type=int, default=3, show_default=True,
                  help="Attempts a job may lose with its worker (killed, lease expired) before it fails (1-10); "
                       "they do not count against --max-attempts.")
    @click.option("--priority", type=int, default=0, show_default=True, help="Higher goes first (-1000 to 1000).")
    @click.option("--notify", default=None, metavar="URL",
                  help="POST a JSON summary here when the batch finishes, signed with HMAC-SHA256 of "
                       "CLIPMILL_NOTIFY_SECRET, retried with backoff [default: an ad template's notify].")
    @functools.wraps(fn)
    def wrapper(*args, opts, out, batch_name, skip_invalid, sampler, guidance, max_attempts, max_lost, priority,
                notify, **kw):
        opts.out, opts.batch, opts.skip_invalid = out, batch_name, skip_invalid
        opts.sampler, opts.guidance, opts.max_attempts, opts.priority = sampler, guidance, max_attempts, priority
        opts.max_lost, opts.notify = max_lost, notify
        return fn(*args, opts=opts, **kw)

    return wrapper


def qc_config_options(fn):
    """--qc-config FILE and --set KEY=VALUE, turned into a qc.QCConfig."""

    @click.option("--qc-config", "qc_config", type=click.Path(dir_okay=False), default=None,
                  envvar="CLIPMILL_QC_CONFIG", help="TOML file of QC thresholds (keys of qc.QCConfig).")
    @click.option("--set", "qc_set", multiple=True, metavar="KEY=VALUE", help="Override one QC threshold; repeatable.")
    @functools.wraps(fn)
    def wrapper(*args, qc_config, qc_set, **kw):
        from clipmill.qc import QCConfig

        overrides = {}
        for item in qc_set:
            key, sep, value = item.partition("=")
            if not sep:
                raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--set")
            overrides[key.strip()] = value.strip()
        ctx = click.get_current_context(silent=True)
        from_env = ctx is not None and ctx.get_parameter_source("qc_config") is click.core.ParameterSource.ENVIRONMENT
        try:
            cfg = QCConfig.load(qc_config, overrides, name="CLIPMILL_QC_CONFIG" if from_env else "--qc-config")
        except ValueError as e:
            raise BadInput(str(e))
        return fn(*args, qc_cfg=cfg, **kw)

    return wrapper


def warn_model(opts) -> None:
    if opts.model in TINY_MODELS:
        warn(TINY_WARNING.format(name=opts.model))
    if opts.guidance > 6.0:
        warn(f"--guidance {opts.guidance:g}: distilled few-step models over-expose (blown-out, saturated frames) "
             "above about 6; they are made for 1.0-2.0")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def redact_url(url: str) -> str:
    """A database or broker URL with its password replaced by ***, for printing and logs."""
    from clipmill.jobs.core.settings import redact_url as redact

    return redact(url)


def print_table(table, console=None) -> None:
    """A rich Table on a terminal; when the output is piped or redirected, the same rows as
    plain aligned text that is never truncated (a table squeezed to 160 columns cuts paths)."""
    console = console or out
    if console.is_terminal:
        console.print(table)
        return
    headers = [str(c.header) for c in table.columns]
    cols = [[str(cell) for cell in c.cells] for c in table.columns]
    rows = [list(r) for r in zip(*cols)] if cols else []
    from rich.text import Text

    def plain(v: str) -> str:
        if "[" not in v:
            return v
        try:
            return Text.from_markup(v).plain
        except Exception:  # noqa: BLE001 - not markup after all (a path with brackets)
            return v

    rows = [[plain(v) for v in r] for r in rows]
    show_header = table.show_header and any(headers)
    widths = [max([len(h) if show_header else 0] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if table.title:
        console.out(str(table.title), highlight=False)
    lines = ([headers] if show_header else []) + rows
    for r in lines:
        console.out("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip(), highlight=False)
