"""Stream Batch (pipeline.stream) on the built-in shapes model: diagonal denoising over the
model's window with per-frame timesteps; constant memory, frames at the head every call, a
changed prompt followed within a window, steps re-timed without a restart, the hook removable."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clipmill.pipeline.models import model_info
from clipmill.pipeline.render import Renderer
from clipmill.pipeline.stream import StreamBatch
from clipmill.qc.adherence import analyze

RED = "a red circle moves right on a beige background, pan right"
BLUE = "a blue square moves up on a black background, static shot"


@pytest.fixture(scope="module")
def renderer():
    torch.set_num_threads(1)
    return Renderer(model_info("shapes"))


def run(sb: StreamBatch, calls: int) -> list:
    out = []
    for _ in range(calls):
        out += sb.next()
    return out


def test_the_stream_draws_the_prompt_follows_a_new_one_and_keeps_its_memory(renderer):
    sb = StreamBatch(renderer, RED, seed=3, steps=4)
    try:
        window = sb.window
        frames = run(sb, 24)
        assert len(frames) == 24 * window // 4  # window / steps frames leave the head every call
        assert [f.index for f in frames] == list(range(len(frames)))
        assert sb.x.shape[0] == window and len(sb.t) == window and len(sb.prompts) == window  # constant memory
        red = analyze(np.stack([f.image for f in frames[-8:]]))
        assert (red.colour, red.shape, red.background) == ("red", "circle", "beige")
        sb.set_prompt(BLUE)
        after = run(sb, 8)  # one window of calls
        blue = analyze(np.stack([f.image for f in after[-8:]]))
        assert (blue.colour, blue.shape, blue.background) == ("blue", "square", "black")
        assert after[-1].prompt == BLUE
        # fewer steps: each frame keeps its noise level, the schedule gets coarser, more frames a call
        sb.set_steps(2)
        run(sb, 2)
        assert len(sb.next()) == window // 2 and set(sb.t) <= set(sb.levels)
        again = analyze(np.stack([f.image for f in run(sb, 4)[-8:]]))
        assert again.colour == "blue"
    finally:
        sb.close()
    hooks = [m for m in renderer.pipe.unet.modules() if m._forward_pre_hooks]
    assert not hooks  # the per-frame timestep hook is gone


def test_the_stream_with_r_cfg_and_bad_settings(renderer):
    sb = StreamBatch(renderer, RED, seed=4, steps=4, guidance=1.5)  # R-CFG: no second pass
    try:
        frames = run(sb, 12)
        assert len(frames) == 24 and analyze(np.stack([f.image for f in frames[-8:]])).colour == "red"
    finally:
        sb.close()
    with pytest.raises(ValueError, match="guidance=2: the stream's R-CFG diverges at 2 and above"):
        StreamBatch(renderer, RED, guidance=2.0)
    with pytest.raises(ValueError, match="steps=0: allowed 1 to 50"):
        StreamBatch(renderer, RED, steps=0)
    assert not [m for m in renderer.pipe.unet.modules() if m._forward_pre_hooks]  # a refused stream hooks nothing
