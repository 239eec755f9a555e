"""Training the shapes model (issue 11): every stage learns, the student is a real LCM student of
the teacher, a killed stage resumes exactly, and the exported folder loads through
``from_pretrained`` as the built-in ``shapes`` model and renders at the fast tier.

The stages run a few steps of tiny networks, single-threaded, on fixed seeds: deterministic.
The VAE's and the text encoder's training losses fall (first steps against last steps). A
diffusion loss on random timesteps swings 10x from step to step, so the teacher and the student
are judged on their probe loss: the same loss on a fixed batch, timesteps and noise.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

from clipmill.jobs.cli.train import clean_caption
from clipmill.pipeline import models, shapes
from clipmill.pipeline.train import distill
from clipmill.pipeline.train.data import LatentPool, PoolData
from clipmill.pipeline.train.nets import UNetSpec
from clipmill.pipeline.train.recipe import Recipe, check_root, run_all
from clipmill.pipeline.train.stages import DenoiserConfig, StageConfig, train_vae


def _cfg(steps: int, batch: int, lr: float, log_every: int = 100) -> StageConfig:
    return StageConfig(steps=steps, batch=batch, lr=lr, ckpt_every=100, log_every=log_every, eval_every=0, seed=0)


TINY = Recipe(
    name="test",
    vae=_cfg(20, 16, 3e-3),
    text=_cfg(16, 32, 3e-3),
    teacher=_cfg(12, 2, 2e-2, log_every=4),  # lr warms up over 200 steps: 12 steps reach 1.2e-3
    student=_cfg(8, 2, 3e-3, log_every=4),
    decoder=_cfg(16, 16, 3e-3),  # 2 whole clips a step; lr warms up over 50 steps
    vae_channels=(16, 16, 16),
    denoiser=DenoiserConfig(unet=UNetSpec(channels=(16, 32, 32), heads=1, motion_heads=1), pool_clips=24),
    lcm=distill.LCMConfig(solver_steps=10),  # a 10-point grid: the probe's teacher solutions stay cheap
)


@pytest.fixture(scope="module")
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, single_thread):
    """Every stage of the tiny recipe, in order, under one checkpoint root."""
    root = tmp_path_factory.mktemp("train")
    lines: list[str] = []
    results = run_all(root, TINY, clean_caption, lines.append)
    return root, results, lines


def _mean(xs):
    return float(np.mean(xs))


@pytest.mark.slow
def test_every_stage_learns(trained):
    root, results, lines = trained
    assert list(results) == ["vae", "text", "teacher", "student", "decoder"]
    for stage in ("vae", "text", "decoder"):
        losses = results[stage].losses
        k = len(losses) // 4
        assert _mean(losses[-k:]) < 0.95 * _mean(losses[:k]), (stage, losses)
    for stage in ("teacher", "student"):
        probe = results[stage].probe
        steps = sorted(probe)
        assert steps[0] == 0 and steps[-1] == getattr(TINY, stage).steps
        assert probe[steps[-1]] < 0.97 * probe[0], (stage, probe)
    assert any(line.startswith("[student] step 8/8") for line in lines)  # progress with speed and eta
    for stage in ("vae", "text", "teacher", "student", "decoder"):
        assert (root / stage / "done").exists() and (root / stage / "state.pt").exists()
    assert any(line.startswith("[pool] encoding 24 train clips") for line in lines)  # encoded once, for both
    assert sum(line.startswith("[pool] encoding") for line in lines) == 1


@pytest.mark.slow
def test_a_rerun_skips_finished_stages_and_refuses_another_seed(trained):
    root, _, _ = trained
    again = run_all(root, TINY, clean_caption, lambda m: None)
    assert all(not r.losses for r in again.values())
    with pytest.raises(ValueError, match="seed 1"):
        check_root(root, TINY.with_seed(1))
    with pytest.raises(ValueError, match="denoiser.unet"):
        check_root(root, replace(TINY, denoiser=DenoiserConfig(unet=UNetSpec(channels=(16, 32, 64), heads=1, motion_heads=1))))


@pytest.mark.slow
def test_the_student_is_an_lcm_distilled_from_the_teacher(trained):
    from diffusers import LCMScheduler
    from safetensors.torch import load_file

    root, _, _ = trained
    folder = root / "student" / "pipeline"
    sched = LCMScheduler.from_pretrained(folder / "scheduler")
    n = TINY.lcm.solver_steps
    assert sched.config.prediction_type == "v_prediction" and sched.config.original_inference_steps == n
    grid = set(range(1000 // n - 1, 1000, 1000 // n))  # the DDIM grid it was distilled on
    for steps in (6, 8):  # the fast and quality tiers both sample subsets of it
        sched.set_timesteps(steps)
        assert set(sched.timesteps.tolist()) <= grid and len(sched.timesteps) == steps
    student = load_file(folder / "unet" / "diffusion_pytorch_model.safetensors")
    teacher = load_file(root / "teacher" / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors")
    assert student.keys() == teacher.keys()
    assert any(not torch.equal(student[k], teacher[k]) for k in student)
    done = json.loads((root / "student" / "done").read_text())
    assert done["lcm"] == asdict(TINY.lcm)


@pytest.mark.slow
def test_the_decoder_stage_tunes_the_decoder_and_leaves_the_encoder(trained):
    """The latents the denoisers were trained on stay what they were: only the decoder (and
    its post-quantisation conv) changes."""
    from safetensors.torch import load_file

    root, _, _ = trained
    before = load_file(root / "vae" / "model" / "diffusion_pytorch_model.safetensors")
    after = load_file(root / "decoder" / "model" / "diffusion_pytorch_model.safetensors")
    assert before.keys() == after.keys()
    tuned = {k for k in before if not torch.equal(before[k], after[k])}
    assert tuned and all(k.startswith(("decoder.", "post_quant_conv.")) for k in tuned)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(("encoder.", "quant_conv.")))


def test_the_decoder_loss_counts_an_error_that_changes_from_frame_to_frame():
    """The same reconstruction error in every frame costs less than errors of the same size
    that change between frames (what QC reads as boiling)."""
    from types import SimpleNamespace

    from clipmill.pipeline.train.stages import DecoderConfig, decoder_loss

    cfg = DecoderConfig(shape_gain=0.0, temporal=1.0)
    x = torch.zeros(1, 4, 3, 8, 8)
    alpha = torch.zeros(1, 4, 8, 8)

    class Fixed:  # an autoencoder whose every frame comes back with its own error pattern
        def __init__(self, errors):
            self.errors = errors

        def encode(self, frames):
            return SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: frames))

        def decode(self, z):
            return SimpleNamespace(sample=z + self.errors)

    same = torch.full((4, 3, 8, 8), 0.1)
    flips = same * torch.tensor([1.0, -1.0, 1.0, -1.0]).view(4, 1, 1, 1)
    steady, _ = decoder_loss(Fixed(same), x, alpha, cfg)
    boiling, _ = decoder_loss(Fixed(flips), x, alpha, cfg)
    plain, _ = decoder_loss(Fixed(flips), x, alpha, DecoderConfig(shape_gain=0.0, temporal=0.0))
    assert steady.item() == pytest.approx(plain.item())  # same per-frame error, no temporal cost
    assert boiling.item() == pytest.approx(plain.item() + 0.2**2)


def test_the_consistency_output_is_what_lcm_scheduler_steps_to():
    """The student is trained on c_skip x_t + c_out x0(v): LCMScheduler.step's ``denoised``."""
    lcm = distill.LCMConfig()
    sched = distill.lcm_scheduler({"prediction_type": "v_prediction", "beta_start": 0.00085, "beta_end": 0.012,
                                   "num_train_timesteps": 1000}, lcm)
    sched.set_timesteps(6)
    g = torch.Generator().manual_seed(0)
    acp = sched.alphas_cumprod
    for t in sched.timesteps:
        x, v = torch.randn((1, 4, 2, 4, 4), generator=g), torch.randn((1, 4, 2, 4, 4), generator=g)
        out = sched.step(v, t, x, generator=torch.Generator().manual_seed(1))
        c_skip, c_out = distill.boundary_scalings(t.view(1), lcm.timestep_scaling)
        x0, _ = distill._x0_eps(v, x, acp[t])
        torch.testing.assert_close(out.denoised, c_skip * x + c_out * x0, rtol=1e-4, atol=1e-5)
    t, s = distill.grid_timesteps(torch.tensor([0, 1, 49]), lcm)
    assert t.tolist() == [19, 39, 999] and s.tolist() == [0, 19, 979]


