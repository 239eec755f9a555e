"""Render speed layers on the tiny AnimateDiff and tiny Wan models: exactness of the text K/V
cache, cache reset between jobs, DeepCache and FirstBlockCache, guidance modes, out-of-memory
halving, model families, and the bench ladder's JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from clipmill.jobs.bench.ladder import world_requests
from clipmill.pipeline import long_shot, shapes
from clipmill.pipeline.deepcache import DeepCache, DeepCacheConfig
from clipmill.pipeline.models import model_info
from clipmill.pipeline.prompt_cache import PromptEmbeddingCache
from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer, RenderOptions
from clipmill.pipeline.textkv import TextKVCache

PLAIN = RenderOptions(text_kv=False, prompt_cache=0)
PSNR_RCFG_VS_CFG = 30.0


@pytest.fixture(scope="module")
def ad():
    return Renderer(model_info("tiny"), options=PLAIN)


@pytest.fixture(scope="module")
def wan():
    return Renderer(model_info("tiny-wan"), options=PLAIN)


def reqs(n, frames=8, size=64, prompt="a bowl of noodles, orbit"):
    return [ClipRequest(i, f"{prompt} {i}", 100 + i, frames, size, size, "blurry, text") for i in range(n)]


def frames_of(results):
    return np.stack([r.frames for r in results]).astype(int)


# -- text K/V cache ------------------------------------------------------------------------------

@pytest.mark.slow
def test_text_kv_cache_is_exact_on_the_unet_in_float32(ad):
    unet = ad.pipe.unet
    torch.manual_seed(0)
    frames = 8
    cond = torch.randn(2, 256, 32)
    neg = torch.randn(2, 256, 32)
    both = torch.cat([neg.repeat_interleave(frames, 0), cond.repeat_interleave(frames, 0)])
    x = torch.randn(4, 4, frames, 8, 8)
    with torch.no_grad():
        plain = [unet(x, torch.tensor(t), encoder_hidden_states=both).sample for t in (999, 500)]
        cache = TextKVCache(unet)
        try:
            cache.bind(both, [("uncond", neg, frames), ("cond", cond, frames)])
            cached = [unet(x, torch.tensor(t), encoder_hidden_states=both).sample for t in (999, 500)]
            # per layer: one entry for uncond and one for cond, projected once, reused at step 2
            n_layers = sum(1 for m in unet.modules() if getattr(m, "is_cross_attention", False))
            assert cache.entries == 2 * n_layers
            assert cache.stats.projected == 4 * n_layers  # 2 prompts x (cond + uncond), once
            assert cache.stats.avoided == 2 * 2 * 2 * frames * n_layers - 4 * n_layers
        finally:
            cache.remove()
        restored = unet(x, torch.tensor(999), encoder_hidden_states=both).sample
    for p, c in zip(plain, cached):
        assert (p - c).abs().max().item() <= 1e-5
    assert torch.equal(restored, plain[0])  # remove() put the original processors back


def test_text_kv_cache_is_exact_on_the_wan_dit_in_float32(wan):
    tr = wan.pipe.transformer
    torch.manual_seed(0)
    cond, neg = torch.randn(1, 226, 32), torch.randn(1, 226, 32)
    x = torch.randn(1, 16, 3, 8, 8)

    def run():
        out = []
        for t in (999, 500):
            for e in (cond, neg):  # Wan runs cond and uncond as separate passes
                out.append(tr(hidden_states=x, timestep=torch.tensor([t]), encoder_hidden_states=e, return_dict=False)[0])
        return out

    with torch.no_grad():
        plain = run()
        cache = TextKVCache(tr)
        try:
            cached = run()
            assert cache.entries == 2 * len(tr.blocks)  # cond and uncond entries per block
            assert cache.stats.projected == 2 * len(tr.blocks)
            assert cache.stats.avoided == 2 * len(tr.blocks)  # the second step reused both
        finally:
            cache.remove()
        assert torch.equal(tr(hidden_states=x, timestep=torch.tensor([999]), encoder_hidden_states=cond,
                              return_dict=False)[0], plain[0])
    for p, c in zip(plain, cached):
        assert (p - c).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mode,g", [("cfg", 1.0), ("cfg", 3.0), ("rcfg-onetime", 1.5)])
def test_renders_with_and_without_text_kv_are_identical(ad, mode, g):
    s = GroupSettings(guidance=g, guidance_mode=mode)
    ad.configure(PLAIN)
    plain = frames_of(ad.render(reqs(2), s))
    ad.configure(RenderOptions())
    cached = ad.render(reqs(2), s)
    assert np.array_equal(frames_of(cached), plain)
    assert cached[0].stats["kv_rows_avoided"] > 0
    assert ad.text_kv.entries == 0  # reset when the group ended
    ad.configure(PLAIN)


@pytest.mark.slow
def test_cache_state_never_leaks_from_one_job_to_the_next(ad, wan):
    """Job B rendered after job A equals job B on a fresh renderer, with every cache on, for both
    families; and the per-generation caches are empty between groups."""
    on = RenderOptions(feature_cache=True)
    for r in (ad, wan):
        info = r.info
        a = [ClipRequest("a", "a red bowl of ramen, orbit", 1, info.default_frames, 64, 64, "text")]
        b = [ClipRequest("b", "iced coffee in a glass, pan left", 2, info.default_frames, 64, 64, "blurry")]
        s = GroupSettings(tier="fast", sampler=info.scheduler, guidance=2.0)
        r.configure(on)
        r.render(a, s)
        after_a = r.render(b, s)[0].frames
        assert r.text_kv.entries == 0
        if r.deepcache is not None:
            assert r.deepcache.state.outputs == {} and r.deepcache.state.step == 0
        fresh = Renderer(info, options=on)
        assert np.array_equal(fresh.render(b, s)[0].frames, after_a), info.family
        r.configure(PLAIN)


def test_prompt_embedding_lru_encodes_each_distinct_prompt_once():
    calls = []

    def encode(texts):
        calls.append(list(texts))
        return torch.stack([torch.full((3, 2), float(len(t))) for t in texts])

    c = PromptEmbeddingCache(maxsize=2)
    out = c.get(["ab", "abc", "ab"], encode)
    assert calls == [["ab", "abc"]] and out.shape == (3, 3, 2) and out[2, 0, 0] == 2
    c.get(["abc", "ab"], encode)
    assert len(calls) == 1 and (c.hits, c.misses) == (3, 2)
    c.get(["abcd"], encode)  # evicts the least recently used ("abc")
    assert len(c) == 2
    c.get(["abc"], encode)
    assert calls[-1] == ["abc"]
    with pytest.raises(ValueError, match="maxsize=0"):
        PromptEmbeddingCache(0)


@pytest.mark.slow
def test_renderer_encodes_a_repeated_template_once(ad):
    ad.configure(RenderOptions())
    same = [ClipRequest(i, "ramen on a table, orbit", i, 8, 64, 64) for i in range(4)]
    ad.render(same, GroupSettings())
    ad.render(same[:2], GroupSettings())
    assert (ad.prompts.misses, ad.prompts.hits) == (1, 5)
    ad.configure(PLAIN)


# -- feature caches ------------------------------------------------------------------------------

@pytest.mark.slow
def test_deepcache_skips_deep_blocks_on_alternate_steps_and_is_removable(ad):
    s = GroupSettings(tier="quality")
    base = frames_of(ad.render(reqs(1), s))
    ad.configure(replace(PLAIN, feature_cache=True, deepcache=DeepCacheConfig(interval=2, branch=1)))
    res = ad.render(reqs(1), s)
    st = res[0].stats
    assert (st["full_steps"], st["cached_steps"]) == (4, 4)
    assert st["blocks_skipped"] == 4 * 3  # down_blocks.1, mid_block, up_blocks.0 on each cached step
    cached = frames_of(res)
    assert not np.array_equal(cached, base)  # approximate ...
    mse = ((cached - base) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 30  # ... within the bound
    # the default, DeepCache's finest branch: only the last layer of the last up block runs
    ad.configure(replace(PLAIN, feature_cache=True))
    st = ad.render(reqs(1), s)[0].stats
    assert st["blocks_skipped"] == 4 * 7  # + down_blocks.0 and up_blocks.1's first resnet, attention, motion module
    ad.configure(PLAIN)  # removes the hooks: exact again
    assert np.array_equal(frames_of(ad.render(reqs(1), s)), base)
    with pytest.raises(ValueError, match="branch=2: this UNet has 2 levels"):
        DeepCache(ad.pipe.unet, DeepCacheConfig(branch=2))
    with pytest.raises(ValueError, match="interval=0"):
        DeepCacheConfig(interval=0)


@pytest.mark.slow
def test_wan_feature_cache_is_diffusers_first_block_cache_per_tier(wan):
    wan.configure(replace(PLAIN, feature_cache=True))
    for tier in ("fast", "quality"):
        with wan.counting():  # the block counters, as the bench installs them
            r = wan.render(reqs(1, frames=9), GroupSettings(tier=tier, sampler="flow"))[0]
        assert wan.denoiser.is_cache_enabled and wan.dit_cache_tier == tier
        assert r.stats["blocks_run"] + r.stats["blocks_skipped"] == r.stats["steps"] * len(wan.denoiser.blocks)
    wan.configure(PLAIN)
    assert not wan.denoiser.is_cache_enabled


# -- guidance ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_guidance_modes_cost_what_they_say(ad):
    counts, frames = {}, {}
    for mode, g in (("cfg", 1.5), ("rcfg-self", 1.5), ("rcfg-onetime", 1.5), ("cfg", 1.0)):
        r = ad.render(reqs(2), GroupSettings(guidance=g, guidance_mode=mode))
        counts[r[0].stats["guidance_mode"]] = r[0].stats["denoiser_rows"]
        frames[r[0].stats["guidance_mode"]] = frames_of(r)
    assert counts == {"cfg": 12, "rcfg-self": 6, "rcfg-onetime": 7, "none": 6}
    # R-CFG approximates CFG's picture; it does not run away from it
    for mode in ("rcfg-self", "rcfg-onetime"):
        mse = ((frames[mode] - frames["cfg"]) ** 2).mean()
        assert 10 * np.log10(255**2 / mse) > PSNR_RCFG_VS_CFG, mode


def test_rcfg_is_refused_where_it_diverges(ad, tmp_path):
    with pytest.raises(ValueError, match="R-CFG diverges at guidance 2 and above"):
        ad.render(reqs(1), GroupSettings(guidance=2.0, guidance_mode="rcfg-self"))
    (tmp_path / "p.csv").write_text("prompt\nramen on a table\n")
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "run", "p.csv", "--guidance", "3", "--guidance-mode",
                           "rcfg-self", "--size", "64", "--frames", "8"], cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "CLIPMILL_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}"})
    assert proc.returncode == 2 and "guidance 3 with rcfg-self: R-CFG diverges at guidance 2 and above" in proc.stderr


def test_rcfg_is_refused_on_a_flow_matching_model(wan):
    with pytest.raises(ValueError, match="R-CFG needs an epsilon-prediction scheduler"):
        wan.render(reqs(1, frames=9), GroupSettings(sampler="flow", guidance=1.5, guidance_mode="rcfg-self"))


def test_distilled_model_with_high_cfg_is_warned_about(tmp_path):
    (tmp_path / "p.csv").write_text("prompt\nramen on a table\n")
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "submit", "p.csv", "--guidance", "7.5", "--out", "o"],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "CLIPMILL_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}"})
    assert proc.returncode == 0, proc.stderr
    assert "--guidance 7.5: distilled few-step models over-expose" in proc.stderr


# -- batching and memory -------------------------------------------------------------------------

@pytest.mark.slow
def test_out_of_memory_splits_the_group_in_halves_and_loses_no_clip(ad):
    """A device that fits two clips per call: a group of four is rendered as two halves, each
    clip as it would be alone, and every result says it was split."""
    s = GroupSettings()
    alone = [ad.render([r], s)[0].frames for r in reqs(4)]

    def budget(module, args, kwargs):
        if args[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = ad.pipe.unet.register_forward_pre_hook(budget, with_kwargs=True)
    try:
        res = ad.render(reqs(4), s)
    finally:
        handle.remove()

    def nothing_fits(module, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = ad.pipe.unet.register_forward_pre_hook(nothing_fits, with_kwargs=True)
    try:
        with pytest.raises(torch.OutOfMemoryError):  # one clip that does not fit: raised, for the retry policy
            ad.render(reqs(2), s)
    finally:
        handle.remove()
    assert [r.key for r in res] == [0, 1, 2, 3]
    assert all(r.timings["oom_splits"] == 1 and r.timings["group_size"] == 2 for r in res)
    for r, a in zip(res, alone):
        assert np.abs(r.frames.astype(int) - a.astype(int)).max() <= 2


def test_alone_and_in_a_batch_of_four_match_with_every_layer_on(ad):
    ad.configure(RenderOptions(feature_cache=True))
    s = GroupSettings(guidance=1.5, guidance_mode="rcfg-self")
    group = ad.render(reqs(4), s)
    alone = ad.render([reqs(4)[2]], s)[0]
    d = np.abs(group[2].frames.astype(int) - alone.frames.astype(int))
    assert d.max() <= 2 and d.mean() < 0.05
    ad.configure(PLAIN)


@pytest.mark.slow
def test_tiled_and_tiny_decoders(ad):
    """At 128 px the tiny VAE's latent (16x16) is larger than its tile (8x8 latents, 64 px), so
    a tiled decode really runs the decoder tile by tile; the picture stays the same size and
    close to the untiled one (tiles overlap and are blended)."""
    s = GroupSettings()
    calls = []
    hook = ad.pipe.vae.decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        ad.configure(replace(PLAIN, tiling="off"))
        base = ad.render(reqs(1, size=128), s)[0].frames
        untiled_calls, calls[:] = len(calls), []
        ad.configure(replace(PLAIN, tiling="on"))
        tiled = ad.render(reqs(1, size=128), s)[0].frames
        tiled_calls = len(calls)
    finally:
        hook.remove()
    assert tiled.shape == base.shape == (8, 128, 128, 3)
    assert tiled_calls >= 4 * untiled_calls, (tiled_calls, untiled_calls)  # 3x3 tiles per decode
    diff = np.abs(tiled.astype(float) - base.astype(float))
    assert not np.array_equal(tiled, base) and diff.mean() < 0.25 * base.std(), (diff.mean(), base.std())
    ad.configure(replace(PLAIN, decoder="tiny"))
    tiny = ad.render(reqs(1), s)[0].frames
    assert tiny.shape == (8, 64, 64, 3) and tiny.std() > 0
    ad.configure(PLAIN)


def test_compile_without_a_gpu_says_why_and_renders_plain(ad):
    ad.configure(replace(PLAIN, compile="torch"))
    assert ad.compiled is None and "needs a CUDA GPU" in ad.compile_message
    assert ad.render(reqs(1), GroupSettings())[0].frames.shape == (8, 64, 64, 3)
    ad.configure(replace(PLAIN, compile="tensorrt"))
    assert ad.compiled is None and "needs a CUDA GPU" in ad.compile_message
    ad.configure(PLAIN)


# -- families ------------------------------------------------------------------------------------

def test_families_say_what_frames_and_sizes_they_take():
    a, w = model_info("tiny"), model_info("tiny-wan")
    assert (a.family, w.family) == ("animatediff", "wan")
    assert a.check_frames(16) is None and w.check_frames(17) is None
    assert w.check_frames(16) == "the wan model takes 4k+1 from 5 to 81 (5, 9, ...) frames"
    assert a.check_frames(40) == "the animatediff model takes an integer from 8 to 32 frames"
    assert w.check_size(72, 64) == "the wan model takes sides that are multiples of 16 from 64 to 1280"
    with pytest.raises(ValueError, match="16 frames at 64x64: the wan model takes 4k\\+1"):
        Renderer(w, options=PLAIN).render(reqs(1, frames=16), GroupSettings(sampler="flow"))


def test_submit_refuses_frame_counts_wan_cannot_take(tmp_path):
    (tmp_path / "w.csv").write_text("prompt,frames\nramen,17\ncoffee,16\n")
    env = {**__import__("os").environ, "CLIPMILL_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}"}
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "submit", "w.csv", "--model", "tiny-wan"],
                          cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert ("w.csv:3: frames: '16' is not a frame count this model takes; allowed: 4k+1 from 5 to 81 (5, 9, ...)"
            in proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "submit", "w.csv", "--model", "tiny-wan", "--frames", "20"],
                          cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "--frames: 20: the wan model takes 4k+1 from 5 to 81" in proc.stderr


# -- the ladder ----------------------------------------------------------------------------------

def world_model_with_teacher(tmp_path):
    """A model folder that says it draws the shapes world and ships a teacher: the tiny model
    twice (its clips are noise; the structure is what is tested)."""
    import shutil

    from clipmill.pipeline.models import tiny_path

    folder = tmp_path / "model"
    shutil.copytree(tiny_path("tiny"), folder)
    shutil.copytree(tiny_path("tiny"), folder / "teacher")
    meta = json.loads((folder / "clipmill.json").read_text())
    meta.update(world="shapes", teacher="teacher", teacher_guidance=3.0, default_size=[64, 64], default_frames=8)
    (folder / "clipmill.json").write_text(json.dumps(meta))
    return folder


def test_motion_by_asked_counts_right_over_asked_in_the_grammars_order():
    from clipmill.jobs.bench.adherence import motion_by_asked

    conf = {m: {} for m in shapes.MOTIONS}
    conf["moves up"] = {"moves up": 2, "moves down": 3}
    conf["stays still"] = {"stays still": 4}
    conf["moves left"] = {"moves right": 1, "None": 1}
    assert motion_by_asked(conf) == "0/2 0/0 2/5 0/0 4/4"


@pytest.mark.slow
def test_bench_adherence_rows_teacher_steps_and_student_tiers(tmp_path, tiny_cache):
    from clipmill.jobs.bench.adherence import adherence_table
    from clipmill.pipeline.models import model_info

    res = adherence_table(model_info(str(world_model_with_teacher(tmp_path))), clips=4, group=4, seed=3)
    rows = {r["row"]: r for r in res["rows"]}
    assert list(rows) == ["teacher, DDIM 50 steps, CFG 3", "teacher, DDIM 8 steps, CFG 3", "teacher, DDIM 6 steps, CFG 3",
                          "student, quality tier (8 steps)", "student, fast tier (6 steps)",
                          "student, quality tier (8 steps), up to 8 draws", "student, fast tier (6 steps), up to 8 draws"]
    assert [r["steps"] for r in rows.values()] == [50, 8, 6, 8, 6, 8, 6] and res["heldout_clips"] == 2
    assert [r["draws"] for r in rows.values()] == [1] * 5 + [8] * 2
    # a row rendered once takes one render a clip; a drawing row between one and eight
    assert all(r["renders_per_clip"] == 1 for r in rows.values() if r["draws"] == 1)
    assert all(1 <= r["renders_per_clip"] <= 8 for r in rows.values())
    for r in rows.values():
        for key in ("adherence", "adherence_heldout", "adherence_train"):
            assert set(r[key]) == {"colour", "shape", "motion", "background", "camera"}
        assert ("qc_passed" in r) == (r["model"] == "student")
        # the second reader per attribute and all five; all five right is at most any one right
        assert set(r["second_reader"]) == {"colour", "shape", "motion", "background", "camera", "all"}
        assert r["second_reader"]["all"] <= min(v for k, v in r["second_reader"].items() if k != "all")
        assert 0 <= r["all_right"] <= min(r["adherence"].values()) and 0 <= r["readers_agree"] <= 1
        # per asked motion, what was read: every clip counted once, under its own asked motion
        conf = r["motion_confusion"]
        assert list(conf) == list(shapes.MOTIONS) and sum(sum(v.values()) for v in conf.values()) == 4
        asked = [shapes.parse(q.prompt).motion for q in world_requests((64, 64), 8, 4, seed=3)]
        assert {m: sum(conf[m].values()) for m in conf} == {m: asked.count(m) for m in shapes.MOTIONS}
    with pytest.raises(ValueError, match="not a shapes-world model"):
        adherence_table(model_info("tiny"), clips=2)


@pytest.mark.slow
def test_bench_json_has_every_row_with_ratios_deviations_and_quality_columns(tmp_path, tiny_cache):
    """A model folder of the shapes world that ships its teacher (here: the tiny model twice):
    row 0 is the teacher, and every row carries the quality columns on shapes-world prompts."""
    folder = world_model_with_teacher(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", "bench", "--model", str(folder), "--size", "64",
                           "--frames", "8", "--repeat", "1", "--quality-clips", "6", "--json"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    rows = {r["row"]: r for r in res["rows"]}
    assert res["prompts"] == "shapes" and res["teacher"] == str(folder / "teacher") and res["quality_clips"] == 6
    assert "undistilled teacher" in rows["0"]["name"] and rows["0"]["guidance"] == 3.0
    for r in rows.values():
        q = r["quality"]
        assert q["clips"] == 6 and q["heldout_clips"] == 3
        assert set(q["adherence"]) == set(q["adherence_heldout"]) == {"colour", "shape", "motion", "background", "camera"}
        assert all(0 <= v <= 1 for v in q["adherence"].values())
        if r["row"] == "0":
            assert q["read_distance_vs_row0"] is None and q["frechet_vs_row0"] is None
        else:
            assert all(0 <= v <= 1 for v in q["read_distance_vs_row0"].values()) and q["frechet_vs_row0"] >= 0
    assert rows["3"]["quality"]["identical_to_twin"]  # the text K/V cache is exact
    assert rows["4"]["quality"]["psnr_vs_twin_db"] > 30  # the feature cache is not
    assert list(rows) == [str(i) for i in range(8)]
    assert [rows[k]["denoiser_evaluations_per_clip"] for k in "012"] == [100, 8, 6]
    assert rows["0"]["speedup_render"] == 1.0 and rows["2"]["speedup_render"] > 3
    assert rows["3"]["psnr_vs_twin_db"] is None and rows["3"]["max_abs_diff_vs_twin"] == 0  # exact
    assert rows["3"]["work"]["kv_rows_avoided"] > 0
    assert rows["4"]["work"]["blocks_skipped"] > 0 and rows["4"]["psnr_vs_twin_db"] > 30
    assert rows["6"]["batch"] == 4 and rows["6"]["max_abs_diff_vs_twin"] <= 2
    assert "needs a CUDA GPU" in rows["7"]["note"]
    for r in rows.values():
        for k in ("render_s_per_clip", "end_to_end_s_per_clip", "speedup_end_to_end", "peak_memory_mib", "post_s"):
            assert r[k] is not None and r[k] >= 0
    assert {g["mode"] for g in res["guidance_modes"]} == {"cfg", "rcfg-self", "rcfg-onetime", "none"}
    assert [d["decoder"] for d in res["decoders"]] == ["vae", "tiny"]


@pytest.mark.slow
def test_bench_failures_renders_each_fault_and_qc_catches_the_nan_group(tiny_cache):
    """Each fault is real (NaN latents come out flat, the wrong VAE scaling changes the frames)
    and comes off the model: after the run the UNet and VAE have no hooks left, and the VAE's
    config its own scaling factor."""
    from clipmill.jobs.bench import failures as fb
    from clipmill.pipeline.models import model_info
    from clipmill.pipeline.render import GroupSettings, Renderer
    from services import hooks_on

    info = model_info("tiny")
    res = fb.failures(info, clips=4, size=(64, 64), frames=8, group=2)
    kinds = {k["kind"]: k for k in res["kinds"]}
    assert list(kinds) == ["good", "steps-1", "steps-2", "guidance-12", "guidance-16", "feature-cache-6",
                           "nan-mid-denoise", "wrong-vae-scaling"]
    assert kinds["nan-mid-denoise"]["reject_rate"] == 1.0 and "flat" in kinds["nan-mid-denoise"]["reasons"]
    assert kinds["nan-mid-denoise"]["detail"] == {"nan_from_step": 4, "denoiser_calls": 6}  # the last group's own
    assert kinds["wrong-vae-scaling"]["detail"]["decoded_at"] != 1.0
    for k in kinds.values():
        assert k["clips"] == 4 and set(k["adherence"]) == {"colour", "shape", "motion", "background", "camera"}
        if k["kind"] not in ("good", "steps-1", "steps-2"):
            assert k["psnr_vs_good_db"] is not None  # it rendered something else than the good clips
    renderer = Renderer(info)
    try:
        req = fb.world_requests((64, 64), 8, 1)
        for _ in range(2):  # a fresh fault per group: each counts its own 6 steps
            with fb.fault(renderer, "nan", 6) as detail:
                (bad,) = renderer.render(req, GroupSettings(tier="fast", sampler=info.scheduler))
            assert detail["denoiser_calls"] == 6
        (ok,) = renderer.render(req, GroupSettings(tier="fast", sampler=info.scheduler))
        assert not bad.frames.any() and ok.frames.std() > 0  # the hook was on, then off
        assert hooks_on(renderer.pipe.unet) == [] and hooks_on(renderer.pipe.vae) == []
        own = renderer.pipe.vae.config.scaling_factor  # the wrong scaling: the config's factor, put back after
        with fb.fault(renderer, "vae-scaling", 6) as detail:
            assert renderer.pipe.vae.config.scaling_factor == detail["decoded_with"] != own
        assert renderer.pipe.vae.config.scaling_factor == own
    finally:
        renderer.close()


def test_a_wan_clip_with_the_feature_cache_is_the_same_alone_and_in_a_group(wan):
    """diffusers' FirstBlockCache decides its skips once per batch: in a group of 4 the other
    clips decided this one's (max diff 10 levels). Such a group is rendered clip by clip."""
    rs = [ClipRequest(i, f"clip number {i}, orbit", 100 + i, 5, 64, 64, "blurry") for i in range(4)]
    s = GroupSettings("fast", "flow")
    with wan.using(RenderOptions(feature_cache=True)):
        alone = wan.render([rs[2]], s)[0].frames
        group = wan.render(rs, s)
    assert np.array_equal(alone, group[2].frames)


