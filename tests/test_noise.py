"""The mixed noise prior (pipeline.noise): its statistics, the sampler's re-noising with it, and
how a model folder declares it."""

import json
import shutil

import numpy as np
import pytest
import torch


def test_no_shared_share_is_exactly_torch_randn():
    from clipmill.pipeline.noise import video_noise

    a = video_noise((2, 4, 8, 16, 16), 0.0, torch.Generator().manual_seed(3))
    b = torch.randn((2, 4, 8, 16, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_the_shared_share_is_common_to_the_frames_and_the_variance_stays_one():
    from clipmill.pipeline.noise import video_noise

    x = video_noise((64, 4, 8, 16, 16), 0.5, torch.Generator().manual_seed(0))
    assert abs(float(x.var()) - 1.0) < 0.02
    f = x.permute(2, 0, 1, 3, 4).reshape(8, -1)  # frames x elements
    corr = torch.corrcoef(f)
    off = corr[~torch.eye(8, dtype=torch.bool)]
    assert abs(float(off.mean()) - 0.5) < 0.02 and float(off.min()) > 0.45
    # clips stay independent of each other
    clips = x.reshape(64, -1)
    assert abs(float(torch.corrcoef(clips[:8])[0, 1:].mean())) < 0.05


def test_per_clip_noise_does_not_depend_on_the_group():
    from clipmill.pipeline.noise import per_clip

    alone = per_clip((1, 4, 8, 8, 8), 0.5, [torch.Generator().manual_seed(7)])
    grouped = per_clip((3, 4, 8, 8, 8), 0.5, [torch.Generator().manual_seed(s) for s in (1, 7, 9)])
    assert torch.equal(alone[0], grouped[1])


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, "half", None])
def test_a_share_out_of_range_is_refused_with_what_is_allowed(bad):
    from clipmill.pipeline.noise import video_noise

    with pytest.raises(ValueError, match="noise_shared="):
        video_noise((1, 4, 8, 8, 8), bad)


def test_lcm_re_noises_between_steps_with_the_prior():
    """The noise LCM adds to its clean estimate before the next step carries the prior's share
    common to all frames; without the prior it is the scheduler's own independent noise."""
    from diffusers import LCMScheduler

    from clipmill.pipeline.sampler import sample

    def renoise_corr(shared: float) -> float:
        sched = LCMScheduler(beta_schedule="linear", prediction_type="v_prediction", original_inference_steps=50)
        seen = []

        def denoise(x, t):
            seen.append(x.clone())
            return torch.zeros_like(x)  # v = 0: the clean estimate is a scaled copy of x

        x = torch.randn((4, 4, 8, 16, 16), generator=torch.Generator().manual_seed(1))
        sample(denoise, x, sched, 2, [torch.Generator().manual_seed(s) for s in range(4)], noise_shared=shared)
        sched2 = LCMScheduler(beta_schedule="linear", prediction_type="v_prediction", original_inference_steps=50)
        sched2.set_timesteps(2)
        t0, t1 = (int(t) for t in sched2.timesteps)
        denoised = sched2.step(torch.zeros_like(x), t0, x).denoised
        a = sched2.alphas_cumprod[t1]
        fresh = (seen[1] - a.sqrt() * denoised) / (1 - a).sqrt()
        assert abs(float(fresh.var()) - 1.0) < 0.05  # it is unit noise either way
        f = fresh.permute(2, 0, 1, 3, 4).reshape(8, -1)
        return float(torch.corrcoef(f)[~torch.eye(8, dtype=torch.bool)].mean())

    assert abs(renoise_corr(0.0)) < 0.03
    assert abs(renoise_corr(0.5) - 0.5) < 0.04


def test_a_model_folder_declares_its_prior_and_a_bad_one_is_refused(tmp_path, tiny_cache):
    from clipmill.pipeline.models import ModelError, model_info, tiny_path

    folder = tmp_path / "model"
    shutil.copytree(tiny_path("tiny"), folder)
    assert model_info(str(folder)).noise_shared == 0.0
    meta = json.loads((folder / "clipmill.json").read_text())
    (folder / "clipmill.json").write_text(json.dumps({**meta, "noise_shared": 0.5}))
    assert model_info(str(folder)).noise_shared == 0.5
    (folder / "clipmill.json").write_text(json.dumps({**meta, "noise_shared": 1.2}))
    with pytest.raises(ModelError) as e:
        model_info(str(folder))
    assert str(e.value) == (f"{folder / 'clipmill.json'}: noise_shared=1.2: allowed 0 <= noise_shared < 1 (the share "
                            "of the noise's variance common to all frames; 1 would make every frame the same)")


def test_a_model_folder_may_re_noise_with_another_share_and_the_renderer_uses_it(tmp_path):
    """clipmill.json "renoise_shared": the share common to all frames of the noise LCM draws
    between steps (the shipped shapes model: 0.95, trained with the 0.5 prior); without it the
    prior. The same seed renders the same clip as without the key when the share is the prior,
    and another clip when it is not; a bad value is refused naming the file and the field."""
    from clipmill.pipeline.models import SHAPES_DIR, ModelError, model_info
    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer

    shipped = model_info("shapes")
    assert (shipped.noise_shared, shipped.renoise_shared, shipped.renoise) == (0.5, 0.95, 0.95)
    folder = tmp_path / "shapes"
    shutil.copytree(SHAPES_DIR, folder, ignore=shutil.ignore_patterns("teacher"))
    meta = json.loads((folder / "clipmill.json").read_text())
    meta.pop("teacher"), meta.pop("renoise_shared")
    req = ClipRequest(key="a", prompt="a red circle moves right on a beige background, pan left", seed=7, frames=8,
                      width=64, height=64)

    def render(**keys):
        (folder / "clipmill.json").write_text(json.dumps({**meta, **keys}))
        info = model_info(str(folder))
        renderer = Renderer(info)
        try:
            return info.renoise, renderer.render([req], GroupSettings(tier="fast", sampler=info.scheduler))[0].frames
        finally:
            renderer.close()

    (prior, plain), (same, as_prior), (high, other) = render(), render(renoise_shared=0.5), render(renoise_shared=0.95)
    assert (prior, same, high) == (0.5, 0.5, 0.95)
    assert np.array_equal(plain, as_prior)
    assert np.abs(plain.astype(int) - other.astype(int)).mean() > 1.0
    (folder / "clipmill.json").write_text(json.dumps({**meta, "renoise_shared": 1.0}))
    with pytest.raises(ModelError) as e:
        model_info(str(folder))
    assert str(e.value) == (f"{folder / 'clipmill.json'}: renoise_shared=1.0: allowed 0 <= renoise_shared < 1 (the "
                            "share of the noise's variance common to all frames; 1 would make every frame the same)")
