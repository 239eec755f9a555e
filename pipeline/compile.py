"""Optional compilation of the denoiser (GPU only): ``torch.compile`` or TensorRT.

Both are optional. Without a CUDA device, or without the ``tensorrt`` extra
(``pip install 'clipmill[tensorrt]'``, which brings ``torch_tensorrt``), ``compile_denoiser``
returns ``None`` and a message saying why; the renderer then runs the plain model.

Compiled graphs are specialised to input shapes, so clipmill renders at fixed resolution tiers
(``RESOLUTION_TIERS``) and the group sizes 1-4: each (tier, frames, batch) builds once.
``torch.compile`` keeps its artefacts in ``TORCHINDUCTOR_CACHE_DIR`` (set to
``$CLIPMILL_CACHE/inductor`` unless already set), so a restarted worker reuses them.

The caches' bookkeeping (text K/V entries, DeepCache's step decisions) is marked
``torch.compiler.disable``: the graph breaks around it instead of guarding on its Python state,
so later generations reuse the compiled graphs. Checked on CPU with the ``eager`` backend
(tiny UNet, both caches on): 25 graphs on the first generation, no recompiles on the next
two, output identical. Neither inductor nor TensorRT has been run on a GPU here.
"""

from __future__ import annotations

import os

import torch

from clipmill.pipeline.models import cache_dir

# Width x height tiers a farm compiles for; other sizes run uncompiled.
RESOLUTION_TIERS = ((512, 512), (768, 432), (432, 768), (832, 480), (480, 832), (1024, 576), (576, 1024))


def compile_denoiser(model: torch.nn.Module, how: str, device: str):
    """``(callable or None, message)``: the compiled denoiser, or None and why not."""
    if how == "none":
        return None, "compilation off"
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None, f"--compile {how}: needs a CUDA GPU (device is {device!r}); rendering uncompiled"
    if how == "torch":
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
        return torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=False), (
            "--compile torch: compiled per shape on first use; cached in " + os.environ["TORCHINDUCTOR_CACHE_DIR"]
        )
    if how == "tensorrt":
        try:
            import torch_tensorrt  # noqa: F401
        except ImportError:
            return None, (
                "--compile tensorrt: torch_tensorrt is not installed (pip install 'clipmill[tensorrt]' on a "
                "CUDA host); rendering uncompiled"
            )
        return torch.compile(model, backend="tensorrt", dynamic=False, options={
            "enabled_precisions": {torch.float16}, "cache_built_engines": True, "reuse_cached_engines": True,
            "engine_cache_dir": str(cache_dir() / "tensorrt"),
        }), f"--compile tensorrt: engines built per shape on first use; cached in {cache_dir() / 'tensorrt'}"
    raise ValueError(f"--compile {how!r}: not known; allowed: none, torch, tensorrt")