def test_grid_indices_are_uniform_or_tilted_towards_the_high_noise():
    """LCMConfig.grid_tilt: 0 draws the grid points uniformly (as LCM); 1 draws index i in
    proportion to i + 1, so the top point (t = 999) about 50 times as often as the lowest."""
    g = torch.Generator().manual_seed(0)
    flat = distill.grid_indices(20000, distill.LCMConfig(), g)
    tilted = distill.grid_indices(20000, distill.LCMConfig(grid_tilt=1.0), g)
    for idx in (flat, tilted):
        assert idx.dtype == torch.int64 and 0 <= int(idx.min()) and int(idx.max()) <= 49
    assert abs(flat.double().mean().item() - 24.5) < 0.5
    assert abs(tilted.double().mean().item() - 33.0) < 0.5  # sum i (i + 1) / sum (i + 1) = 33
    top, low = (tilted == 49).sum().item(), (tilted <= 4).sum().item()  # 50 against 1 + ... + 5 = 15
    assert 2.5 < top / low < 4.3
    with pytest.raises(ValueError, match="LCMConfig.grid_tilt=5"):
        distill.LCMConfig(grid_tilt=5)


def _spec_of(labels: list[int]) -> shapes.Spec:
    """The spec whose attribute indices (``data.labels_of``) are ``labels``."""
    return shapes.Spec(*(shapes.TRAIN_VOCAB[a][i] for a, i in zip(shapes.ATTRIBUTES, labels)))


def test_the_latent_pool_is_encoded_once_resumes_and_refuses_another_vae(tmp_path, monkeypatch):
    monkeypatch.setattr(LatentPool, "CHUNK", 4)
    calls = []

    def encode(vae, frames):  # stands in for the VAE: (B, T, 3, H, W) -> (B, C, T, h, w)
        calls.append(len(frames))
        return frames[:, :, :, ::4, ::4].permute(0, 2, 1, 3, 4) + vae

    pool = LatentPool.build(tmp_path / "pool", 0.0, "vae-a", 10, 3, lambda m: None, encode)
    assert pool.latents.shape == (10, 3, shapes.FRAMES, 16, 16) and pool.latents.dtype == torch.float16
    assert sum(calls) == 10
    (tmp_path / "pool" / "chunk-0001.pt").unlink()  # killed mid-build: only the missing chunk is encoded again
    again = LatentPool.build(tmp_path / "pool", 0.0, "vae-a", 10, 3, lambda m: None, encode)
    assert sum(calls) == 14 and torch.equal(again.latents, pool.latents)
    with pytest.raises(ValueError, match="other settings"):
        LatentPool.build(tmp_path / "pool", 0.0, "vae-b", 10, 3, lambda m: None, encode)
    data = PoolData(clean_caption, 0, pool)
    z, mask, captions, labels = data.latents(6)
    assert z.shape == (6, 3, shapes.FRAMES, 16, 16) and z.dtype == torch.float32 and len(captions) == 6
    assert mask.shape == (6, shapes.FRAMES, 16, 16) and 0 < mask.mean() < 0.25 and mask.max() == 1.0
    for cap, lab in zip(captions, labels.tolist()):  # every caption names its clip's spec
        spec = _spec_of(lab)
        assert cap in (clean_caption(shapes.caption(spec, "en")), clean_caption(shapes.caption(spec, "zh")))

    # played backwards: the reversed frames under the reversed spec's caption, never a held-out one
    plain, backwards = PoolData(clean_caption, 5, pool), PoolData(clean_caption, 5, pool)
    z0, m0, _, lab0 = plain.latents(200)
    z1, m1, caps1, lab1 = backwards.latents(200, reverse=1.0)
    assert torch.equal(z1.abs().sum(), z0.abs().sum())  # the same clips drawn (the rows come first)
    flipped = 0
    for i in range(200):
        spec, got = _spec_of(lab0[i].tolist()), _spec_of(lab1[i].tolist())
        back = shapes.reversed_spec(spec)
        assert not shapes.is_held_out(got)
        if back is not None and not shapes.is_held_out(back):
            flipped += 1
            assert got == back and torch.equal(z1[i], z0[i].flip(1)) and torch.equal(m1[i], m0[i].flip(0))
            assert caps1[i] in (clean_caption(shapes.caption(back, "en")), clean_caption(shapes.caption(back, "zh")))
        else:
            assert got == spec and torch.equal(z1[i], z0[i])
    assert 80 < flipped < 200


def test_a_pool_with_tilts_draws_that_share_of_vertical_camera_moves_and_keeps_the_rest(tmp_path):
    def encode(vae, frames):  # stands in for the VAE, as above
        return frames[:, :, :, ::4, ::4].permute(0, 2, 1, 3, 4)

    plain = LatentPool.build(tmp_path / "plain", None, "vae-a", 60, 3, lambda m: None, encode)
    tilted = LatentPool.build(tmp_path / "tilted", None, "vae-a", 60, 3, lambda m: None, encode, tilt=0.5)
    cams = [tilted.specs[int(i)].camera for i in tilted.spec_index]
    n = sum(c in shapes.TILTS for c in cams)
    assert 15 <= n <= 45 and set(cams) - set(shapes.TILTS)
    for i in range(60):  # a clip that is not a tilt is the clip the pool without tilts has
        if cams[i] not in shapes.TILTS:
            assert tilted.specs[int(tilted.spec_index[i])] == plain.specs[int(plain.spec_index[i])]
            assert torch.equal(tilted.latents[i], plain.latents[i])
    data = PoolData(clean_caption, 1, tilted)
    _, _, captions, labels = data.latents(60)
    for cap, lab in zip(captions, labels.tolist()):  # a tilt's caption says it, in its cleaned form
        spec = _spec_of(lab)
        assert cap in (clean_caption(shapes.caption(spec, "en")), clean_caption(shapes.caption(spec, "zh")))
        if spec.camera in shapes.TILTS:
            assert cap.endswith(spec.camera)
    with pytest.raises(ValueError, match="other settings"):  # a pool folder keeps its share
        LatentPool.build(tmp_path / "plain", None, "vae-a", 60, 3, lambda m: None, encode, tilt=0.5)
    with pytest.raises(ValueError, match="DenoiserConfig.tilt=1.0"):
        DenoiserConfig(tilt=1.0)


