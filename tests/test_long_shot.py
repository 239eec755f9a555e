"""Long shots (issue 12): more frames than the model takes at once, rendered in one call over
overlapping FreeNoise windows, with no seam where the windows meet."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clipmill.pipeline import long_shot


def test_free_noise_swaps_the_temporal_blocks_and_remove_puts_the_originals_back(tiny_cache):
    from clipmill.pipeline.models import load_pipeline, model_info

    unet = load_pipeline(model_info("tiny")).unet
    before = [b for mm in long_shot._motion_modules(unet) for b in mm.transformer_blocks]
    hook = long_shot.apply(unet, long_shot.FreeNoiseConfig(16, 4))
    during = [b for mm in long_shot._motion_modules(unet) for b in mm.transformer_blocks]
    assert hook.blocks == len(before) > 0 and all(type(b).__name__ == "FreeNoiseTransformerBlock" for b in during)
    hook.remove()
    after = [b for mm in long_shot._motion_modules(unet) for b in mm.transformer_blocks]
    assert all(a is b for a, b in zip(after, before, strict=True))
    hook.remove()  # twice is harmless


def test_one_window_computes_what_the_plain_model_computes(tiny_cache):
    from clipmill.pipeline.models import load_pipeline, model_info

    torch.manual_seed(0)
    unet = load_pipeline(model_info("tiny")).unet
    x = torch.randn(1, 4, 16, 8, 8)
    text = torch.randn(16, 77, unet.config.cross_attention_dim)
    with torch.no_grad():
        plain = unet(x, 500, encoder_hidden_states=text).sample
        hook = long_shot.apply(unet, long_shot.FreeNoiseConfig(16, 4))
        windowed = unet(x, 500, encoder_hidden_states=text).sample
        hook.remove()
    assert torch.allclose(plain, windowed, atol=1e-5)


def test_shuffled_context_noise_repeats_earlier_frames_in_a_new_order():
    cfg = long_shot.FreeNoiseConfig(8, 4)
    x = torch.randn((1, 4, 20, 4, 4), generator=torch.Generator().manual_seed(1))
    y = long_shot.shuffle_context(x, cfg, torch.Generator().manual_seed(2))
    assert torch.equal(y[:, :, :8], x[:, :, :8]) and not torch.equal(y, x)
    for f in range(8, 20):
        window = range(max(0, f - 8 - (f - 8) % 4), f)
        assert any(torch.equal(y[:, :, f], x[:, :, k]) or torch.equal(y[:, :, f], y[:, :, k]) for k in window), f
    with pytest.raises(ValueError, match="context_stride=8: allowed 1 to 7"):
        long_shot.FreeNoiseConfig(8, 8)


@pytest.mark.slow
def test_a_long_shot_is_one_render_without_seams():
    """40 frames of the shapes model (5 s at its 8 fps; it takes 16 at once, trained on 8): one
    call over windows of 8, 4 apart. QC's cut detector finds no cut, the compensated SSIM where
    windows meet is within 10% of the shot's median, and the analyzer reads the prompt. Glued
    independent 8-frame clips of the same prompt, for contrast, have a cut at every join."""
    from clipmill.pipeline.models import model_info
    from clipmill.pipeline.render import ClipRequest, GroupSettings, Renderer
    from clipmill.qc import adherence
    from clipmill.qc.check import QCConfig, spike_mask
    from clipmill.qc.metrics import measure

    info = model_info("shapes")
    r = Renderer(info)
    prompt = "a blue square moves left on a grey background, static shot"
    settings = GroupSettings(tier="fast", sampler=info.scheduler)
    (res,) = r.render([ClipRequest(key="a", prompt=prompt, seed=11, frames=40, width=64, height=64)], settings)
    assert res.frames.shape == (40, 64, 64, 3) and res.stats["long_shot"] == {"context_length": 8, "context_stride": 4}
    s = measure(res.frames, fps=8.0)
    assert not spike_mask(s, QCConfig()).any()
    joins = [i - 1 for i in range(8, 40, 4)]  # the pair before each window start
    med = float(np.median(s.ssim))
    assert all(s.ssim[j] >= 0.9 * med for j in joins), (s.ssim[joins], med)
    a = adherence.analyze(res.frames)
    assert (a.colour, a.shape, a.background) == ("blue", "square", "grey")

    glued = np.concatenate([r.render([ClipRequest(key=str(k), prompt=prompt, seed=11 + k, frames=8, width=64,
                                                  height=64)], settings)[0].frames for k in range(5)])
    g = measure(glued, fps=8.0)
    assert min(g.ssim[j] for j in (7, 15, 23, 31)) < 0.9 * float(np.median(g.ssim))
