"""The shipped built-in ``shapes`` model (issue 11): what a user gets from ``pip install``.

It loads through ``from_pretrained`` from the package, a held-out prompt (a (colour, motion,
camera) combination never trained on) rendered at the fast tier draws the asked colour and
motion, and ``make demo``'s batch renders, passes QC in part and prints its adherence per clip.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from clipmill.jobs.cli import main
from clipmill.jobs.cli.train import clean_caption
from clipmill.pipeline import models, shapes
from clipmill.qc import adherence

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shapes_info():
    info = models.model_info(models.SHAPES)  # the package's folder: trained here, shipped as data
    assert info.path == models.SHAPES_DIR and info.world == "shapes" and info.scheduler == "lcm"
    return info


def test_a_held_out_prompt_at_the_fast_tier_draws_its_colour_and_motion(shapes_info):
    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer

    # motion is the model's weak attribute (README: about 6 in 10 held-out clips move the asked way);
    # this combination is one it draws (4 of these 4 seeds when it shipped), so a model that lost
    # what it composes, or a renderer that no longer samples it as trained, fails here
    spec = shapes.Spec(colour="red", shape="square", motion="moves left", background="grey", camera="static shot")
    assert shapes.is_held_out(spec)
    prompt = clean_caption(shapes.caption(spec))
    reqs = [ClipRequest(key=str(seed), prompt=prompt, seed=seed, frames=8, width=64, height=64) for seed in (1, 2, 3, 4)]
    results = Renderer(shapes_info).render(reqs, GroupSettings(tier="fast", sampler=shapes_info.scheduler))
    assert all(r.stats["steps"] == 6 and r.frames.shape == (8, 64, 64, 3) for r in results)
    reads = [adherence.analyze(r.frames) for r in results]
    assert [a.colour for a in reads] == ["red"] * 4
    assert sum(a.motion == "moves left" for a in reads) >= 3, [a.motion for a in reads]


def test_a_saturated_shape_growing_in_a_zoom_is_not_read_as_colour_blow_out(shapes_info, tmp_path, monkeypatch):
    import numpy as np

    from clipmill.jobs.runner.stages import convert_and_check
    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
    from clipmill.qc import QCConfig, metrics

    # a render QC rejected for "exposure: +0.12 saturation" (README, "QC", exposure): the flow
    # misplaces the green square's outline by a fraction of a pixel in every pair, always the
    # same way as it grows, and the summed saturation drift read that as blow-out
    req = ClipRequest(key="7", prompt="绿色方形向上移动, 黑色背景, zoom in", seed=1007, frames=8, width=64, height=64)
    (clip,) = Renderer(shapes_info).render([req], GroupSettings(tier="fast", sampler=shapes_info.scheduler))

    def post(frames, name):
        _, result, series, _ = convert_and_check(frames, 8, 30, str(tmp_path / name), QCConfig())
        return result, float(series.sat_drift.sum())

    result, drift = post(clip.frames, "good.mp4")
    assert not [r for r in result.reasons if r.startswith("exposure")], result.reasons
    assert drift < 0.08, drift
    with monkeypatch.context() as m:  # the outline counted, as before: the same clip read as blow-out
        m.setattr(metrics, "SAT_EDGE", float("inf"))
        assert post(clip.frames, "edges.mp4")[1] > QCConfig().exposure_saturation

    # real colour blow-out of the same clip is still caught: saturation climbing over the frame
    # (qc/synth.py's colour blow-out at its milder strength)
    f = clip.frames.astype(np.float32)
    ramp = (np.linspace(0, 1, len(f)) ** 1.5)[:, None, None, None]
    grey = f.mean(axis=3, keepdims=True)
    blown = grey + (f - grey) * (1 + 1.5 * ramp) + 35 * ramp * np.array([1.0, -0.3, -0.6])
    result, drift = post(np.clip(blown, 0, 255).astype(np.uint8), "blown.mp4")
    assert any(r.startswith("exposure") for r in result.reasons) and drift > 0.2, (drift, result.reasons)


def test_latents_decoded_at_the_wrong_vae_scale_are_caught_by_the_line_along_the_frame_edges(shapes_info, tmp_path):
    from clipmill.jobs.bench.failures import fault
    from clipmill.jobs.runner.stages import convert_and_check
    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
    from clipmill.qc import QCConfig

    # README, "QC", border: the decoder fed latents 3x too large (Stable Diffusion's 0.18215 taken
    # for this VAE's own factor) draws a line one or two pixels wide along the frame's edges,
    # which the good render of the same prompt and seed does not have (a beige and two black
    # backgrounds, from `bench --failures`' seed 21; on grey, the padding's own colour, there is none)
    prompts = {1001: "a yellow square moves right on a beige background, pan right",
               1008: "a white circle moves left on a black background, pan right",
               1015: "黄色三角形向左移动, 黑色背景, static shot"}
    reqs = [ClipRequest(key=str(s), prompt=p, seed=s, frames=8, width=64, height=64) for s, p in prompts.items()]
    settings = GroupSettings(tier="fast", sampler=shapes_info.scheduler)
    renderer = Renderer(shapes_info)
    good = renderer.render(reqs, settings)
    with fault(renderer, "vae-scaling", settings.steps) as detail:
        wrong = renderer.render(reqs, settings)
    assert detail["decoded_at"] > 2.5  # 0.556 / 0.18215

    def reasons(clip, name):
        return convert_and_check(clip.frames, 8, 30, str(tmp_path / name), QCConfig())[1].reasons

    for g, w in zip(good, wrong):
        assert not [r for r in reasons(g, f"good{g.key}.mp4") if r.startswith("border")]
        border = [r for r in reasons(w, f"wrong{w.key}.mp4") if r.startswith("border")]
        assert border and re.match(r"border: frames 0-26 \(a line along 3 of the frame's 4 sides stands apart from "
                                   r"the picture inside it by \d+\.\d > 6 levels: a decoder's edge artefact", border[0]), border


@pytest.mark.slow
def test_the_demo_batch_passes_qc_and_prints_adherence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", f"sqlite:///{tmp_path / 'clipmill.db'}")
    monkeypatch.delenv("CLIPMILL_MODEL")  # make demo's command as written: the default model
    monkeypatch.delenv("CLIPMILL_DRAWS", raising=False)  # and the default draws
    res = CliRunner().invoke(main, ["run", str(REPO / "examples" / "shapes-batch.csv"), "--out", "clipmill-out"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "jobs done 8/8" in res.output and re.search(r"failed\s+0\b", res.output), res.output
    # the target is 7 of 8, and the shipped model with its draws and one retry delivers
    # 7-8 (README, "Draws"); QC still rejects about a fifth of single renders, mostly for faint
    # boiling, and a clip near the boiling limit can fall either side from run to run (x264's
    # threaded encode is not bit-exact), so the test allows one clip more than the target
    passed = int(re.search(r"passed\s+(\d+)", res.output)[1])
    assert passed >= 6, res.output
    assert "adherence (8 clip(s) with prompts in the shapes grammar" in res.output
    share = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)%", res.output.split("  all: ")[1].splitlines()[0])}
    assert set(share) == set(shapes.ATTRIBUTES), res.output
    assert all(share[k] >= 87 for k in ("colour", "shape", "background", "camera")), share
    assert len(list((tmp_path / "clipmill-out").rglob("a*.mp4"))) >= 8


def test_the_teachers_networks_treat_both_axes_alike():
    """The shipped teacher's UNet and VAE are exactly transposition-equivariant once their
    kernels are transposed: ``f_T(x^T) == f(x)^T``. So the model's weak vertical direction
    (README, "Why the motion fails") is learnt from the data (pans and textures that vary along
    x), not built into the classes; a layer that broke this symmetry would fail here."""
    import torch
    from diffusers import AutoencoderKL, UNetMotionModel

    def transposed(module):
        out = copy.deepcopy(module)
        with torch.no_grad():
            for p in out.parameters():
                if p.ndim == 4 and p.shape[-1] == p.shape[-2] > 1:
                    p.copy_(p.transpose(-1, -2).clone())
        return out

    teacher = models.SHAPES_DIR / "teacher"
    g = torch.Generator().manual_seed(0)
    unet = UNetMotionModel.from_pretrained(teacher / "unet").eval()
    x, text = torch.randn(1, 4, 8, 16, 16, generator=g), torch.randn(8, 77, 64, generator=g)
    with torch.no_grad():
        a = unet(x, torch.tensor(500), encoder_hidden_states=text).sample
        b = transposed(unet)(x.transpose(-1, -2), torch.tensor(500), encoder_hidden_states=text).sample
    assert (a.transpose(-1, -2) - b).abs().max() < 1e-4
    vae = AutoencoderKL.from_pretrained(teacher / "vae").eval()
    img = torch.rand(2, 3, 64, 64, generator=g) * 2 - 1
    with torch.no_grad():
        z = vae.encode(img).latent_dist.mode()
        zt = transposed(vae).encode(img.transpose(-1, -2)).latent_dist.mode()
        d, dt = vae.decode(z).sample, transposed(vae).decode(z.transpose(-1, -2)).sample
    assert (z.transpose(-1, -2) - zt).abs().max() < 1e-4 and (d.transpose(-1, -2) - dt).abs().max() < 1e-4
    # not a trivial equality: the output itself is far from symmetric
    assert not torch.allclose(a, a.transpose(-1, -2), atol=1e-2)