@pytest.mark.parametrize("kw,msg", [
    ({"step_count": 0}, "GroupSettings.step_count=0: allowed 1 to 1000 denoising steps, or None for the tier's"),
    ({"step_count": -2}, "GroupSettings.step_count=-2: allowed 1 to 1000"),
    ({"tier": "slow"}, "GroupSettings.tier='slow': allowed fast, quality"),
    ({"guidance": float("nan")}, "GroupSettings.guidance=nan: allowed a finite scale of 0 or more"),
])
def test_group_settings_refuse_what_would_render_noise(kw, msg):
    with pytest.raises(ValueError) as e:
        GroupSettings(**kw)
    assert str(e.value).startswith(msg)


def test_render_errors_name_the_values(ad):
    with pytest.raises(ValueError, match=r"same frames, width and height; got 8 frames at 64x64, 16 frames at 64x64"):
        ad.render(reqs(1) + reqs(1, frames=16), GroupSettings())
    with pytest.raises(ValueError, match=r"seed=18446744073709551616: allowed an integer from 0 to 2\*\*63-1"):
        ad.render([ClipRequest(0, "a bowl", 2**64, 8, 64, 64)], GroupSettings())
    with pytest.raises(ValueError, match=r"500 frames at 64x64: .* frames in one call, or up to 480 as a long shot"):
        ad.render(reqs(1, frames=500), GroupSettings())


