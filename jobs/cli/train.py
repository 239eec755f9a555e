"""Training the built-in shapes model: clipmill train-model (what ``make demo-model`` runs)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import click

from clipmill.jobs.cli.common import (EXIT_INTERRUPTED, BadInput, SetupError, default_device, domain_errors,
                                      interruptible)
from clipmill.jobs.core.locks import exclusive_lock
from clipmill.storage.local import TEMP_GLOB, abandoned

STAGES = ("vae", "text", "teacher", "student", "decoder")
LOCK = "train.lock"  # in the checkpoint folder: one train-model run at a time works it


def default_root(recipe: str) -> Path:
    """``$CLIPMILL_TRAIN_DIR`` or ``~/.cache/clipmill/train`` (``-smoke`` appended for the smoke recipe)."""
    base = Path(os.environ.get("CLIPMILL_TRAIN_DIR") or Path.home() / ".cache" / "clipmill" / "train").expanduser()
    return base if recipe == "full" else base.with_name(f"{base.name}-{recipe}")


@contextlib.contextmanager
def hold_checkpoints(root: Path):
    """Hold the checkpoint folder ``root`` for this run: an exclusive lock on ``root/train.lock``
    (``jobs.core.locks``), so that a second run on it stops at once (SetupError, exit 3, as a
    second nightly run does) instead of writing the same checkpoints. A folder this run made and
    leaves holding nothing but the lock (a run refused before it wrote anything) is removed again.
    The temporary files a killed run left (a checkpoint half written) are removed once the lock
    is held: those in the folder and its subfolders whose writer is gone (a folder may hold
    other things: ``--ckpt`` is the user's choice)."""
    made = [p for p in (root, *root.parents) if not p.exists()]  # the folders the lock creates, deepest first
    lock = root / LOCK

    def busy(holder: str) -> SetupError:
        return SetupError(f"--ckpt {root}: another train-model run holds this checkpoint folder ({holder}, its lock "
                          f"{lock}); wait for it to end, or give another --ckpt")

    with exclusive_lock(lock, busy):
        # what a killed run was writing, where checkpoints go (CKPT/, CKPT/STAGE/, CKPT/pool/)
        folders = [root, *(d for d in root.iterdir() if d.is_dir() and not d.is_symlink())]
        for stale in [t for d in folders for t in d.glob(TEMP_GLOB)]:
            if abandoned(stale):
                stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # what the run raised matters more
                if made and [p.name for p in root.iterdir()] == [LOCK]:
                    lock.unlink()  # while this run holds the lock: a run waiting on it locks a new file
                    for folder in made:
                        folder.rmdir()  # fails (and stops) where another run has put its lock by now


def clean_caption(raw: str) -> str:
    """The project's cleaning of a free-text prompt, as ``clipmill run`` applies it to a prompt
    column: the captions are trained on exactly what the renderer is given."""
    from clipmill.jobs.core.cleaning import split_free_prompt

    return split_free_prompt(raw).canonical()


@click.command("train-model")
@click.option("--ckpt", type=click.Path(file_okay=False), default=None,
              help="Checkpoint folder, kept between runs: rerun the same command to resume "
                   "[default: $CLIPMILL_TRAIN_DIR or ~/.cache/clipmill/train].")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
              help="Seeds every stage; a checkpoint folder keeps its seed.")
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True,
              help="torch CPU threads (keep 1 while anything else runs: 2 contending threads are 10x slower).")
@click.option("--device", default=None, metavar="cpu|cuda[:N]",
              help="Where to train [default: cuda if available, else cpu]. A run may resume on another device than it "
                   "started on (checkpoints load on any device).")
@click.option("--recipe", type=click.Choice(["full", "smoke"]), default="full", show_default=True,
              help="full: the shipped model (hours on 2 CPU cores); smoke: every stage for a few steps, small nets.")
@click.option("--stages", default=",".join(STAGES), show_default=True,
              help="Comma-separated stages to run, in this order. A finished stage is skipped (one --from-teacher "
                   "seeded too); one whose inputs are neither finished nor in the list is refused. The model is "
                   "exported when the student is in the list.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Export the model folder here [default: the package's built-in 'shapes' folder for --recipe full, "
                   "CKPT/export for smoke].")
@click.option("--no-export", is_flag=True, help="Train only; do not write the model folder.")
@click.option("--from-teacher", default=None, metavar="DIR|shapes",
              help="Seed an empty --ckpt from an exported model's teacher/ folder ('shapes': the built-in "
                   "model's): its vae and text stages are done, the teacher too unless it is unfinished or has run "
                   "fewer steps than the recipe's (it resumes), the decoder if the folder's was fine-tuned. Then "
                   "--stages runs as without it: by default the rest (teacher if unfinished, student, decoder); "
                   "--stages student needs a finished teacher.")
