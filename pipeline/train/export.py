"""Writing the built-in ``shapes`` model folder from the training checkpoints.

``export_model(ckpt_dir, dest)`` takes the distilled student (``ckpt_dir/student/pipeline``, an
AnimateDiff folder with an LCMScheduler), stores its UNet in float16 (the largest part; the VAE
and text encoder stay float32), adds the undistilled teacher it was distilled from as a complete
folder of its own under ``teacher/`` (its UNet float16 too: ``clipmill bench``'s row 0, and what
``clipmill train-model --from-teacher`` distils again from), uses the ``decoder`` stage's VAE (the same
encoder, its decoder fine-tuned on whole clips) in both folders when that stage has run, adds ``clipmill.json`` (the model's defaults, the
world it draws, what each training stage reported, and how far its good decodes reach) and replaces ``dest`` atomically. The renderer loads it in float32
through ``from_pretrained`` like any user's folder (``pipeline.models``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors.torch import save_file

from .. import shapes
from ..choices import TIERS
from ..models import SHAPES, SHAPES_VERSION, model_info
from ..render import ClipRequest, GroupSettings, Renderer
from . import nets
from .distill import LCMConfig
from .recipe import STAGE_ORDER
from .stages import MarkerEmbeddings, _done, _load_state, export_pipeline, read_done

MAX_BYTES = 25 * 1024 * 1024  # the package's weights budget (issue 11)
# what measure_decode_limits renders: (frames, size) at both tiers, RANGE_CLIPS prompts each,
# the default clip and the longest and largest ones the model takes (a larger frame reaches
# further: more pixels). The decode range is the largest peak plus RANGE_HEADROOM, rounded up
# to the next RANGE_ROUND: the largest of 32 good 128x128 renders varies by about 0.05 between
# draws of prompts (1.18 and 1.24 for the shipped model). The decoder input's RMS range is the
# measured one widened by RMS_WIDEN each way, rounded outward to RANGE_ROUND (a wrong scaling
# factor moves it by the ratio of the two factors: 3.05 for Stable Diffusion's 0.18215)
RANGE_SHAPES = ((shapes.FRAMES, shapes.SIZE), (16, shapes.SIZE), (shapes.FRAMES, 2 * shapes.SIZE))
RANGE_CLIPS = 32
RANGE_HEADROOM = 0.05
RANGE_ROUND = 0.05
RMS_WIDEN = 1.25
MAX_FRAMES = 16  # the shapes world's range is 8-16 frames; training uses shapes.FRAMES
TEACHER = "teacher"  # the teacher's folder inside the model folder
RESUME = "resume"  # an unfinished teacher's trained (not averaged) UNet weights, inside its folder


def check_dest(dest: Path | str, ckpt_dir: Path | str) -> None:
    """Refuse an export folder ``dest`` for the checkpoints under ``ckpt_dir`` (ValueError): the
    export replaces ``dest`` whole, so it may not be a folder of other files (they would be
    deleted), nor the checkpoint folder, one holding it, or one inside it other than its
    ``export/`` folder (where the smoke recipe exports) and what is in that. ``export_model``
    and ``export_teacher`` check it first; ``clipmill train-model`` before it trains."""
    dest, root = Path(dest), Path(ckpt_dir)
    d, r = dest.resolve(), root.resolve()
    if d == r or d in r.parents:
        raise ValueError(f"{dest}: the export replaces this folder, which is or holds the checkpoint folder {root}; "
                         "give another folder")
    if r in d.parents and not (d == r / "export" or r / "export" in d.parents):
        raise ValueError(f"{dest}: inside the checkpoint folder {root} (only its export/ folder, or a folder in that, "
                         "may be); give another folder")
    if d.is_dir() and any(d.iterdir()) and not ((d / "model_index.json").exists() or (d / "clipmill.json").exists()):
        raise ValueError(f"{dest}: holds files but is not a model folder (no model_index.json); the export replaces "
                         "the folder whole: give a new or empty folder, or a model folder to replace")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def export_model(ckpt_dir: Path | str, dest: Path | str, max_bytes: int = MAX_BYTES,
                 clean: Callable[[str], str] | None = None) -> Path:
    """Write the shapes model folder at ``dest`` from the checkpoints under ``ckpt_dir``; with
    ``clean`` (the project's prompt cleaning), measure and write its render-check limits too
    (:func:`set_decode_limits`).

    Raises FileNotFoundError when the student stage has not finished, and ValueError when the
    folder would exceed ``max_bytes`` or ``dest`` may not be replaced (:func:`check_dest`);
    ``dest`` is left as it was in each case.
    """
    import torch
    from diffusers import AnimateDiffPipeline, AutoencoderKL

    ckpt_dir, dest = Path(ckpt_dir), Path(dest)
    check_dest(dest, ckpt_dir)
    src = ckpt_dir / "student" / "pipeline"
    if not _done(ckpt_dir, "student"):
        raise FileNotFoundError(f"{ckpt_dir / 'student' / 'done'} is missing: the distilled student is not trained "
                                "yet; run every stage first (make demo-model)")
    pipe = AnimateDiffPipeline.from_pretrained(src, dtype=torch.float32)
    pipe.unet.to(torch.float16)
    teacher = AnimateDiffPipeline.from_pretrained(ckpt_dir / "teacher" / "pipeline", dtype=torch.float32)
    teacher.unet.to(torch.float16)
    if _done(ckpt_dir, "decoder"):  # the fine-tuned decoder (same encoder) serves both folders
        vae = AutoencoderKL.from_pretrained(ckpt_dir / "decoder" / "model")
        pipe.register_modules(vae=vae)
        teacher.register_modules(vae=vae)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        teacher.save_pretrained(tmp / TEACHER, safe_serialization=True)
        stages = {stage: _stage_info(ckpt_dir, stage) for stage in STAGE_ORDER}
        recipe = ckpt_dir / "recipe.json"
        recipe_d = json.loads(recipe.read_text()) if recipe.exists() else {}
        guidance = (recipe_d.get("lcm") or {}).get("guidance", LCMConfig.guidance)
        prior = float((recipe_d.get("denoiser") or {}).get("noise_shared", 0.0))  # the student distils with it
        meta = {
            "model": SHAPES,
            "shapes_version": SHAPES_VERSION,
            "native_fps": shapes.FPS,
            "default_size": [shapes.SIZE, shapes.SIZE],
            "default_frames": shapes.FRAMES,
            "max_frames": MAX_FRAMES,
            "guidance_distilled": True,
            "world": "shapes",  # its prompts can be checked by qc.adherence
            "teacher": TEACHER,  # the undistilled teacher, sampled by DDIM at the guidance baked into the student
            "teacher_guidance": guidance,
            "noise_shared": prior,  # the noise prior it was trained with and must be sampled with (pipeline.noise)
            # the share common to the frames of the noise LCM draws between steps, when not the prior
            **({"renoise_shared": float(renoise)}
               if (renoise := (recipe_d.get("lcm") or {}).get("renoise_shared")) is not None else {}),
            "tiers": {name: tier.steps for name, tier in TIERS.items()},
            # the token ids of its frame markers (pipeline.frame_markers), as its teacher learnt them
            **({"frame_markers": list(ids)} if (ids := (stages["teacher"] or {}).get("frame_markers")) else {}),
            "distillation": "LCM consistency distillation on a 50-step DDIM grid; one student for both tiers",
            "training": {"recipe": recipe_d or None, "stages": stages},
        }
        (tmp / "clipmill.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        teacher_meta = {k: meta[k] for k in ("shapes_version", "native_fps", "default_size", "default_frames",
                                             "max_frames", "world")}
        teacher_meta.update(model=f"{SHAPES}/{TEACHER}", guidance_distilled=False, guidance=guidance,
                            noise_shared=float((stages["teacher"] or {}).get("noise_shared", 0.0)),
                            **({"frame_markers": meta["frame_markers"]} if "frame_markers" in meta else {}),
                            training={"recipe": recipe_d or None,
                                      "stages": {k: stages[k] for k in ("vae", "text", "teacher", "decoder")}})
        (tmp / TEACHER / "clipmill.json").write_text(json.dumps(teacher_meta, indent=1, ensure_ascii=False))
        size = folder_bytes(tmp)
        if size > max_bytes:
            raise ValueError(f"the exported model is {size / 2**20:.1f} MiB, over the limit of {max_bytes / 2**20:.1f} MiB")
        for folder in (tmp, tmp / TEACHER):  # both load as the renderer loads them
            AnimateDiffPipeline.from_pretrained(folder, dtype=torch.float32)
        if clean is not None:
            set_decode_limits(tmp, clean)
        _replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def measure_decode_limits(folder: Path | str, clean: Callable[[str], str], clips: int = RANGE_CLIPS,
                          seed: int = 0) -> dict:
    """The model's render-check limits (``ModelInfo.decode_range`` and ``decode_input_rms``),
    measured on good renders of ``clips`` shapes prompts (cleaned by ``clean``, as the renderer
    is given them) for each of :data:`RANGE_SHAPES` at both tiers:

    - ``decode_range``: the largest |value| the VAE's output reaches before clipping to [-1, 1],
      plus :data:`RANGE_HEADROOM`, rounded up to the next :data:`RANGE_ROUND`;
    - ``decode_input_rms``: the range of the RMS of the latents its decoder is given, widened
      by :data:`RMS_WIDEN` each way and rounded outward to :data:`RANGE_ROUND`;
    - ``measured``: the largest peak and the RMS range per (tier, frames, size)."""
    info = model_info(str(folder))
    rng = np.random.default_rng([seed, 0xDEC0])
    specs = shapes.all_specs()
    renderer = Renderer(info)
    measured: dict[str, dict] = {}
    try:
        for frames, size in RANGE_SHAPES:
            reqs = []
            for i in range(clips):
                spec = specs[int(rng.integers(len(specs)))]
                prompt = clean(shapes.caption(spec, "zh" if i % 2 else "en"))
                reqs.append(ClipRequest(key=i, prompt=prompt, seed=int(rng.integers(2**31)), frames=frames, width=size,
                                        height=size))
            for tier in TIERS:
                settings = GroupSettings(tier=tier, sampler=info.scheduler)
                results = [r for k in range(0, clips, 4) for r in renderer.render(reqs[k:k + 4], settings)]
                rms = [r.decode_input_rms for r in results]
                measured[f"{tier} {frames} frames {size}x{size}"] = {
                    "peak": round(max(r.decode_peak for r in results), 4),
                    "input_rms": [round(min(rms), 4), round(max(rms), 4)]}
    finally:
        renderer.close()
    peak = max(m["peak"] for m in measured.values())
    low = min(m["input_rms"][0] for m in measured.values())
    high = max(m["input_rms"][1] for m in measured.values())

    def step(x: float, up: bool) -> float:
        return round((math.ceil(x / RANGE_ROUND - 1e-9) if up else math.floor(x / RANGE_ROUND + 1e-9)) * RANGE_ROUND, 4)

    return {"decode_range": step(peak + RANGE_HEADROOM, True),
            "decode_input_rms": [step(low / RMS_WIDEN, False), step(high * RMS_WIDEN, True)],
            "measured": measured}


def set_decode_limits(folder: Path | str, clean: Callable[[str], str]) -> dict:
    """Measure ``folder``'s render-check limits (:func:`measure_decode_limits`) and write them
    into its clipmill.json and its teacher's (the same VAE), with what they were measured from."""
    folder = Path(folder)
    limits = measure_decode_limits(folder, clean)
    for meta_path in (folder / "clipmill.json", folder / TEACHER / "clipmill.json"):
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            meta["decode_range"] = limits["decode_range"]
            meta["decode_input_rms"] = limits["decode_input_rms"]
            meta["decode_limits_measured"] = {
                "rule": f"decode_range: the largest peak plus {RANGE_HEADROOM:g}, rounded up to the next "
                        f"{RANGE_ROUND:g}; decode_input_rms: the range measured, widened {RMS_WIDEN:g}x each way, "
                        f"rounded outward to {RANGE_ROUND:g}",
                "renders": limits["measured"]}
            meta_path.write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    return limits


def export_teacher(ckpt_dir: Path | str, dest: Path | str) -> Path:
    """Write the teacher alone at ``dest`` (a model folder's ``teacher/``): the finished teacher
    (``ckpt_dir/teacher/pipeline``), or an unfinished one's EMA weights at its last checkpoint
    (``teacher/state.pt``), with the VAE and text encoder of the earlier stages. Its
    clipmill.json says which (``training.stages.teacher``: ``step`` and ``finished``), so that
    ``train-model --from-teacher`` resumes an unfinished teacher instead of distilling it (an
    unfinished one also keeps its trained, not averaged, UNet weights under ``resume/``).
    Replaces ``dest`` atomically; refuses a ``dest`` that may not be replaced (:func:`check_dest`)."""
    import torch
    from diffusers import AnimateDiffPipeline, AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer

    ckpt_dir, dest = Path(ckpt_dir), Path(dest)
    check_dest(dest, ckpt_dir)
    recipe = ckpt_dir / "recipe.json"
    recipe_d = json.loads(recipe.read_text()) if recipe.exists() else {}
    stages = {s: _stage_info(ckpt_dir, s) for s in ("vae", "text")}
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        if _done(ckpt_dir, "teacher"):
            teacher = AnimateDiffPipeline.from_pretrained(ckpt_dir / "teacher" / "pipeline", dtype=torch.float32)
            info = {**_stage_info(ckpt_dir, "teacher"), "finished": True}
            teacher.unet.to(torch.float16)
            teacher.save_pretrained(tmp, safe_serialization=True)
        else:
            state = _load_state(ckpt_dir / "teacher" / "state.pt")
            marker_ids: list[int] = []
            if state is None:
                raise FileNotFoundError(f"{ckpt_dir / 'teacher' / 'state.pt'} is missing: the teacher has no checkpoint yet")
            spec = nets.UNetSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in state["unet"].items()})
            unet = nets.build_unet(spec)
            unet.load_state_dict(state["ema"])
            vae = AutoencoderKL.from_pretrained(ckpt_dir / "vae" / "model")
            te = CLIPTextModel.from_pretrained(ckpt_dir / "text" / "model")
            markers_from = int((recipe_d.get("denoiser") or {}).get("markers_from", 0))
            if state.get("markers_ema") is not None and state["step"] > markers_from:  # its frame markers, learnt
                markers = MarkerEmbeddings.from_state(state["markers_ema"])
                te, marker_ids = markers.write_into(te), list(markers.ids)
            tok = CLIPTokenizer.from_pretrained(ckpt_dir / "text" / "model", model_max_length=nets.MAX_TOKENS)
            export_pipeline(tmp, unet.to(torch.float16), vae, te, tok, nets.build_scheduler())
            # the trained (not averaged) weights too, so that a resume does not fall back to the
            # EMA, which lags the training by about 1 / (1 - decay) steps
            (tmp / RESUME).mkdir()
            save_file({k: v.half().contiguous() for k, v in state["model"].items()}, tmp / RESUME / "unet.safetensors")
            den = recipe_d.get("denoiser") or {}
            prior = float(den.get("noise_shared", 0.0)) if state["step"] > int(den.get("prior_from", 0)) else 0.0
            info = {"step": state["step"], "unet": state["unet"], "params": nets.count(unet), "finished": False,
                    "noise_shared": prior, **({"frame_markers": marker_ids} if marker_ids else {})}
        meta = {"model": f"{SHAPES}/{TEACHER}", "shapes_version": SHAPES_VERSION, "native_fps": shapes.FPS,
                "default_size": [shapes.SIZE, shapes.SIZE], "default_frames": shapes.FRAMES, "max_frames": MAX_FRAMES,
                "world": "shapes", "guidance_distilled": False,
                "guidance": (recipe_d.get("lcm") or {}).get("guidance", LCMConfig.guidance),
                "noise_shared": float(info.get("noise_shared", 0.0)),
                **({"frame_markers": info["frame_markers"]} if info.get("frame_markers") else {}),
                "training": {"recipe": recipe_d or None, "stages": {**stages, "teacher": info}}}
        (tmp / "clipmill.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
        AnimateDiffPipeline.from_pretrained(tmp, dtype=torch.float32)  # it loads as the renderer loads it
        _replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _replace(tmp: Path, dest: Path) -> None:
    """Put the finished folder ``tmp`` at ``dest``, replacing what was there (renames only); its
    callers have checked ``dest`` (:func:`check_dest`)."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}-old-{os.getpid()}")
        os.rename(dest, old)
    os.rename(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _stage_info(ckpt_dir: Path, stage: str) -> dict | None:
    """A finished stage's record (its ``done`` marker) as a shipped clipmill.json keeps it: without
    ``seeded_from``, the path of the folder a checkpoint was seeded from on the training machine."""
    info = read_done(ckpt_dir, stage)
    if info is not None:
        info.pop("seeded_from", None)
    return info