def test_a_killed_stage_resumes_exactly(tmp_path, single_thread):
    cfg = StageConfig(steps=6, batch=8, lr=3e-3, ckpt_every=2, log_every=2, eval_every=0, seed=3)
    whole = train_vae(tmp_path / "a", cfg, clean_caption, lambda m: None, channels=(16, 16, 16)).losses

    def kill_at_step_6(msg: str) -> None:
        if "step 6/6" in msg:  # logged before step 6's checkpoint: resumes from step 4
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_vae(tmp_path / "b", cfg, clean_caption, kill_at_step_6, channels=(16, 16, 16))
    lines: list[str] = []
    rest = train_vae(tmp_path / "b", cfg, clean_caption, lines.append, channels=(16, 16, 16)).losses
    assert "[vae] resumed at step 4" in lines
    assert rest == whole[4:]


@pytest.mark.slow
def test_export_loads_as_the_builtin_model_and_renders_the_fast_tier(trained, tmp_path, monkeypatch):
    from safetensors import safe_open

    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
    from clipmill.pipeline.train.export import MAX_BYTES, export_model, folder_bytes

    root, _, _ = trained
    dest = export_model(root, tmp_path / "shapes")
    assert folder_bytes(dest) < MAX_BYTES
    with safe_open(dest / "unet" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float16  # stored half, rendered float32
    meta = json.loads((dest / "clipmill.json").read_text())
    assert meta["tiers"] == {"fast": 6, "quality": 8} and meta["training"]["stages"]["student"]["step"] == 8
    assert meta["training"]["stages"]["decoder"]["step"] == TINY.decoder.steps
    from safetensors.torch import load_file

    tuned = load_file(root / "decoder" / "model" / "diffusion_pytorch_model.safetensors")
    for folder in (dest, dest / "teacher"):  # both folders decode with the fine-tuned decoder
        got = load_file(folder / "vae" / "diffusion_pytorch_model.safetensors")
        assert got.keys() == tuned.keys() and all(torch.equal(got[k], tuned[k]) for k in tuned)
    assert (meta["world"], meta["teacher"], meta["teacher_guidance"]) == ("shapes", "teacher", 3.0)
    with safe_open(dest / "teacher" / "unet" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float16

    monkeypatch.setattr(models, "SHAPES_DIR", dest)
    info = models.model_info(models.SHAPES)
    assert info.path == dest and info.family == "animatediff" and info.scheduler == "lcm"
    assert (info.default_frames, info.native_fps, info.default_size) == (shapes.FRAMES, shapes.FPS, (64, 64))
    assert info.max_frames == 16 and not info.is_tiny
    assert info.world == "shapes" and info.teacher == dest / "teacher" and info.teacher_guidance == 3.0
    assert models.model_info(str(info.teacher)).scheduler == "lightning"  # the teacher: DDPM-trained, not LCM

    renderer = Renderer(info)
    assert renderer.dtype == torch.float32
    prompt = clean_caption(shapes.caption(shapes.split_specs("heldout")[0]))
    req = ClipRequest(key="a", prompt=prompt, seed=5, frames=info.default_frames, width=64, height=64)
    (res,) = renderer.render([req], GroupSettings(tier="fast", sampler=info.scheduler))
    assert res.frames.shape == (8, 64, 64, 3) and res.frames.dtype == np.uint8
    assert res.stats["steps"] == 6 and res.fps == shapes.FPS
    assert res.frames.std() > 0  # a decoded clip, not a constant


@pytest.mark.slow
def test_the_student_can_be_distilled_again_from_a_shipped_teacher(trained, tmp_path):
    """An exported folder's teacher/ seeds a new checkpoint folder: the first three stages are
    done, only the student trains, and the export has both tiers' student and the same teacher."""
    from clipmill.pipeline.train.export import export_model
    from clipmill.pipeline.train.recipe import run_all, seed_from_teacher

    root, _, _ = trained
    first = export_model(root, tmp_path / "first")
    again = tmp_path / "again"
    lines: list[str] = []
    seed_from_teacher(first / "teacher", again, TINY, lines.append)
    assert all((again / s / "done").exists() for s in ("vae", "text", "teacher", "decoder"))  # its decoder was tuned
    assert json.loads((again / "teacher" / "done").read_text())["seeded_from"] == str(first / "teacher")
    results = run_all(again, TINY, clean_caption, lines.append, ("student",))
    assert list(results) == ["student"] and (again / "student" / "done").exists()
    dest = export_model(again, tmp_path / "second")
    assert models.model_info(str(dest)).scheduler == "lcm"
    seed_from_teacher(first / "teacher", again, TINY, lines.append)  # the same command again: a resume
    assert lines[-1].endswith(f"was seeded from {first / 'teacher'} already: resuming")
    with pytest.raises(ValueError, match="already holds the vae, text, teacher stage"):
        seed_from_teacher(dest / "teacher", again, TINY, lines.append)  # another teacher
    with pytest.raises(FileNotFoundError, match="model_index.json is missing"):
        seed_from_teacher(tmp_path, tmp_path / "x", TINY, lines.append)


@pytest.mark.slow
def test_an_unfinished_teacher_exported_and_seeded_resumes_at_its_step(trained, tmp_path):
    """A teacher killed mid-stage is exported from its last checkpoint (EMA weights, marked
    unfinished); seeding a new folder from it resumes the teacher stage at that step."""

    from clipmill.pipeline.train.export import export_teacher
    from clipmill.pipeline.train.recipe import seed_from_teacher

    root, _, _ = trained
    half = tmp_path / "half"
    for part in ("vae", "text"):
        shutil.copytree(root / part, half / part)
    (half / "teacher").mkdir()
    shutil.copy(root / "teacher" / "state.pt", half / "teacher" / "state.pt")  # no done marker: unfinished
    shutil.copy(root / "recipe.json", half / "recipe.json")
    folder = export_teacher(half, tmp_path / "shipped" / "teacher")
    meta = json.loads((folder / "clipmill.json").read_text())
    assert meta["training"]["stages"]["teacher"]["finished"] is False
    assert meta["training"]["stages"]["teacher"]["step"] == TINY.teacher.steps
    assert (folder / "resume" / "unet.safetensors").exists()  # the trained weights, beside the EMA
    longer = replace(TINY, teacher=replace(TINY.teacher, steps=TINY.teacher.steps + 2))
    again, lines = tmp_path / "again", []
    seed_from_teacher(folder, again, longer, lines.append)
    assert not (again / "teacher" / "done").exists() and (again / "teacher" / "state.pt").exists()
    seeded, trained_state = torch.load(again / "teacher" / "state.pt", weights_only=False), torch.load(
        root / "teacher" / "state.pt", weights_only=False)
    for part in ("model", "ema"):  # each from its own weights (stored half precision)
        key = next(k for k in trained_state[part] if k.endswith("conv_in.weight"))
        torch.testing.assert_close(seeded[part][key], trained_state[part][key].half().float())
    run_all(again, longer, clean_caption, lines.append, ("teacher",))
    assert f"[teacher] resumed at step {TINY.teacher.steps}" in lines
    assert json.loads((again / "teacher" / "done").read_text())["step"] == TINY.teacher.steps + 2
    finished = export_teacher(again, tmp_path / "shipped2" / "teacher")
    assert json.loads((finished / "clipmill.json").read_text())["training"]["stages"]["teacher"]["finished"] is True

    # a recipe whose UNet adds temporal layers grows the unfinished teacher and resumes it
    grown = replace(longer, denoiser=replace(TINY.denoiser, unet=replace(TINY.denoiser.unet, motion_layers=(1, 1, 1))))
    big, lines = tmp_path / "grown", []
    seed_from_teacher(folder, big, grown, lines.append)
    assert any(line.startswith("grew the teacher's UNet from temporal layers") for line in lines)
    run_all(big, grown, clean_caption, lines.append, ("teacher",))
    assert f"[teacher] resumed at step {TINY.teacher.steps}" in lines
    assert json.loads((big / "teacher" / "done").read_text())["step"] == TINY.teacher.steps + 2
    with pytest.raises(ValueError, match="temporal_transformer_layers_per_block"):  # a finished one does not grow
        seed_from_teacher(finished, tmp_path / "grown2", grown, lines.append)

    # a finished teacher with a recipe that trains it longer resumes from its EMA weights
    longest = replace(TINY, teacher=replace(TINY.teacher, steps=TINY.teacher.steps + 4))
    on, lines = tmp_path / "on", []
    seed_from_teacher(finished, on, longest, lines.append)
    assert any(line.endswith(f"the teacher resumes at step {TINY.teacher.steps + 2} of the recipe's "
                             f"{TINY.teacher.steps + 4}") and "from the finished teacher" in line for line in lines), lines
    run_all(on, longest, clean_caption, lines.append, ("teacher",))
    assert f"[teacher] resumed at step {TINY.teacher.steps + 2}" in lines
    assert json.loads((on / "teacher" / "done").read_text())["step"] == TINY.teacher.steps + 4


def test_the_shapes_name_says_how_to_build_it_until_it_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "SHAPES_DIR", tmp_path / "absent")
    with pytest.raises(models.ModelError, match="the shapes model is not built yet: run make demo-model"):
        models.model_info("shapes")
    with pytest.raises(models.ModelError, match="'shapes'"):  # listed among the names a user may pass
        models.resolve(str(tmp_path / "nowhere"))


def test_export_refuses_an_unfinished_training(tmp_path):
    from clipmill.pipeline.train.export import export_model

    with pytest.raises(FileNotFoundError, match="student/done is missing"):
        export_model(tmp_path / "ck", tmp_path / "out")  # (not inside the checkpoint folder: check_dest refuses that)
    assert not (tmp_path / "out").exists()


def test_train_model_rejects_an_unknown_stage(tmp_path):
    from click.testing import CliRunner

    from clipmill.jobs.cli import main

    r = CliRunner().invoke(main, ["train-model", "--ckpt", str(tmp_path), "--stages", "vae,unet"])
    assert r.exit_code == 2 and "'unet' is not a stage" in r.output


def test_a_pool_rendered_by_several_processes_is_the_pool_one_renders(tmp_path):
    """On a GPU host the pool's clips are rendered by a process pool: the same clips, in order."""
    def encode(vae, frames):
        return frames[:, :, :, ::4, ::4].permute(0, 2, 1, 3, 4)

    one = LatentPool.build(tmp_path / "one", None, "vae-a", 12, 5, lambda m: None, encode)
    many = LatentPool.build(tmp_path / "many", None, "vae-a", 12, 5, lambda m: None, encode, workers=2)
    assert torch.equal(one.latents, many.latents) and torch.equal(one.masks, many.masks)
    assert torch.equal(one.spec_index, many.spec_index)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a CUDA GPU")
def test_train_model_on_a_device_this_machine_lacks_says_so(tmp_path):
    from click.testing import CliRunner

    from clipmill.jobs.cli import main

    r = CliRunner().invoke(main, ["train-model", "--ckpt", str(tmp_path), "--device", "cuda", "--recipe", "smoke"])
    assert r.exit_code == 3, r.output
    assert "Error: --device cuda: this torch build has no CUDA support; allowed here: cpu" in r.output
    r = CliRunner().invoke(main, ["train-model", "--ckpt", str(tmp_path), "--device", "tpu", "--recipe", "smoke"])
    assert r.exit_code == 2 and "Error: --device 'tpu': not a device; allowed: cpu, cuda, cuda:N, mps" in r.output
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_shape_weight_and_latent_mask_put_the_weight_where_the_shape_is():
    from clipmill.pipeline.train.data import latent_mask
    from clipmill.pipeline.train.stages import shape_weight

    clip = shapes.render(shapes.Spec("red", "square", "moves right", "grey", "static shot"), 3)
    alpha = torch.from_numpy(clip.alpha[None])  # (1, T, 64, 64)
    mask = latent_mask(alpha, 16).float()
    assert mask.shape == (1, shapes.FRAMES, 16, 16) and mask.max() == 1.0
    for t in (0, shapes.FRAMES - 1):  # the mask's cells are where the shape is, in every frame
        ys, xs = np.nonzero(clip.alpha[t] > 0.5)
        assert mask[0, t, ys // 4, xs // 4].min() >= 0.5
        assert mask[0, t].sum() < 0.25 * 256
    cx = [float((mask[0, t].sum(0) * torch.arange(16)).sum() / mask[0, t].sum()) for t in range(shapes.FRAMES)]
    assert cx[-1] > cx[0] + 1.5  # it moves right with the shape
    w = shape_weight(mask, 8.0)
    assert w.shape == (1, 1, shapes.FRAMES, 16, 16)
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-5)
    assert float(w.max() / w.min()) == pytest.approx(9.0, rel=1e-4)  # 1 + gain against 1
    flat = shape_weight(torch.zeros(2, shapes.FRAMES, 16, 16), 8.0)
    assert torch.equal(flat, torch.ones_like(flat))  # no shape: the plain loss


def test_timestep_weight_keeps_the_high_noise_steps_in_the_loss_with_min_snr_plus1():
    from clipmill.pipeline.train.stages import timestep_weight

    snr = torch.tensor([0.005, 0.2, 1.0, 4.0, 9.0, 99.0])
    old = timestep_weight(snr, 5.0, "min_snr")
    new = timestep_weight(snr, 5.0, "min_snr_plus1")
    assert torch.allclose(old, torch.tensor([0.005 / 1.005, 0.2 / 1.2, 0.5, 0.8, 0.5, 0.05]), atol=1e-6)
    assert torch.allclose(new, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 0.05]), atol=1e-6)  # the same cap at low noise
    with pytest.raises(ValueError, match=r"weighting='snr'; allowed: min_snr, min_snr_plus1"):
        timestep_weight(snr, 5.0, "snr")
    with pytest.raises(ValueError, match=r"DenoiserConfig.weighting='snr'"):
        DenoiserConfig(weighting="snr")