def test_a_failed_long_shot_setup_leaves_the_unet_as_it_was(ad, monkeypatch):
    """Out of memory while FreeNoise blocks are built (the second block here) used to leave the
    first on the UNet for every later clip of the worker."""
    from diffusers.models.attention import BasicTransformerBlock, FreeNoiseTransformerBlock

    blocks = lambda: [type(b) for mm in long_shot._motion_modules(ad.pipe.unet) for b in mm.transformer_blocks]
    before = blocks()
    built = []
    real_init = FreeNoiseTransformerBlock.__init__

    def init(self, *a, **k):
        built.append(1)
        if len(built) == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
        real_init(self, *a, **k)

    monkeypatch.setattr(FreeNoiseTransformerBlock, "__init__", init)
    with pytest.raises(RuntimeError, match="out of memory"):
        ad.render(reqs(1, frames=40), GroupSettings())
    assert blocks() == before and set(before) == {BasicTransformerBlock}


def test_a_layer_that_cannot_be_installed_leaves_the_previous_ones(tmp_path):
    """`using()` a tiny decoder on a folder without one: the renderer keeps its DeepCache and its
    options, as before the call (it used to lose both and claim the tiny decoder)."""
    import shutil

    from clipmill.pipeline.models import ModelError

    folder = tmp_path / "no-tiny-vae"
    shutil.copytree(model_info("tiny").path, folder, ignore=shutil.ignore_patterns("vae_tiny"))
    r = Renderer(model_info(str(folder)), options=RenderOptions(feature_cache=True))
    with pytest.raises(ModelError, match="vae_tiny"):
        with r.using(RenderOptions(decoder="tiny")):
            pass
    assert r.options == RenderOptions(feature_cache=True) and r.deepcache is not None and r.tiny_vae is None
    assert r.text_kv is not None and r.prompts is not None


def test_prompt_cache_counts_are_the_groups_own_and_hold_no_graph(ad):
    ad.configure(RenderOptions())
    try:
        stats = [ad.render(reqs(1), GroupSettings())[0].stats for _ in range(3)]
        assert [(s["prompt_cache_hits"], s["prompt_cache_misses"]) for s in stats] == [(0, 1), (1, 0), (1, 0)]
        ad.encode(["a stream's prompt"])  # as a stream does, outside a render
        assert all(not row.requires_grad for row in ad.prompts._rows.values())
    finally:
        ad.configure(PLAIN)
