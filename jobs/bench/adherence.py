"""``clipmill bench --adherence``: what distillation buys, measured by the shapes world's analyzer.

The same shapes-world prompts and seeds (half from the held-out (colour, motion, camera)
combinations, half in Chinese; ``ladder.world_requests``) are rendered by:

- the undistilled teacher at 50 DDIM steps with its guidance (the reference);
- the same teacher at 8 and at 6 DDIM steps, no distillation;
- the distilled student at the ``quality`` (8) and ``fast`` (6) tiers, rendered once a clip: the
  model's own adherence;
- the same student at both tiers with draws (``jobs.runner.draws``, the default of ``clipmill
  run``): a clip the analyzer reads wrong is rendered again from the next seed, up to
  ``DEFAULT_DRAWS`` renders. This is what a batch delivers, and it is selection by the same
  analyzer that scores the row, so it is reported beside the model's own rows, never instead.

Per row: adherence per attribute over all clips, over the held-out combinations and over the
training split; the share read right on all five (``all_right``); the same clips read by the
second reader (``qc.second_reader``, written apart from the analyzer: per attribute and all
five) and how often the two readers read the same five words (``readers_agree``): for the draws
rows, which the analyzer selected, the second reader's figure is the independent one; the
motion's confusion (``motion_confusion``: per asked motion, what the analyzer read, so that the
directions a model confuses show: up against down, say); and, for the student
rows, the share of clips that QC (the post stage's own code: interpolation, H.264, QC) passes.
Everything goes through the production renderer.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from clipmill.jobs.bench.failures import clips_by_kind, post
from clipmill.jobs.bench.ladder import world_requests
from clipmill.jobs.core.defaults import DEFAULT_DRAWS
from clipmill.jobs.runner.draws import render_drawing
from clipmill.pipeline import shapes
from clipmill.pipeline.models import ModelInfo, model_info
from clipmill.pipeline.render import GroupSettings, Renderer
from clipmill.qc import QCConfig
from clipmill.qc import adherence as adh
from clipmill.qc import second_reader


def _rows(info: ModelInfo, teacher: ModelInfo | None) -> list[tuple[str, bool, GroupSettings, int]]:
    """(name, teacher?, settings, draws) per row."""
    rows = []
    if teacher is not None:
        g = info.teacher_guidance
        for steps in (50, 8, 6):
            rows.append((f"teacher, DDIM {steps} steps, CFG {g:g}", True,
                         GroupSettings(tier="quality", sampler="ddim", guidance=g, step_count=steps), 1))
    tiers = (("quality", "quality tier (8 steps)"), ("fast", "fast tier (6 steps)"))
    for tier, label in tiers:
        rows.append((f"student, {label}", False, GroupSettings(tier=tier, sampler=info.scheduler), 1))
    for tier, label in tiers:
        rows.append((f"student, {label}, up to {DEFAULT_DRAWS} draws", False,
                     GroupSettings(tier=tier, sampler=info.scheduler), DEFAULT_DRAWS))
    return rows


def qc_pass_rate(results, fps_out: int, qc: QCConfig, info: ModelInfo | None = None) -> tuple[float, dict[str, int]]:
    """The share of clips the post stage passes (QC and the render check), and how many clips
    have a reason of each kind."""
    verdicts = [post(r, fps_out, qc, info)[1] for r in results]
    return sum(v.verdict == "pass" for v in verdicts) / len(results), clips_by_kind(verdicts)


def adherence_table(info: ModelInfo, clips: int = 200, device: str = "cpu", group: int = 8, fps_out: int = 30,
                    qc: QCConfig = QCConfig(), seed: int = 3, progress=None) -> dict:
    """Render ``clips`` shapes prompts with every row of :func:`_rows`; see the module doc."""
    if info.world != "shapes":
        raise ValueError(f"bench --adherence: model {info.name!r} is not a shapes-world model (its clipmill.json "
                         "has no \"world\": \"shapes\")")
    size, frames = info.default_size, info.default_frames
    reqs = world_requests(size, frames, clips, seed=seed)
    specs = [shapes.parse(r.prompt) for r in reqs]
    teacher = model_info(str(info.teacher)) if info.teacher is not None else None
    renderers = {False: Renderer(info, device=device)}
    t0 = time.perf_counter()
    out = []
    try:
        if teacher is not None:
            renderers[True] = Renderer(teacher, device=device)
        for name, is_teacher, settings, draws in _rows(info, teacher):
            if progress:
                progress(f"{name}: {clips} clips")
            t1 = time.perf_counter()
            drawn = [x for i in range(0, clips, group)
                     for x in render_drawing(renderers[is_teacher], reqs[i:i + group], settings, draws)]
            results = [d.result for d in drawn]
            seconds = (time.perf_counter() - t1) / clips
            a = [adh.analyze(r.frames) for r in results]
            second = [second_reader.read(r.frames) for r in results]
            row = {
                "row": name, "model": "teacher" if is_teacher else "student", "steps": settings.steps,
                "guidance": settings.guidance, "draws": draws, "render_s_per_clip": round(seconds, 4),
                "renders_per_clip": round(sum(d.draws for d in drawn) / clips, 4),
                "adherence": _round(adh.adherence(a, specs)),
                "adherence_heldout": _round(adh.adherence(a[0::2], specs[0::2])),
                "adherence_train": _round(adh.adherence(a[1::2], specs[1::2])),
                "motion_confusion": adh.confusion(a, specs, "motion"),
                "all_right": round(sum(x.label() == s.as_dict() for x, s in zip(a, specs)) / clips, 4),
                "second_reader": _round(_second(second, specs)),
                "readers_agree": round(sum(x.label() == y for x, y in zip(a, second)) / clips, 4),
            }
            if not is_teacher:
                rate, reasons = qc_pass_rate(results, fps_out, qc, info)
                row["qc_passed"], row["qc_reasons"] = round(rate, 4), reasons
            out.append(row)
    finally:
        for r in renderers.values():
            r.close()
    return {"model": info.name, "teacher": str(info.teacher) if teacher else None, "clips": clips,
            "heldout_clips": (clips + 1) // 2, "size": list(size), "frames": frames, "fps_out": fps_out,
            "rows": out, "seconds": round(time.perf_counter() - t0, 1)}


def _second(reads: list[dict], specs: list[shapes.Spec]) -> dict[str, float]:
    """Per attribute and over all five ('all'), the share of clips the second reader reads as asked."""
    out = adh.adherence([SimpleNamespace(**r) for r in reads], specs)  # its words, read as an Analysis's
    out["all"] = sum(r == s.as_dict() for r, s in zip(reads, specs)) / len(specs)
    return out


def _round(d: dict) -> dict:
    return {k: round(v, 4) for k, v in d.items()}


def motion_by_asked(confusion: dict[str, dict[str, int]]) -> str:
    """``right/asked`` per asked motion, in the grammar's order: '7/10 6/9 2/8 3/9 8/8'."""
    return " ".join(f"{row.get(asked, 0)}/{sum(row.values())}" for asked, row in confusion.items())