def test_grow_unet_adds_temporal_layers_that_start_as_the_identity(single_thread):
    from clipmill.pipeline.train import nets

    small = UNetSpec(channels=(16, 32, 32), heads=1, motion_heads=1)
    big = replace(small, motion_layers=(1, 1, 1))
    torch.manual_seed(0)
    old = nets.build_unet(small).eval()
    new = nets.grow_unet(old.state_dict(), big).eval()
    assert nets.count(new) > nets.count(old)
    x, t = torch.randn(1, 4, shapes.FRAMES, 16, 16), torch.tensor([500])
    ehs = torch.randn(shapes.FRAMES, 5, nets.TEXT_WIDTH)
    with torch.no_grad():
        torch.testing.assert_close(new(x, t, encoder_hidden_states=ehs).sample, old(x, t, encoder_hidden_states=ehs).sample)
    with pytest.raises(ValueError, match=r"weight\(s\) have no place in UNetSpec"):
        nets.grow_unet(new.state_dict(), small)  # layers are never dropped
    with pytest.raises(ValueError, match="has shape"):
        nets.grow_unet(old.state_dict(), replace(big, channels=(16, 32, 48)))


@pytest.mark.slow
def test_a_teacher_fine_tuned_with_the_noise_prior_carries_it_to_the_student_and_the_renderer(trained, tmp_path):
    """The shipped teacher's path: trained on independent noise, then fine-tuned with the mixed
    prior (``noise_shared`` after ``prior_from``) and distilled with it. The exported folders
    declare the prior, so the renderer samples with it; a recipe with another prior refuses it."""
    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
    from clipmill.pipeline.train.export import export_model
    from clipmill.pipeline.train.recipe import seed_from_teacher

    root, _, _ = trained
    first = export_model(root, tmp_path / "first")
    assert json.loads((first / "teacher" / "clipmill.json").read_text())["noise_shared"] == 0.0
    assert "renoise_shared" not in json.loads((first / "clipmill.json").read_text())  # the recipe asks for none
    prior = replace(TINY, teacher=replace(TINY.teacher, steps=TINY.teacher.steps + 2),
                    denoiser=replace(TINY.denoiser, noise_shared=0.5, prior_from=TINY.teacher.steps),
                    lcm=replace(TINY.lcm, renoise_shared=0.9))
    again, lines = tmp_path / "prior", []
    seed_from_teacher(first / "teacher", again, prior, lines.append)
    run_all(again, prior, clean_caption, lines.append, ("teacher", "student"))
    assert json.loads((again / "teacher" / "done").read_text())["noise_shared"] == 0.5
    dest = export_model(again, tmp_path / "shipped")
    for folder in (dest, dest / "teacher"):
        assert json.loads((folder / "clipmill.json").read_text())["noise_shared"] == 0.5
        assert models.model_info(str(folder)).noise_shared == 0.5
    info = models.model_info(str(dest))
    assert (info.renoise_shared, info.renoise) == (0.9, 0.9)  # the recipe's LCMConfig.renoise_shared, the student's only
    assert models.model_info(str(dest / "teacher")).renoise == 0.5
    req = ClipRequest(key="a", prompt=clean_caption(shapes.caption(shapes.split_specs("train")[0])), seed=5, frames=8,
                      width=64, height=64)
    (res,) = Renderer(info).render([req], GroupSettings(tier="fast", sampler=info.scheduler))
    assert res.frames.shape == (8, 64, 64, 3) and res.frames.std() > 0

    # the student of a prior-trained teacher is distilled with that prior, not another
    with pytest.raises(ValueError) as e:
        seed_from_teacher(dest / "teacher", tmp_path / "other", TINY, lines.append)
    assert str(e.value) == (f"--from-teacher {dest / 'teacher'}: it was trained with noise_shared=0.5 (its "
                            "clipmill.json); the 'test' recipe distils it with noise_shared=0 (a model is sampled "
                            "with the noise prior it was trained with)")


