"""Loading video diffusion models: a local diffusers folder, or the built-in ``tiny`` model.

The ``tiny`` model has the same classes as a real AnimateDiff pipeline (UNetMotionModel,
AutoencoderKL, CLIPTextModel, CLIPTokenizer) with small configs and random weights. It is
written once to a cache folder with ``save_pretrained`` and always loaded back with
``from_pretrained``, so it runs the same code path as a real model. Its clips are noise.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

TINY = "tiny"
TINY_WARNING = (
    "model 'tiny' has random weights: its clips are noise, good only for smoke runs. "
    "Pass --model PATH with a real AnimateDiff folder for real clips (see README)."
)
# Bump when the tiny configs change, so stale caches are rebuilt rather than reused.
TINY_VERSION = "2"
TINY_SEED = 0


class ModelError(ValueError):
    """A model folder or model name that cannot be used."""


def cache_dir() -> Path:
    """Folder for built artefacts (the tiny model): ``$CLIPMILL_CACHE`` or ``~/.cache/clipmill``."""
    return Path(os.environ.get("CLIPMILL_CACHE", Path.home() / ".cache" / "clipmill"))


@dataclass(frozen=True)
class ModelInfo:
    """What a model can take, read from its folder's configs without loading weights."""

    name: str  # 'tiny' or the folder path as given
    path: Path
    family: str  # 'animatediff'
    scheduler: str  # 'lightning' (Euler, trailing) or 'lcm'
    max_frames: int
    min_frames: int
    size_multiple: int
    min_size: int
    max_size: int
    default_size: tuple[int, int]
    native_fps: int
    max_prompt_tokens: int

    @property
    def is_tiny(self) -> bool:
        return self.name == TINY


def _byte_vocab() -> tuple[dict[str, int], list[str]]:
    """A byte-level BPE vocabulary with no merges: every UTF-8 byte is one token."""
    # GPT-2/CLIP's reversible byte -> printable-character map.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    vocab: dict[str, int] = {}
    for s in symbols:
        vocab[s] = len(vocab)
    for s in symbols:
        vocab[s + "</w>"] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab, []


TINY_MAX_TOKENS = 256  # byte-level tokens: one per UTF-8 byte, so the limit is larger than CLIP's 77


def build_tiny(dest: Path) -> None:
    """Build the tiny AnimateDiff pipeline with random weights and save it to ``dest``."""
    import torch

    quiet_hf()
    from diffusers import (
        AnimateDiffPipeline,
        AutoencoderKL,
        EulerDiscreteScheduler,
        MotionAdapter,
        UNet2DConditionModel,
        UNetMotionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(TINY_SEED)
    unet2d = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    adapter = MotionAdapter(
        block_out_channels=(32, 64),
        motion_layers_per_block=1,
        motion_norm_num_groups=8,
        motion_num_attention_heads=2,
        motion_max_seq_length=32,
    )
    unet = UNetMotionModel.from_unet2d(unet2d, adapter)
    vae = AutoencoderKL(
        block_out_channels=(8, 16, 32, 32),  # four blocks: 8x spatial compression, like SD's VAE
        layers_per_block=1,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=64,
    )
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=514,
            max_position_embeddings=TINY_MAX_TOKENS,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )
    vocab, merges = _byte_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TINY_MAX_TOKENS)
    # AnimateDiff-Lightning's scheduler: Euler, trailing spacing, linear betas.
    scheduler = EulerDiscreteScheduler(
        beta_schedule="linear", timestep_spacing="trailing", beta_start=0.00085, beta_end=0.012
    )
    pipe = AnimateDiffPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        motion_adapter=None,
        scheduler=scheduler,
    )
    pipe.save_pretrained(dest)
    (dest / "clipmill.json").write_text(
        json.dumps({"tiny_version": TINY_VERSION, "native_fps": 24, "default_size": [128, 128]})
    )


def tiny_path() -> Path:
    """Path of the tiny model, building it on first use (atomically: build aside, then rename)."""
    dest = cache_dir() / f"tiny-animatediff-v{TINY_VERSION}"
    if (dest / "model_index.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=dest.parent))
    try:
        build_tiny(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "model_index.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve(model: str) -> Path:
    """The folder for a ``--model`` value: ``tiny`` or a local diffusers folder."""
    if model == TINY:
        return tiny_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(f"--model {model!r}: no such folder; pass 'tiny' or a local diffusers model folder")
    if not (path / "model_index.json").exists():
        raise ModelError(
            f"--model {model!r}: {path / 'model_index.json'} is missing; "
            "the folder must be a diffusers pipeline saved with save_pretrained"
        )
    return path


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from e


def model_info(model: str) -> ModelInfo:
    """Read what a model accepts from its configs, without loading weights."""
    path = resolve(model)
    index = _read_json(path / "model_index.json")
    unet_cls = (index.get("unet") or [None, None])[1]
    if unet_cls != "UNetMotionModel":
        raise ModelError(
            f"--model {model!r}: unet is {unet_cls!r}; clipmill renders AnimateDiff pipelines "
            "(unet UNetMotionModel)"
        )
    unet_cfg = _read_json(path / "unet" / "config.json")
    sched_cfg = _read_json(path / "scheduler" / "scheduler_config.json")
    tok_cfg = _read_json(path / "tokenizer" / "tokenizer_config.json")
    extra = _read_json(path / "clipmill.json")
    n_down = len(unet_cfg.get("block_out_channels", [320, 640, 1280, 1280]))
    vae_cfg = _read_json(path / "vae" / "config.json")
    vae_scale = 2 ** (len(vae_cfg.get("block_out_channels", [128, 256, 512, 512])) - 1)
    multiple = vae_scale * 2 ** (n_down - 1)
    max_tokens = int(tok_cfg.get("model_max_length", 77))
    if max_tokens > 100_000:  # transformers' "no limit" sentinel
        max_tokens = 77
    default = tuple(extra.get("default_size", [512, 512]))
    return ModelInfo(
        name=model,
        path=path,
        family="animatediff",
        scheduler="lcm" if sched_cfg.get("_class_name") == "LCMScheduler" else "lightning",
        max_frames=int(unet_cfg.get("motion_max_seq_length", 32)),
        min_frames=8,
        size_multiple=multiple,
        min_size=max(64, multiple),
        max_size=1536,
        default_size=(int(default[0]), int(default[1])),
        native_fps=int(extra.get("native_fps", 24)),
        max_prompt_tokens=max_tokens,
    )


def quiet_hf() -> None:
    """No download progress bars or import chatter from transformers and diffusers."""
    import transformers.utils.logging as tlog

    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    import diffusers.utils.logging as dlog

    dlog.set_verbosity_error()
    dlog.disable_progress_bar()


def load_tokenizer(info: ModelInfo):
    quiet_hf()
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(info.path / "tokenizer")


def load_pipeline(info: ModelInfo, device: str = "cpu", dtype=None):
    """Load the whole pipeline with ``from_pretrained`` (the same path for tiny and real models)."""
    import torch

    quiet_hf()
    from diffusers import AnimateDiffPipeline

    if dtype is None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
    pipe = AnimateDiffPipeline.from_pretrained(info.path, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)
