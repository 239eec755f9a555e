"""The whole training of the shapes model, in order: ``vae``, ``text``, ``teacher``, ``student``,
``decoder`` (the VAE's decoder fine-tuned on whole clips, its encoder frozen).

A :class:`Recipe` is every stage's schedule and the networks' sizes. ``run_all`` runs the stages
one after another under one checkpoint root; each resumes from its own checkpoint and a finished
stage is skipped, so rerunning the same command after a kill continues where it stopped. The
root remembers the seed and network sizes it was started with (``recipe.json``) and refuses
others, so a resume never mixes two trainings.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Collection, Sequence

from safetensors import SafetensorError
from safetensors.torch import load_file

from ...storage.local import write_atomic
from . import nets
from .data import Clean, ShapesData
from .distill import LCMConfig, train_student
from .stages import (DecoderConfig, DenoiserConfig, Device, Log, MarkerEmbeddings, StageConfig, StageResult, _done,
                     _mark_done, export_pipeline, read_done, read_json, save_checkpoint, train_decoder, train_teacher,
                     train_text, train_vae)

STAGE_ORDER = ("vae", "text", "teacher", "student", "decoder")


@dataclass(frozen=True)
class Recipe:
    """Stage schedules and network sizes (the sizes themselves live in ``nets``). ``seed`` seeds
    every stage. ``denoiser`` is the teacher's UNet, loss and latent pool (the student shares the
    pool); ``lcm`` the distillation's settings; ``decoder`` and ``decoder_loss`` the decoder's
    fine-tuning."""

    name: str
    vae: StageConfig
    text: StageConfig
    teacher: StageConfig
    student: StageConfig
    decoder: StageConfig
    vae_channels: tuple[int, int, int] = nets.VAE_CHANNELS
    denoiser: DenoiserConfig = field(default_factory=DenoiserConfig)
    lcm: LCMConfig = field(default_factory=LCMConfig)
    decoder_loss: DecoderConfig = field(default_factory=DecoderConfig)
    seed: int = 0

    def with_seed(self, seed: int) -> Recipe:
        return replace(self, seed=seed, **{s: replace(getattr(self, s), seed=seed) for s in STAGE_ORDER})

    def stage(self, name: str, device: Device = "cpu") -> Callable[[Path, Clean, Log], StageResult]:
        """The stage ``name`` bound to this recipe, training on ``device``: ``fn(root, clean, log) -> StageResult``."""
        runs = {
            "vae": lambda root, clean, log: train_vae(root, self.vae, clean, log, channels=self.vae_channels, device=device),
            "text": lambda root, clean, log: train_text(root, self.text, clean, log, device=device),
            "teacher": lambda root, clean, log: train_teacher(root, self.teacher, clean, log, self.denoiser, device=device),
            "student": lambda root, clean, log: train_student(root, self.student, clean, log, self.lcm, self.denoiser,
                                                              device=device),
            "decoder": lambda root, clean, log: train_decoder(root, self.decoder, clean, log, self.decoder_loss,
                                                              device=device),
        }
        if name not in runs:
            raise ValueError(f"stage {name!r} is not known; allowed: {', '.join(STAGE_ORDER)}")
        return runs[name]

    def as_dict(self) -> dict:
        return asdict(self)


# The shipped model's recipe (what `clipmill train-model` and `make demo-model` run).
# The teacher: the 2.3 M UNet of nets.TEACHER on a pool of latents encoded once, lr 1e-3 (5x the
# first plan's 2e-4; the learning probes of ../shared/NOTES.md, "A cheaper teacher recipe"), the
# lr constant after warm-up, so a teacher that needs longer resumes with more ``steps`` seamlessly
# (the shipped one was planned at 10,000 and run on to 13,000 for the shape's motion). Its first
# 13,000 steps are on independent noise per frame; from there on (``prior_from``) it trains
# with the mixed noise prior (``noise_shared`` 0.5: half the noise's variance common to all
# frames; pipeline.noise), which it and its student are then sampled with: the shipped teacher
# ran 2,000 such steps (motion +9.5 points on 96 unseen prompts at step 14,400; on a pool of
# 4,096 clips, not the 16,384 below: the checkpoints of the first 13,000 steps were gone), then
# the student 1,000 steps distilled with the same prior. From step 15,000 on (``markers_from``) the
# teacher trains with frame markers (pipeline.frame_markers: one prompt per frame, its last token
# the frame's place in the clip; the markers' embeddings learnt with the UNet at lr 3e-4 / 3e-3,
# warmed up over 100 steps, the EMA warmed up again): the shipped teacher ran 2,000 such steps
# (on a fresh pool of 4,096 clips), then its student was distilled again with them.
# 0.36-0.88 s CPU a teacher step on 2 threads, by machine (the first plan: 2.2 s and 30,000 steps).
# The exported student is sampled with LCM's re-noising 95% common to the frames (``renoise_shared``;
# trained with the 0.5 prior): QC passed 81.5% of 200 unseen fast clips against 74%, motion the same.
# Last, the decoder is fine-tuned on whole clips with its encoder frozen (``decoder``; README, "The
# decoder"): the latents the denoisers learnt stay as they were, the moving shape's edges stop
# re-rolling from frame to frame.
FULL = Recipe(
    name="full",
    vae=StageConfig(steps=2500, batch=32, lr=1e-3, ckpt_every=100, log_every=25, eval_every=500),
    text=StageConfig(steps=600, batch=64, lr=1e-3, ckpt_every=100, log_every=50),
    teacher=StageConfig(steps=17000, batch=8, lr=1e-3, ckpt_every=100, log_every=50, eval_every=1000),
    student=StageConfig(steps=1000, batch=8, lr=5e-5, ckpt_every=100, log_every=25, eval_every=500),
    decoder=StageConfig(steps=4000, batch=16, lr=2e-4, ckpt_every=100, log_every=50, eval_every=500),
    denoiser=DenoiserConfig(unet=nets.TEACHER, pool_clips=16384, noise_shared=0.5, prior_from=13000, markers=8,
                            markers_from=15000),
    lcm=LCMConfig(renoise_shared=0.95),
)
# Every stage for a few steps with small networks: checks the whole chain in minutes. Its model
# draws nothing; it is never exported into the package.
SMOKE = Recipe(
    name="smoke",
    vae=StageConfig(steps=20, batch=16, lr=2e-3, ckpt_every=10, log_every=5, eval_every=0),
    text=StageConfig(steps=20, batch=32, lr=2e-3, ckpt_every=10, log_every=5, eval_every=0),
    teacher=StageConfig(steps=10, batch=2, lr=1e-3, ckpt_every=5, log_every=5, eval_every=0),
    student=StageConfig(steps=10, batch=2, lr=1e-4, ckpt_every=5, log_every=5, eval_every=0),
    decoder=StageConfig(steps=10, batch=8, lr=1e-3, ckpt_every=5, log_every=5, eval_every=0),
    vae_channels=(16, 16, 16),
    denoiser=DenoiserConfig(unet=nets.SMOKE, pool_clips=64),
)
RECIPES = {r.name: r for r in (FULL, SMOKE)}
IDENTITY = ("seed", "vae_channels", "denoiser.unet")  # what a checkpoint folder must keep


def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def check_root(root: Path, recipe: Recipe) -> None:
    """Refuse to resume ``root`` under another seed or other network sizes than it was started
    with (``root/recipe.json``); then record ``recipe`` there. Step counts and learning rates may
    change between runs (to train a stage longer, say), since they do not change what a
    checkpoint holds."""
    mine = verify_root(root, recipe)
    root.mkdir(parents=True, exist_ok=True)
    # whole or not at all: a full disk never leaves it cut short
    write_atomic(root / "recipe.json", lambda f: f.write(json.dumps(mine, indent=1).encode()))


def verify_root(root: Path, recipe: Recipe) -> dict:
    """Refuse ``root`` when its checkpoints were started with another seed or other network
    sizes than ``recipe`` (``root/recipe.json``, when there); returns ``recipe`` as recorded."""
    path = root / "recipe.json"
    mine = json.loads(json.dumps(recipe.as_dict()))  # tuples as lists, as read back
    if path.exists():
        try:
            theirs = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); it records the seed and sizes the checkpoints were "
                             "started with: restore it, or pick another checkpoint folder") from None
        if diff := [k for k in IDENTITY if _get(theirs, k) != _get(mine, k)]:
            raise ValueError(f"{root}: its checkpoints were started with " + ", ".join(f"{k} {_get(theirs, k)}" for k in diff)
                             + "; this run asks for " + ", ".join(f"{k} {_get(mine, k)}" for k in diff)
                             + f" (see {path}): resume with the same ones or pick another checkpoint folder")
    return mine


def run_all(root: Path, recipe: Recipe, clean: Clean, log: Log, stages: tuple[str, ...] = STAGE_ORDER,
            device: Device = "cpu") -> dict[str, StageResult]:
    """Run ``stages`` of ``recipe`` in order under ``root`` on ``device``; returns each stage's
    result. Checkpoints load onto the CPU whatever device wrote them and exported folders hold
    CPU tensors, so a run may resume on another device than it started on (the random streams
    of the noise differ between devices)."""
    order = check_stages(root, stages)
    check_root(root, recipe)
    losses = {}
    for i, name in enumerate(order, 1):
        log(f"== stage {i}/{len(order)}: {name} ({root / name})")
        losses[name] = recipe.stage(name, device)(root, clean, log)
    return losses


SEEDED = ("vae", "text", "teacher")
NEEDS = {"teacher": ("vae", "text"), "student": ("teacher",), "decoder": ("vae",)}  # what each stage reads


def check_stages(root: Path, stages: Sequence[str], done: Collection[str] = ()) -> list[str]:
    """``stages`` in the order they run (:data:`STAGE_ORDER`). Refuses (ValueError) a stage that
    is not known, and one that is not finished and needs a stage (:data:`NEEDS`) that does not
    run before it and is not finished in ``root``, nor among ``done`` (the stages a seeding
    is about to finish)."""
    for s in stages:
        if s not in STAGE_ORDER:
            raise ValueError(f"stage {s!r} is not known; allowed: {', '.join(STAGE_ORDER)}")
    order = [s for s in STAGE_ORDER if s in stages]

    def finished(stage: str) -> bool:
        return stage in done or _done(root, stage)

    for i, name in enumerate(order):  # what a stage reads must be done, or run before it now
        missing = [n for n in NEEDS.get(name, ()) if n not in order[:i] and not finished(n)]
        if missing and not finished(name):
            raise ValueError(f"--stages {','.join(order)}: the {name} stage needs the {', '.join(missing)} stage(s), "
                             f"which {root} has not finished; add them to --stages")
    return order


TEACHER_PARTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")  # what model_index.json must list
# the UNet's sizes a teacher is compared on with the recipe's (a config without one would load
# with diffusers' default, a far larger UNet)
UNET_KEYS = ("block_out_channels", "down_block_types", "up_block_types", "temporal_transformer_layers_per_block",
             "num_attention_heads", "motion_num_attention_heads", "cross_attention_dim")


def seed_from_teacher(folder: Path, root: Path, recipe: Recipe, log: Log, stages: Sequence[str] | None = None) -> None:
    """Start the checkpoint folder ``root`` from a teacher: an exported model's ``teacher/``
    folder (an AnimateDiff folder with its VAE, text encoder and v-prediction UNet). Its parts
    become the results of the ``vae``, ``text`` and ``teacher`` stages, marked done, so that only
    the student is left to train: distilling again (another recipe, a longer run) without
    training the teacher again. A teacher exported unfinished (``export_teacher``: its
    clipmill.json says ``finished: false`` and its step) is resumed instead: its weights become
    the teacher stage's checkpoint at that step (the EMA, and the trained weights from its
    ``resume/`` folder when there, with a fresh optimizer). A folder whose VAE's decoder was
    fine-tuned (its clipmill.json lists the ``decoder`` stage) marks that stage done too. Run again on the same ``root`` and ``folder`` (a resume),
    it does nothing. A finished teacher whose step is below the recipe's teacher steps is resumed
    the same way, from its EMA weights (to train the shipped teacher longer, raise the recipe's
    ``steps``). Refuses a ``root`` that holds any of those stages otherwise (a half-done
    seeding included: the ``done`` markers are written last), and a teacher whose UNet is not the
    recipe's size, except that a teacher it resumes may grow temporal transformer layers
    (``nets.grow_unet``: they start as the identity, so the teacher resumes where it was).

    The folder is read and checked whole before anything is written under ``root``: a JSON
    file of it cut short or of the wrong shape, a part that does not load, or a clipmill.json
    without the teacher's training record (``training.stages.teacher.step``) is a ValueError
    (FileNotFoundError for a missing file) naming the file and what is wrong. With ``stages``,
    the stages the run goes on with (``run_all``'s), a stage among them whose inputs neither
    ``root`` nor this seeding finishes (``--stages student`` after an unfinished teacher) is
    refused then too (:func:`check_stages`)."""
    import torch

    folder = Path(folder)
    if not (folder / "model_index.json").exists():
        raise FileNotFoundError(f"--from-teacher {folder}: {folder / 'model_index.json'} is missing; pass the teacher "
                                "folder of an exported shapes model (or 'shapes', the built-in model's)")
    seeded = [(read_done(root, s) or {}).get("seeded_from") for s in SEEDED]
    if seeded[:2] == [str(folder)] * 2 and (seeded[2] == str(folder) or (root / "teacher" / "state.pt").exists()):
        log(f"{root} was seeded from {folder} already: resuming")
        return
    if held := [s for s in SEEDED if (root / s).exists()]:
        raise ValueError(f"--from-teacher: {root} already holds the {', '.join(held)} stage(s) (not all seeded from "
                         f"{folder}); seed an empty checkpoint folder")
    try:
        meta, before = _teacher_record(folder)
        pipe = _load_teacher(folder)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"--from-teacher {folder}: {e}") from None
    want = nets.build_unet(recipe.denoiser.unet).config
    teacher = before["teacher"]
    diff = [k for k in UNET_KEYS if _norm(pipe.unet.config.get(k)) != _norm(want.get(k))]
    # a teacher resumes when it is unfinished, or finished short of the recipe's steps (a recipe
    # that trains it longer); it may then grow temporal layers (nets.grow_unet refuses anything else)
    finished, step = teacher.get("finished", True), teacher["step"]
    resumable = not finished or step < recipe.teacher.steps
    grow = diff == ["temporal_transformer_layers_per_block"] and resumable
    if diff and not grow:
        raise ValueError(f"--from-teacher {folder}: its UNet has " + ", ".join(f"{k}={pipe.unet.config.get(k)}" for k in diff)
                         + f"; the {recipe.name!r} recipe's has " + ", ".join(f"{k}={want.get(k)}" for k in diff))
    prior = float(meta.get("noise_shared", 0.0))
    wants = recipe.denoiser.shared_at(step) if resumable else recipe.denoiser.noise_shared
    if prior != wants:
        raise ValueError(f"--from-teacher {folder}: it was trained with noise_shared={prior:g} (its clipmill.json); the "
                         f"{recipe.name!r} recipe {'resumes it' if resumable else 'distils it'} with noise_shared={wants:g}"
                         " (a model is sampled with the noise prior it was trained with)")
    if pipe.scheduler.config.prediction_type != "v_prediction":
        raise ValueError(f"--from-teacher {folder}: prediction_type={pipe.scheduler.config.prediction_type!r}; "
                         "the distillation reads v-predictions ('v_prediction')")
    ids = teacher.get("frame_markers") or []
    if bad := [i for i in ids if not 0 <= i < pipe.text_encoder.config.vocab_size]:
        raise ValueError(f"--from-teacher {folder}: {folder / 'clipmill.json'}: training.stages.teacher.frame_markers "
                         f"{bad}: not token ids of its text encoder (0 to {pipe.text_encoder.config.vocab_size - 1})")
    if stages is not None:  # the stages to run after it: their inputs seeded, or run before them
        check_stages(root, stages, done={"vae", "text"} | ({"decoder"} if before.get("decoder") else set())
                     | (set() if resumable else {"teacher"}))
    parts = None
    if resumable:
        # an unfinished teacher (or a finished one the recipe trains longer): its EMA weights become
        # the model and the EMA at its step, with a fresh optimizer; the teacher stage resumes there
        spec = recipe.denoiser.unet
        ema = nets.grow_unet(pipe.unet.state_dict(), spec)
        trained = folder / "resume" / "unet.safetensors"  # the trained weights, ahead of the EMA
        try:
            model = nets.grow_unet(load_file(trained), spec) if trained.exists() else copy.deepcopy(ema)
        except (OSError, RuntimeError, SafetensorError) as e:
            raise ValueError(f"--from-teacher {folder}: {trained} does not load ({_first_line(e)})") from None
        if grow:
            log(f"grew the teacher's UNet from temporal layers {pipe.unet.config.temporal_transformer_layers_per_block} "
                f"to {spec.motion_layers} (the new layers start as the identity)")
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.teacher.lr, weight_decay=0.0)
        parts = {"model": model, "ema": ema, "opt": opt}
        if ids:  # learnt already: they resume from its text encoder's rows
            markers = MarkerEmbeddings.read_from(pipe.text_encoder, ids)
            parts.update(markers=markers, markers_ema=copy.deepcopy(markers))
    # everything is checked: write the stages' results, then their done markers last
    check_root(root, recipe)
    origin = {"seeded_from": str(folder)}
    pipe.vae.save_pretrained(root / "vae" / "model")
    if before.get("decoder"):  # its VAE's decoder was fine-tuned already: that stage is done too
        pipe.vae.save_pretrained(root / "decoder" / "model")
    pipe.text_encoder.save_pretrained(root / "text" / "model")
    pipe.tokenizer.save_pretrained(root / "text" / "model")
    if resumable:
        save_checkpoint(root / "teacher" / "state.pt", parts, ShapesData(lambda c: c, recipe.teacher.seed + step), step,
                        unet=recipe.denoiser.unet.as_dict(), **origin)
    else:
        export_pipeline(root / "teacher" / "pipeline", pipe.unet, pipe.vae, pipe.text_encoder, pipe.tokenizer,
                        pipe.scheduler)
    _mark_done(root, "vae", {**(before.get("vae") or {}), **origin})
    _mark_done(root, "text", {**(before.get("text") or {}), **origin})
    if before.get("decoder"):
        _mark_done(root, "decoder", {**before["decoder"], **origin})
    if not resumable:
        _mark_done(root, "teacher", {**teacher, **origin})
        log(f"seeded {root} from the teacher in {folder}: the vae, text and teacher stages are done")
        return
    log(f"seeded {root} from the {'finished' if finished else 'unfinished'} teacher in {folder}: the vae and text stages are done, the teacher "
        f"resumes at step {step} of the recipe's {recipe.teacher.steps}")


def _teacher_record(folder: Path) -> tuple[dict, dict]:
    """A teacher folder's clipmill.json and its record of the stages that trained it
    (``training.stages``), checked for what the seeding reads: the teacher's ``step`` (and
    ``finished``, ``frame_markers``), the noise prior. ValueError naming the file otherwise."""
    path = folder / "clipmill.json"
    meta = read_json(path)
    if meta.get("guidance_distilled"):  # an exported model's root: its student, not its teacher
        raise ValueError(f"a distilled student's folder (its clipmill.json says guidance_distilled); pass its teacher "
                         f"folder, {folder / (meta.get('teacher') or 'teacher')}")
    training = meta.get("training") or {}
    if not isinstance(training, dict):
        raise ValueError(f"{path}: training is not a JSON object (the record of how the model was trained)")
    before = training.get("stages") or {}
    if not isinstance(before, dict):
        raise ValueError(f"{path}: training.stages is not a JSON object (the record of the stages that trained it)")
    for stage in ("vae", "text", "teacher", "decoder"):
        if before.get(stage) is not None and not isinstance(before[stage], dict):
            raise ValueError(f"{path}: training.stages.{stage} is not a JSON object")
    teacher = before.get("teacher")
    if teacher is None or "step" not in teacher:
        what = "has no training.stages.teacher" if teacher is None else "training.stages.teacher has no 'step'"
        raise ValueError(f"{path}: {what} (the steps the teacher ran, which say whether it is finished); pass the "
                         "teacher folder of a model that clipmill train-model exported")
    if not _count(teacher["step"]):
        raise ValueError(f"{path}: training.stages.teacher.step={teacher['step']!r}: a number of steps, 0 or more")
    if not isinstance(teacher.get("finished", True), bool):
        raise ValueError(f"{path}: training.stages.teacher.finished={teacher['finished']!r}: true or false")
    ids = teacher.get("frame_markers") or []
    if not isinstance(ids, list) or not all(_count(i) for i in ids):
        raise ValueError(f"{path}: training.stages.teacher.frame_markers={ids!r}: a list of token ids")
    prior = meta.get("noise_shared", 0.0)
    if isinstance(prior, bool) or not isinstance(prior, (int, float)):
        raise ValueError(f"{path}: noise_shared={prior!r}: a number, the share of the noise common to the frames")
    return meta, before


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _load_teacher(folder: Path):
    """The AnimateDiff pipeline in a teacher folder, in float32. Every JSON file of it is read
    first and the UNet's config checked for its sizes (:data:`UNET_KEYS`), then its parts
    (:data:`TEACHER_PARTS`, of the classes its model_index.json names) load one by one, so that
    what is wrong is named: the file, or the part that does not load. ValueError otherwise."""
    import diffusers
    import torch
    import transformers
    from diffusers import AnimateDiffPipeline

    index_path = folder / "model_index.json"
    index = read_json(index_path)
    for path in sorted(folder.glob("*/*.json")):
        read_json(path)
    libraries = {"diffusers": diffusers, "transformers": transformers}
    parts = {}
    for name in TEACHER_PARTS:
        entry = index.get(name)
        if entry is None:
            raise ValueError(f"{index_path}: no {name!r} entry (an AnimateDiff folder lists {', '.join(TEACHER_PARTS)})")
        lib, cls = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        kind = getattr(libraries.get(lib), cls, None) if isinstance(cls, str) else None
        if not (isinstance(kind, type) and hasattr(kind, "from_pretrained")):
            raise ValueError(f"{index_path}: {name} is {entry!r}; expected [library, class] of a diffusers or "
                             "transformers class, e.g. [\"diffusers\", \"UNetMotionModel\"]")
        if name == "unet":
            config = read_json(folder / name / "config.json")
            if missing := [k for k in UNET_KEYS if k not in config]:
                raise ValueError(f"{folder / name / 'config.json'}: no {', '.join(map(repr, missing))} (the UNet's "
                                 "sizes; without them it would load as diffusers' default UNet)")
        try:
            parts[name] = kind.from_pretrained(folder / name, **({"dtype": torch.float32} if name in (
                "unet", "vae", "text_encoder") else {}))
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
            why = _first_line(e)
            if "mismatched_sizes" in why:  # diffusers and transformers offer to load it anyway, at random
                why = "its weights do not fit the sizes its config.json gives"
            raise ValueError(f"{folder / name} does not load as {lib}.{cls}: {why}") from None
    return AnimateDiffPipeline(motion_adapter=None, **parts)


def _norm(v):
    return list(v) if isinstance(v, (list, tuple)) else v