def test_the_temporal_error_is_the_error_in_how_frames_change():
    from clipmill.pipeline.train.stages import temporal_error

    g = torch.Generator().manual_seed(0)
    same = torch.randn((4, 4, 1, 8, 8), generator=g).expand(4, 4, 8, 8, 8)
    w = torch.ones(4)
    assert float(temporal_error(same, w)) == 0.0  # the same error in every frame: no change is wrong
    iid = torch.randn((4, 4, 8, 16, 16), generator=g)
    assert abs(float(temporal_error(iid, w)) - float((iid**2).mean())) < 0.03  # independent: its own size
    assert float(temporal_error(iid, torch.tensor([2.0, 0, 0, 0]))) < float(temporal_error(iid, w))


def test_temporal_match_holds_the_background_changes_to_the_clips_and_fades_with_noise():
    """The student's optional term (LCMConfig.temporal): zero when the output changes from frame
    to frame as the clip does (a pan included), positive when the background re-rolls every
    frame, blind to the shape's cells, and weighted by alpha_bar(t)."""
    g = torch.Generator().manual_seed(0)
    z0 = torch.randn(2, 4, 8, 16, 16, generator=g)
    panned = torch.stack([torch.roll(z0[:, :, 0], i, dims=-1) for i in range(8)], dim=2)  # a pan: the clip's own change
    background = torch.ones(2, 1, 8, 16, 16)
    a = torch.ones(2, 1, 1, 1, 1)
    assert distill.temporal_match(panned, panned, a, background).item() == 0.0
    boiling = panned + 0.1 * torch.randn(panned.shape, generator=g)
    loud = distill.temporal_match(boiling, panned, a, background).item()
    assert loud == pytest.approx(2 * 0.1**2, rel=0.1)  # the difference of two independent re-rolls
    top = torch.zeros_like(background)  # the background is the top 4 rows; the shape is below
    top[:, :, :, :4] = 1.0
    moved = panned.clone()
    moved[:, :, :, 4:] += torch.randn(moved[:, :, :, 4:].shape, generator=g)  # only where the shape is
    assert distill.temporal_match(moved, panned, a, top).item() == 0.0
    assert distill.temporal_match(boiling, panned, 0.25 * a, background).item() == pytest.approx(loud / 4)
    with pytest.raises(ValueError, match="LCMConfig.temporal=-1"):
        distill.LCMConfig(temporal=-1)