@click.option("--export-teacher", is_flag=True,
              help="Only write OUT/teacher from --ckpt's teacher (finished, or its last checkpoint's EMA, marked "
                   "unfinished so that --from-teacher resumes it) and exit.")
def train_model(ckpt, seed, threads, device, recipe, stages, out, no_export, from_teacher, export_teacher):
    """Train the built-in 'shapes' model: autoencoder, text encoder, teacher, then the LCM
    student distilled for the 6-step fast and 8-step quality tiers, then the autoencoder's
    decoder fine-tuned on whole clips (encoder frozen); export it into the package.

    Each stage prints its progress and keeps a checkpoint under --ckpt; a killed run resumes
    from there when the same command is run again, and finished stages are skipped. One run at
    a time works a --ckpt folder (it holds CKPT/train.lock): a second one stops at once (exit 3).
    --export-teacher only reads the folder: it runs beside a training run, and on a read-only copy.

    \b
    Example:
      clipmill train-model --threads 1
      clipmill train-model --device cuda --threads 8
      clipmill train-model --recipe smoke --ckpt /tmp/smoke
      clipmill train-model --ckpt /tmp/distil --from-teacher shapes --out /tmp/shapes
      clipmill train-model --export-teacher
    """
    import torch

    from clipmill.pipeline.models import SHAPES_DIR, quiet_hf
    from clipmill.pipeline.train.export import check_dest, export_model
    from clipmill.pipeline.train.export import export_teacher as export_teacher_folder
    from clipmill.pipeline.train.recipe import RECIPES, run_all, seed_from_teacher, verify_root
    from clipmill.jobs.core.preflight import check_device

    names = tuple(s.strip() for s in stages.split(",") if s.strip())
    if not names:
        raise click.BadParameter(f"{stages!r} names no stage; give one or more of {', '.join(STAGES)}", param_hint="--stages")
    if bad := [s for s in names if s not in STAGES]:
        raise click.BadParameter(f"{bad[0]!r} is not a stage; allowed: {', '.join(STAGES)}", param_hint="--stages")
    with domain_errors():  # before anything is written
        dev = torch.device(check_device(device or default_device()))
    torch.set_num_threads(threads)
    quiet_hf()
    root = Path(ckpt).expanduser() if ckpt else default_root(recipe)
    dest = Path(out).expanduser() if out else (SHAPES_DIR if recipe == "full" else root / "export")
    if not no_export:  # before anything is trained (the export checks it again)
        try:
            check_dest(dest / "teacher" if export_teacher else dest, root)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--out")
    t0 = time.time()

    def log(msg: str) -> None:
        click.echo(f"{time.strftime('%H:%M:%S')} {msg}", err=True)

    try:
        # SIGTERM stops it as Ctrl-C does (exit 130); the checkpoint folder is this run's until it ends.
        # --export-teacher only reads checkpoints, each written whole (replacing): it takes no lock,
        # so a teacher is exported while its run trains on, or from a folder it may not write to
        with interruptible(), contextlib.nullcontext() if export_teacher else hold_checkpoints(root):
            log(f"training recipe {recipe!r}, seed {seed}, on {dev} ({threads} CPU thread(s)), checkpoints in {root}")
            if export_teacher:
                verify_root(root, RECIPES[recipe].with_seed(seed))  # a smoke checkpoint is no shipped teacher
                log(f"exported the teacher to {export_teacher_folder(root, dest / 'teacher')}")
                return
            if from_teacher:  # seeds the folder; --stages then picks among its stages as without it
                teacher = SHAPES_DIR / "teacher" if from_teacher == "shapes" else Path(from_teacher).expanduser()
                seed_from_teacher(teacher, root, RECIPES[recipe].with_seed(seed), log, names)
            run_all(root, RECIPES[recipe].with_seed(seed), clean_caption, log, names, dev)
            if not no_export and "student" in names:
                # the full model's decode range is measured on its renders (the render check's limit);
                # the smoke recipe's few steps draw noise, with no range worth stating
                export_model(root, dest, clean=clean_caption if recipe == "full" else None)
                log(f"exported the model to {dest}")
    except (ValueError, FileNotFoundError) as e:
        raise BadInput(str(e))
    except OSError as e:  # a full disk, a read-only or missing folder: one line, not a traceback
        raise SetupError(f"writing under {root} or {dest} failed: {e.strerror or e}"
                         + (f" ({e.filename})" if e.filename else ""))
    except KeyboardInterrupt:
        log("interrupted: the checkpoints written so far are kept; run the same command again to resume")
        raise SystemExit(EXIT_INTERRUPTED)
    log(f"done in {(time.time() - t0) / 60:.1f} min")