@pytest.mark.slow
def test_a_teacher_fine_tuned_with_frame_markers_carries_them_to_the_student_and_the_renderer(trained, tmp_path):
    """The shipped teacher's last phase: from ``markers_from`` on it trains with one prompt per
    frame (``pipeline.frame_markers``), learning the markers' embeddings and nothing else of the
    text encoder; the student distils with them, both folders declare them, and the renderer
    encodes each frame's prompt with them (and a stream, the plain prompt)."""
    from transformers import CLIPTextModel

    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
    from clipmill.pipeline.train.export import export_model
    from clipmill.pipeline.train.recipe import seed_from_teacher
    from clipmill.pipeline.train.stages import tokenize

    root, _, _ = trained
    first = export_model(root, tmp_path / "first")
    marked = replace(TINY, teacher=replace(TINY.teacher, steps=TINY.teacher.steps + 4),
                     denoiser=replace(TINY.denoiser, markers=8, markers_from=TINY.teacher.steps))
    again, lines = tmp_path / "marked", []
    seed_from_teacher(first / "teacher", again, marked, lines.append)
    run_all(again, marked, clean_caption, lines.append, ("teacher", "student"))
    assert any("has no 'markers': it starts fresh" in line for line in lines)
    assert json.loads((again / "teacher" / "done").read_text())["frame_markers"] == list(range(1, 9))
    dest = export_model(again, tmp_path / "shipped")
    for folder in (dest, dest / "teacher"):
        assert json.loads((folder / "clipmill.json").read_text())["frame_markers"] == list(range(1, 9))
        assert models.model_info(str(folder)).frame_markers == tuple(range(1, 9))
    # only the markers' rows of the text encoder were trained
    before = CLIPTextModel.from_pretrained(first / "text_encoder").get_input_embeddings().weight
    after = CLIPTextModel.from_pretrained(dest / "text_encoder").get_input_embeddings().weight
    changed = (before != after).any(dim=1).nonzero().flatten().tolist()
    assert changed == list(range(1, 9))

    # exported unfinished (from its checkpoint) the teacher keeps its markers, and a resume of it
    # trains on from them instead of starting them fresh
    from clipmill.pipeline.train.export import export_teacher

    (again / "teacher" / "done").rename(again / "teacher" / "done.kept")
    try:
        unfinished = export_teacher(again, tmp_path / "unfinished")
    finally:
        (again / "teacher" / "done.kept").rename(again / "teacher" / "done")
    assert json.loads((unfinished / "clipmill.json").read_text())["frame_markers"] == list(range(1, 9))
    kept = CLIPTextModel.from_pretrained(unfinished / "text_encoder").get_input_embeddings().weight
    assert torch.equal(kept, after)
    longer = replace(marked, teacher=replace(marked.teacher, steps=marked.teacher.steps + 1))
    resumed, more = tmp_path / "resumed", []
    seed_from_teacher(unfinished, resumed, longer, more.append)
    run_all(resumed, longer, clean_caption, more.append, ("teacher",))
    fresh = [line for line in more if "it starts fresh" in line]
    assert len(fresh) == 1 and "has no 'marker_opt'" in fresh[0]  # a fresh optimizer, as the UNet's

    info = models.model_info(str(dest))
    renderer = Renderer(info)
    prompt = clean_caption(shapes.caption(shapes.split_specs("train")[0]))
    rows = renderer.encode([prompt, prompt], 8)
    assert rows.shape[0] == 16 and torch.equal(rows[:8], rows[8:])
    with torch.no_grad():
        ids = tokenize(renderer.pipe.tokenizer, [prompt]).repeat(8, 1)
        ids[:, -1] = torch.arange(1, 9)
        assert torch.allclose(rows[:8], renderer.pipe.text_encoder(ids)[0], atol=1e-6)
    assert renderer.encode([prompt]).shape[0] == 1  # a stream's frames have no place: the plain prompt
    req = ClipRequest(key="a", prompt=prompt, seed=5, frames=8, width=64, height=64)
    (res,) = renderer.render([req], GroupSettings(tier="fast", sampler=info.scheduler))
    assert res.frames.shape == (8, 64, 64, 3) and res.frames.std() > 0
    # the text K/V cache stays exact with per-frame prompts
    plain = Renderer(info, options=replace(renderer.options, text_kv=False))
    (ref,) = plain.render([req], GroupSettings(tier="fast", sampler=info.scheduler))
    assert np.array_equal(ref.frames, res.frames)


def test_train_model_refuses_an_export_or_a_teacher_that_would_lose_data(tmp_path):
    """Each was accepted: the export replaced a folder of other files (or the checkpoint folder
    itself) whole; an exported model's root, its distilled student, was distilled again as if
    it were a teacher; a smoke checkpoint exported without --recipe smoke replaced the shipped
    teacher; a recipe.json cut short by a full disk failed every later run without its name."""
    from click.testing import CliRunner

    from clipmill.jobs.cli import main
    from clipmill.pipeline.train.recipe import RECIPES

    def train(*args):
        return CliRunner().invoke(main, ["train-model", "--recipe", "smoke", *args])

    ck = tmp_path / "ck"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "n.txt").write_text("keep me")
    r = train("--ckpt", str(ck), "--out", str(tmp_path / "notes"))
    assert r.exit_code == 2 and (f"Invalid value for --out: {tmp_path / 'notes'}: holds files but is not a model folder "
                                 "(no model_index.json)") in r.output
    for out in (ck, tmp_path):
        r = train("--ckpt", str(ck), "--out", str(out))
        assert r.exit_code == 2 and f"which is or holds the checkpoint folder {ck}" in r.output, r.output
    r = train("--ckpt", str(ck), "--out", str(ck / "vae"))
    assert r.exit_code == 2 and "inside the checkpoint folder" in r.output
    assert (tmp_path / "notes" / "n.txt").read_text() == "keep me" and not ck.exists()

    r = train("--ckpt", str(ck), "--from-teacher", str(models.SHAPES_DIR), "--out", str(tmp_path / "o"))
    assert r.exit_code == 2, r.output
    assert (f"--from-teacher {models.SHAPES_DIR}: a distilled student's folder (its clipmill.json says "
            f"guidance_distilled); pass its teacher folder, {models.SHAPES_DIR / 'teacher'}") in r.output

    check_root(ck, RECIPES["smoke"].with_seed(0))  # a smoke checkpoint folder
    r = CliRunner().invoke(main, ["train-model", "--ckpt", str(ck), "--export-teacher", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and f"{ck}: its checkpoints were started with" in r.output, r.output
    (ck / "recipe.json").write_text('{"seed": ')  # cut short
    r = train("--ckpt", str(ck), "--no-export")
    assert r.exit_code == 2 and f"{ck / 'recipe.json'}: not valid JSON" in r.output, r.output


def test_a_killed_runs_temporary_files_are_swept_once_the_folder_is_held(tmp_path):
    """Checkpoints and latent chunks are written through temporary files with the writer's pid in
    their names (``storage.local.replacing``), so a run killed mid-save left one behind for
    good, tens of MB each. The next run on the folder removes them once it holds its lock, where
    checkpoints go and only when their writer is gone; the checkpoints themselves are left."""
    from click.testing import CliRunner

    from clipmill.jobs.cli import main

    import os
    import subprocess
    import sys
    import time

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid no process has now
    from clipmill.storage.local import _HOST

    ck = tmp_path / "ck"
    (ck / "vae").mkdir(parents=True)
    stale = [ck / f".clipmill-{_HOST}-{gone}-0badf00d.tmp", ck / "vae" / f".clipmill-{_HOST}-{gone}-cafe0001.tmp"]
    live = [ck / "vae" / f".clipmill-{_HOST}-{os.getpid()}-0000beef.tmp",  # a running writer's
            ck / "x" / "y" / f".clipmill-{_HOST}-{gone}-0000abcd.tmp",  # deeper than checkpoints go
            ck / f".clipmill-otherhost-{gone}-0000cafe.tmp",  # another host's (a container's): its pid means nothing here
            ck / f".clipmill-{_HOST}-99999999999999999999-00000000.tmp"]  # not a pid
    fresh = ck / "vae" / f".clipmill-{_HOST}-{gone}-0000f00d.tmp"  # written a moment ago: perhaps another namespace's
    for p in stale + live + [fresh]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half a checkpoint")
        if p != fresh:
            os.utime(p, (time.time() - 3600, time.time() - 3600))
    (ck / "vae" / "state.pt").write_bytes(b"kept")
    r = CliRunner().invoke(main, ["train-model", "--recipe", "smoke", "--ckpt", str(ck), "--stages", "teacher",
                                  "--no-export"])
    assert r.exit_code == 2 and "the teacher stage needs the vae, text stage(s)" in r.output, r.output
    assert not any(p.exists() for p in stale) and (ck / "vae" / "state.pt").read_bytes() == b"kept"
    assert all(p.exists() for p in live) and fresh.exists()


def test_train_model_says_in_one_line_what_a_stage_lacks_or_where_it_cannot_write_and_stops_on_sigterm(tmp_path):
    """Each was a traceback (a stage without the stages it reads: exit 1, about huggingface.co;
    a checkpoint folder that cannot be made), or "Aborted!" with exit 1 on Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys

    from click.testing import CliRunner

    from clipmill.jobs.cli import main

    r = CliRunner().invoke(main, ["train-model", "--recipe", "smoke", "--ckpt", str(tmp_path / "a"), "--stages", "teacher",
                                  "--no-export"])
    assert r.exit_code == 2 and (f"--stages teacher: the teacher stage needs the vae, text stage(s), which "
                                 f"{tmp_path / 'a'} has not finished; add them to --stages") in r.output, r.output
    (tmp_path / "file").write_text("x")
    r = CliRunner().invoke(main, ["train-model", "--recipe", "smoke", "--ckpt", str(tmp_path / "file" / "ck"),
                                  "--no-export"])
    assert r.exit_code == 3 and "failed: Not a directory" in r.output and "Traceback" not in r.output, r.output

    proc = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "train-model", "--recipe", "smoke", "--ckpt",
                             str(tmp_path / "b"), "--no-export"], stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "== stage 1/" in line:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, "".join(lines) + rest
    assert "interrupted: the checkpoints written so far are kept; run the same command again to resume" in rest


def _train(*args: str):
    """``clipmill train-model --recipe smoke --threads 1 ARGS`` in this process."""
    from click.testing import CliRunner

    from clipmill.jobs.cli import main

    return CliRunner().invoke(main, ["train-model", "--recipe", "smoke", "--threads", "1", *args])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, single_thread):
    """Every stage of the smoke recipe trained by the CLI under one checkpoint folder (no
    export), and its finished teacher written by --export-teacher: (checkpoints, teacher)."""
    base = tmp_path_factory.mktemp("smoke")
    r = _train("--ckpt", str(base / "ck"), "--no-export")
    assert r.exit_code == 0, r.output
    r = _train("--ckpt", str(base / "ck"), "--export-teacher", "--out", str(base / "model"))
    assert r.exit_code == 0, r.output
    return base / "ck", base / "model" / "teacher"


@pytest.mark.slow
def test_from_teacher_with_a_broken_or_incomplete_folder_is_one_line_naming_the_file(smoke, tmp_path):
    """Each was a traceback, an exit 3 "writing ... failed" about the folder read, or a bare
    "Expecting value: line 1 column 1" naming no file: a model_index.json, a component's config
    or a clipmill.json cut short, of the wrong shape, or without what the seeding reads."""

    _, teacher = smoke

    def edit_json(rel: str, change):
        def edit(folder):
            d = json.loads((folder / rel).read_text())
            change(d)
            (folder / rel).write_text(json.dumps(d))
        return edit

    def write(rel: str, text: str | None):
        def edit(folder):
            if text is None:
                (folder / rel).unlink()
            else:
                (folder / rel).write_text(text)
        return edit

    def no_step(d):
        del d["training"]["stages"]["teacher"]["step"]

    cases = [
        (write("model_index.json", '{"_class_name": '), "model_index.json", "not valid JSON"),
        (edit_json("model_index.json", lambda d: d.pop("unet")), "model_index.json", "no 'unet'"),
        (write("model_index.json", "[1]"), "model_index.json", "not a JSON object"),
        (write("unet/config.json", "{"), "unet/config.json", "not valid JSON"),
        (edit_json("unet/config.json", lambda d: d.pop("block_out_channels")), "unet/config.json",
         "no 'block_out_channels'"),
        (write("unet/config.json", None), "unet/config.json", "is missing"),
        (write("text_encoder/config.json", "{}"), "text_encoder", "does not load"),
        (write("scheduler/scheduler_config.json", '{"prediction_type": '), "scheduler/scheduler_config.json",
         "not valid JSON"),
        (write("tokenizer/tokenizer_config.json", "{"), "tokenizer/tokenizer_config.json", "not valid JSON"),
        (write("clipmill.json", "[1"), "clipmill.json", "not valid JSON"),
        (write("clipmill.json", "[1]"), "clipmill.json", "not a JSON object"),
        (write("clipmill.json", None), "clipmill.json", "is missing"),
        (edit_json("clipmill.json", no_step), "clipmill.json", "training.stages.teacher has no 'step'"),
        (edit_json("clipmill.json", lambda d: d["training"]["stages"].update(teacher="17")), "clipmill.json",
         "training.stages.teacher is not a JSON object"),
    ]
    for i, (edit, rel, why) in enumerate(cases):
        folder = tmp_path / f"t{i}"
        shutil.copytree(teacher, folder)
        edit(folder)
        ck = tmp_path / f"ck{i}"
        r = _train("--ckpt", str(ck), "--from-teacher", str(folder), "--no-export")
        last = r.output.strip().splitlines()[-1]
        assert r.exit_code == 2, (rel, why, r.output)
        assert last.startswith(f"Error: --from-teacher {folder}: ") and str(folder / rel) in last and why in last, \
            (rel, why, last)
        assert "Traceback" not in r.output and not ck.exists(), (rel, why)  # nothing written: no half seeding


@pytest.mark.slow
def test_a_second_run_on_a_checkpoint_folder_in_use_stops_at_once_naming_who_holds_it(tmp_path):
    """Two train-model runs on one --ckpt wrote the same state.tmp and checkpoints: the second
    now stops before it touches anything (exit 3, as a second nightly run does), naming the
    folder and the process that holds it; once that one is gone the folder is free again."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    ck = tmp_path / "ck"
    args = [sys.executable, "-m", "clipmill.jobs.cli", "train-model", "--recipe", "smoke", "--ckpt", str(ck), "--no-export"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)  # every stage: about a minute
    try:
        lines = []
        for line in first.stderr:
            lines.append(line)
            if "== stage 1/" in line:
                break
        second = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 3, second.stderr
        assert (f"Error: --ckpt {ck}: another train-model run holds this checkpoint folder (pid {first.pid} on "
                f"{socket.gethostname()}, its lock {ck / 'train.lock'})") in second.stderr, second.stderr
        assert "Traceback" not in second.stderr and "[vae]" not in second.stderr
        first.send_signal(signal.SIGTERM)
        rest = first.stderr.read()
        assert first.wait(timeout=120) == 130, "".join(lines) + rest
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    again = subprocess.run([*args, "--stages", "vae"], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr  # free once the first run has ended
    assert json.loads((ck / "vae" / "done").read_text())["step"] == 20


def test_export_teacher_reads_a_folder_another_run_is_training_in(smoke, tmp_path):
    """--export-teacher took the checkpoint folder's lock: it was refused (exit 3) while a run
    trained there, and could not run on a folder it may not write (the lock is a file in it).
    It only reads checkpoints, each written whole, so it now takes no lock; a training run on a
    folder in use is still refused."""
    from clipmill.jobs.cli.train import hold_checkpoints

    ck, _ = smoke
    mine = tmp_path / "ck"
    shutil.copytree(ck, mine, ignore=shutil.ignore_patterns("pool", "train.lock"))
    with hold_checkpoints(mine):  # as a train-model run on it does
        r = _train("--ckpt", str(mine), "--export-teacher", "--out", str(tmp_path / "out"))
        assert r.exit_code == 0, r.output
        assert (tmp_path / "out" / "teacher" / "model_index.json").exists()
        r = _train("--ckpt", str(mine), "--stages", "decoder", "--no-export")
        assert r.exit_code == 3 and "another train-model run holds this checkpoint folder" in r.output, r.output


@pytest.mark.slow
def test_a_stage_marker_is_written_whole_or_not_at_all_and_a_damaged_one_is_named(tmp_path):
    """A done marker was written in place: a disk that filled (here: a file size limit) or a
    kill mid-write left a cut-short marker, which every later run took for "done". Now it is
    whole or absent, and a damaged one (cut short, empty) is an error naming the file."""
    import subprocess
    import sys

    ck = tmp_path / "ck"
    r = _train("--ckpt", str(ck), "--stages", "vae", "--no-export")
    assert r.exit_code == 0, r.output
    # the text stage's marker written under a 64-byte file size limit (a full disk): an error,
    # and no marker, not a cut-short one
    code = ("import resource, signal, sys; from pathlib import Path; "
            "from clipmill.pipeline.train.stages import _mark_done; "
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.getrlimit(resource.RLIMIT_FSIZE)[1])); "
            "(Path(sys.argv[1]) / 'text').mkdir(); "
            "_mark_done(Path(sys.argv[1]), 'text', {'step': 20, 'accuracy': {a: 1.0 for a in 'abcdefghij'}})")
    proc = subprocess.run([sys.executable, "-c", code, str(ck)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr
    assert not (ck / "text" / "done").exists() and not list((ck / "text").iterdir())  # nor a temporary file

    marker = ck / "vae" / "done"
    whole = marker.read_text()
    for damaged, why in ((whole[: len(whole) // 2], "not valid JSON"), ("", "not valid JSON"), ("[]", "not a JSON object")):
        marker.write_text(damaged)
        for stages in ("vae", "teacher"):  # the stage itself, and the check of what a later one reads
            r = _train("--ckpt", str(ck), "--stages", stages, "--no-export")
            last = r.output.strip().splitlines()[-1]
            assert r.exit_code == 2 and last.startswith(f"Error: {marker}: ") and why in last, r.output
            assert "done already" not in r.output and "Traceback" not in r.output
    marker.write_text(whole)
    r = _train("--ckpt", str(ck), "--stages", "vae", "--no-export")
    assert r.exit_code == 0 and "[vae] done already" in r.output, r.output


@pytest.mark.slow
def test_from_teacher_seeds_the_folder_then_stages_picks_what_runs(smoke, tmp_path):
    """--from-teacher ran the teacher, student and decoder whatever --stages said (--stages
    student trained the decoder too), and refused --stages decoder. Now it seeds the folder and
    --stages picks among the stages as without it: the seeded ones are done (skipped), and a
    stage whose inputs neither the folder nor the seeding has is refused before anything is
    written."""

    ck, teacher = smoke
    a = tmp_path / "a"
    r = _train("--ckpt", str(a), "--from-teacher", str(teacher), "--stages", "student")
    assert r.exit_code == 0, r.output
    assert (a / "student" / "done").exists() and not (a / "decoder").exists()  # only the stage asked for
    assert (a / "export" / "model_index.json").exists()  # the student trained: the model is exported
    assert "[teacher]" not in r.output

    b = tmp_path / "b"
    r = _train("--ckpt", str(b), "--from-teacher", str(teacher), "--stages", "decoder", "--no-export")
    assert r.exit_code == 0, r.output
    assert (b / "decoder" / "done").exists() and not (b / "student").exists()
    r = _train("--ckpt", str(b), "--from-teacher", str(teacher), "--stages", "vae,text,teacher", "--no-export")
    assert r.exit_code == 0 and "[vae] done already" in r.output and "[teacher] done already" in r.output, r.output

    # an unfinished teacher: the student needs it finished, so --stages student alone is refused
    half = tmp_path / "half"
    shutil.copytree(ck, half, ignore=shutil.ignore_patterns("student", "decoder", "pool"))
    (half / "teacher" / "done").unlink()
    r = _train("--ckpt", str(half), "--export-teacher", "--out", str(tmp_path / "model"))
    assert r.exit_code == 0, r.output
    unfinished = tmp_path / "model" / "teacher"
    c = tmp_path / "c"
    r = _train("--ckpt", str(c), "--from-teacher", str(unfinished), "--stages", "student")
    assert r.exit_code == 2 and (f"Error: --stages student: the student stage needs the teacher stage(s), which {c} "
                                 "has not finished; add them to --stages") in r.output, r.output
    assert not c.exists()  # refused before the seeding wrote anything
    r = _train("--ckpt", str(c), "--from-teacher", str(unfinished), "--stages", "teacher,student", "--no-export")
    assert r.exit_code == 0, r.output
    assert f"[teacher] resumed at step {json.loads((ck / 'teacher' / 'done').read_text())['step']}" in r.output
    assert (c / "teacher" / "done").exists() and (c / "student" / "done").exists() and not (c / "decoder").exists()


@pytest.mark.slow
def test_export_model_itself_refuses_to_replace_the_checkpoints_or_a_folder_of_other_files(smoke, tmp_path):
    """The CLI refused such an --out, but export_model and export_teacher replaced whatever
    they were given: the checkpoint folder itself, or a folder of someone's files."""
    import re

    from clipmill.pipeline.train.export import export_model, export_teacher

    ck, _ = smoke
    mine = tmp_path / "ck"
    shutil.copytree(ck, mine, ignore=shutil.ignore_patterns("pool", "train.lock"))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "n.txt").write_text("keep me")
    for export in (export_model, export_teacher):
        with pytest.raises(ValueError, match=re.escape(f"{mine}: the export replaces this folder, which is or holds "
                                                       f"the checkpoint folder {mine}")):
            export(mine, mine)
        with pytest.raises(ValueError, match="holds files but is not a model folder"):
            export(mine, notes)
        with pytest.raises(ValueError, match="inside the checkpoint folder"):
            export(mine, mine / "vae")
    assert (notes / "n.txt").read_text() == "keep me" and (mine / "student" / "done").exists()
    assert (mine / "vae" / "model" / "config.json").exists()
    # the checkpoint folder's export/ is where the smoke recipe exports, the teacher included
    assert export_teacher(mine, mine / "export" / "teacher") == mine / "export" / "teacher"
    r = _train("--ckpt", str(mine), "--export-teacher")
    assert r.exit_code == 0 and (mine / "export" / "teacher" / "model_index.json").exists(), r.output
