"""Loading video diffusion models: a local diffusers folder, or a built-in tiny model.

Two families sit behind one interface (``ModelInfo`` says what a model takes, ``load_pipeline``
loads it):

- ``animatediff``: AnimateDiffPipeline (UNetMotionModel, AutoencoderKL, CLIP text encoder),
  distilled as AnimateDiff-Lightning (Euler, trailing spacing) or AnimateLCM.
- ``wan``: WanPipeline (WanTransformer3DModel, a DiT; AutoencoderKLWan; UMT5 text encoder),
  flow matching; guidance-distilled variants run at guidance 1.0.

The built-in ``tiny`` (AnimateDiff) and ``tiny-wan`` models have the same classes as the real
ones with small configs and random weights. Each is written once to a cache folder with
``save_pretrained`` and always loaded back with ``from_pretrained``, so it runs the same code
path as a real model. Their clips are noise.

The built-in ``shapes`` model is trained here on the shapes world (``pipeline.shapes``; issue 11)
and distilled with LCM. Its folder ships inside the package (``pipeline/weights/shapes/``,
written by ``pipeline.train.export.export_model``; ``make demo-model`` trains and exports it) and
is loaded with ``from_pretrained`` like a user's folder.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .choices import check_noise_shared
from .frame_markers import check_markers

TINY = "tiny"
TINY_WAN = "tiny-wan"
TINY_MODELS = (TINY, TINY_WAN)
TINY_WARNING = (
    "model {name!r} has random weights: its clips are noise, good only for smoke runs. "
    "Pass --model PATH with a real AnimateDiff or Wan folder for real clips (see README)."
)
# Bump when the tiny configs change, so stale caches are rebuilt rather than reused.
TINY_VERSION = "3"
TINY_SEED = 0

SHAPES = "shapes"
SHAPES_VERSION = 1  # of the shapes world and recipe an exported folder was trained on
SHAPES_DIR = Path(__file__).resolve().parent / "weights" / SHAPES  # package data
SHAPES_MISSING = (
    "the shapes model is not built yet: run make demo-model (it trains the model on the shapes world and "
    "exports it into {path}); or pass --model tiny for a smoke run"
)
BUILTIN_MODELS = (*TINY_MODELS, SHAPES)


class ModelError(ValueError):
    """A model folder or model name that cannot be used."""


def cache_dir() -> Path:
    """Folder for built artefacts (the tiny model): ``$CLIPMILL_CACHE`` or ``~/.cache/clipmill``."""
    return Path(os.environ.get("CLIPMILL_CACHE") or Path.home() / ".cache" / "clipmill")  # empty: unset, as elsewhere


@dataclass(frozen=True)
class ModelInfo:
    """What a model can take, read from its folder's configs without loading weights."""

    name: str  # 'tiny', 'tiny-wan', 'shapes' or the folder path as given
    path: Path
    family: str  # 'animatediff' or 'wan'
    scheduler: str  # 'lightning' (Euler, trailing), 'lcm' or 'flow' (flow-matching Euler)
    max_frames: int
    min_frames: int
    size_multiple: int
    min_size: int
    max_size: int
    default_size: tuple[int, int]
    native_fps: int
    max_prompt_tokens: int
    frame_step: int = 1  # frame counts allowed: min_frames + k * frame_step (Wan: 4k+1)
    default_frames: int = 16
    guidance_distilled: bool = True  # distilled models run at guidance 1.0; CFG > 6 over-exposes them
    has_tiny_vae: bool = False  # the folder has vae_tiny/ (AutoencoderTiny, TAESD-style)
    # clipmill.json "world": "shapes" for a model of the shapes world (its prompts can be checked
    # by qc.adherence); "teacher": a diffusers folder (relative to this one) of the undistilled
    # model it was distilled from, sampled by DDIM at "teacher_guidance" (clipmill bench's row 0)
    world: str | None = None
    teacher: Path | None = None
    teacher_guidance: float = 7.5
    # clipmill.json "noise_shared": the share of the noise's variance common to all frames that
    # the model was trained with (pipeline.noise, PYoCo's mixed prior); 0 for independent noise
    noise_shared: float = 0.0
    # clipmill.json "renoise_shared": the same share for the noise a consistency sampler (LCM) draws
    # when it re-noises its clean estimate between steps; None: noise_shared, the training prior
    renoise_shared: float | None = None
    # clipmill.json "frame_markers": the token ids of the model's frame markers (pipeline.frame_markers:
    # one prompt per frame, its last token the frame's place in the clip); () for a model without
    frame_markers: tuple[int, ...] = ()
    # clipmill.json "decode_range": the largest |value| the model's VAE decodes of good clips reach
    # before they are clipped to [-1, 1]; a clip decoded beyond it is rejected by the render check
    # (jobs.runner.checks: latents decoded at the wrong scale, or diverged). None: not checked
    decode_range: float | None = None
    # clipmill.json "decode_input_rms": [low, high], the range of the RMS of the latents its VAE's
    # decoder is given (after the scaling factor) on good clips; outside it, the render check
    # rejects the clip (latents decoded at another model's scaling factor). None: not checked
    decode_input_rms: tuple[float, float] | None = None

    @property
    def renoise(self) -> float:
        """The share common to all frames of the noise drawn between sampling steps."""
        return self.noise_shared if self.renoise_shared is None else self.renoise_shared

    @property
    def is_tiny(self) -> bool:
        return self.name in TINY_MODELS

    @property
    def frames_allowed(self) -> str:
        """What frame counts this model takes, in words."""
        if self.frame_step == 1:
            return f"an integer from {self.min_frames} to {self.max_frames}"
        r = self.min_frames % self.frame_step
        return f"{self.frame_step}k+{r} from {self.min_frames} to {self.max_frames} ({self.min_frames}, {self.min_frames + self.frame_step}, ...)"

    def check_frames(self, frames: int) -> str | None:
        """None if the model takes ``frames``, else what it takes."""
        if self.min_frames <= frames <= self.max_frames and (frames - self.min_frames) % self.frame_step == 0:
            return None
        return f"the {self.family} model takes {self.frames_allowed} frames"

    def check_size(self, width: int, height: int) -> str | None:
        """None if the model takes ``width`` x ``height``, else what it takes."""
        for side in (width, height):
            if side % self.size_multiple or not self.min_size <= side <= self.max_size:
                return (f"the {self.family} model takes sides that are multiples of {self.size_multiple} "
                        f"from {self.min_size} to {self.max_size}")
        return None


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
    """Build the tiny AnimateDiff pipeline with random weights and save it to ``dest``.

    Beside the pipeline it saves ``vae_tiny/``, an AutoencoderTiny (TAESD-style) decoder, as a
    real model folder may have one.
    """
    import torch

    quiet_hf()
    from diffusers import (
        AnimateDiffPipeline,
        AutoencoderKL,
        AutoencoderTiny,
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
    AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=4,
    ).save_pretrained(dest / "vae_tiny")
    (dest / "clipmill.json").write_text(
        json.dumps({"tiny_version": TINY_VERSION, "native_fps": 24, "default_size": [128, 128]})
    )


TINY_WAN_MAX_TOKENS = 226  # WanPipeline's max_sequence_length


def build_tiny_wan(dest: Path) -> None:
    """Build the tiny Wan 2.1 pipeline (DiT) with random weights and save it to ``dest``."""
    import torch

    quiet_hf()
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(TINY_SEED)
    # A sentencepiece-style vocabulary from a piece list: specials, printable ASCII, the word marker.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(chr(c), -1.0) for c in range(32, 127)] + [("\u2581", -1.0)]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TINY_WAN_MAX_TOKENS)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(pieces), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                scheduler=scheduler).save_pretrained(dest)
    (dest / "clipmill.json").write_text(
        json.dumps({"tiny_version": TINY_VERSION, "native_fps": 16, "default_size": [128, 128]})
    )


def build_sd15_arch(dest: Path) -> None:
    """The full-size AnimateDiff SD1.5 architecture (UNet with motion modules, 1.3 B parameters;
    SD's VAE; a CLIP ViT-L text encoder) with random weights, saved in float16. Its compute is the
    real model's, so benchmark figures on a GPU mean something without a download."""
    import torch

    quiet_hf()
    from diffusers import AnimateDiffPipeline, AutoencoderKL, AutoencoderTiny, EulerDiscreteScheduler, MotionAdapter
    from diffusers import UNet2DConditionModel, UNetMotionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(TINY_SEED)
    unet = UNetMotionModel.from_unet2d(UNet2DConditionModel(cross_attention_dim=768), MotionAdapter())
    vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    text_encoder = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                                num_hidden_layers=12, max_position_embeddings=77))
    vocab, merges = _byte_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    scheduler = EulerDiscreteScheduler(beta_schedule="linear", timestep_spacing="trailing", beta_start=0.00085, beta_end=0.012)
    pipe = AnimateDiffPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                               motion_adapter=None, scheduler=scheduler).to(torch.float16)
    pipe.save_pretrained(dest)
    AutoencoderTiny().to(torch.float16).save_pretrained(dest / "vae_tiny")  # TAESD's architecture
    (dest / "clipmill.json").write_text(
        json.dumps({"tiny_version": TINY_VERSION, "native_fps": 24, "default_size": [512, 512]})
    )


ARCHS = {"sd15": build_sd15_arch}


def arch_path(arch: str) -> Path:
    """Path of a full-size architecture with random weights, building it on first use."""
    if arch not in ARCHS:
        raise ModelError(f"--arch {arch!r}: not known; allowed: {', '.join(ARCHS)}")
    return tiny_path(f"arch-{arch}")


def tiny_path(name: str = TINY) -> Path:
    """Path of a tiny model, building it on first use (atomically: build aside, then rename)."""
    build = {TINY: build_tiny, TINY_WAN: build_tiny_wan, **{f"arch-{a}": f for a, f in ARCHS.items()}}[name]
    dest = cache_dir() / f"{name}-v{TINY_VERSION}"
    if (dest / "model_index.json").exists():
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=dest.parent))
    except OSError as e:
        raise ModelError(f"model {name!r} is built on first use in {dest.parent} ($CLIPMILL_CACHE, else ~/.cache/clipmill), "
                         f"which cannot be written ({e.strerror or e}); set CLIPMILL_CACHE to a writable folder") from None
    try:
        build(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "model_index.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def shapes_path() -> Path:
    """The built-in shapes model's folder inside the package, or a ModelError if not built."""
    if not (SHAPES_DIR / "model_index.json").exists():
        hint = SHAPES_MISSING.format(path=SHAPES_DIR)
        if (SHAPES_DIR / "teacher" / "model_index.json").exists():
            hint += (f"; its teacher is shipped ({SHAPES_DIR / 'teacher'}): clipmill train-model --from-teacher "
                     "shapes --ckpt DIR finishes it without training the autoencoder again")
        raise ModelError(f"--model {SHAPES!r}: " + hint)
    return SHAPES_DIR


def resolve(model: str) -> Path:
    """The folder for a ``--model`` value: ``tiny``, ``tiny-wan``, ``shapes`` or a local diffusers folder."""
    if model in TINY_MODELS:
        return tiny_path(model)
    if model == SHAPES:
        return shapes_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelError(
            f"--model {model!r}: no such folder; pass {', '.join(map(repr, BUILTIN_MODELS))} or a local diffusers model folder"
        )
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
    transformer_cls = (index.get("transformer") or [None, None])[1]
    if unet_cls == "UNetMotionModel":
        return _animatediff_info(model, path)
    if transformer_cls == "WanTransformer3DModel":
        return _wan_info(model, path)
    raise ModelError(
        f"--model {model!r}: {path / 'model_index.json'} names unet {unet_cls!r} and transformer "
        f"{transformer_cls!r}; clipmill renders AnimateDiff (unet UNetMotionModel) and Wan "
        "(transformer WanTransformer3DModel) pipelines"
    )


def _animatediff_info(model: str, path: Path) -> ModelInfo:
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
        max_frames=min(int(unet_cfg.get("motion_max_seq_length", 32)), int(extra.get("max_frames", 10**6))),
        min_frames=8,
        size_multiple=multiple,
        min_size=max(64, multiple),
        max_size=1536,
        default_size=(int(default[0]), int(default[1])),
        native_fps=int(extra.get("native_fps", 24)),
        max_prompt_tokens=max_tokens,
        default_frames=int(extra.get("default_frames", 16)),
        guidance_distilled=bool(extra.get("guidance_distilled", True)),
        has_tiny_vae=(path / "vae_tiny" / "config.json").exists(),
        **_teacher_and_world(path, extra),
    )


def _teacher_and_world(path: Path, extra: dict) -> dict:
    """``world``, ``teacher`` and ``teacher_guidance`` from a folder's clipmill.json."""
    out: dict = {"world": extra.get("world"), "teacher_guidance": float(extra.get("teacher_guidance", 7.5))}
    try:
        out["noise_shared"] = check_noise_shared(extra.get("noise_shared", 0.0))
        if extra.get("renoise_shared") is not None:
            out["renoise_shared"] = check_noise_shared(extra["renoise_shared"], "renoise_shared")
        out["frame_markers"] = check_markers(extra.get("frame_markers"))
        out["decode_range"] = check_decode_range(extra.get("decode_range"))
        out["decode_input_rms"] = check_decode_input_rms(extra.get("decode_input_rms"))
    except ValueError as e:
        raise ModelError(f"{path / 'clipmill.json'}: {e}") from None
    if extra.get("teacher"):
        teacher = path / extra["teacher"]
        if not teacher.resolve().is_relative_to(path.resolve()):
            raise ModelError(f"{path / 'clipmill.json'}: teacher {extra['teacher']!r} is outside the model folder")
        if not (teacher / "model_index.json").exists():
            raise ModelError(f"{path / 'clipmill.json'}: teacher {extra['teacher']!r}: {teacher / 'model_index.json'} "
                             "is missing; it must be a diffusers pipeline folder inside the model folder")
        out["teacher"] = teacher
    return out


def check_decode_range(value) -> float | None:
    """clipmill.json's ``decode_range`` as a float above 1 (None when absent), or a ValueError
    naming the field, the value and what is allowed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 1.0:
        raise ValueError(f"decode_range={value!r}: allowed a number above 1 (the largest |value| a good clip's "
                         "VAE decode reaches before it is clipped to [-1, 1]), or no entry for no check")
    return float(value)


def check_decode_input_rms(value) -> tuple[float, float] | None:
    """clipmill.json's ``decode_input_rms`` as (low, high) with 0 < low < high (None when
    absent), or a ValueError naming the field, the value and what is allowed."""
    if value is None:
        return None
    ok = (isinstance(value, list | tuple) and len(value) == 2
          and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value)
          and 0 < value[0] < value[1])
    if not ok:
        raise ValueError(f"decode_input_rms={value!r}: allowed [low, high] with 0 < low < high (the range of the RMS "
                         "of the latents a good clip's VAE decoder is given), or no entry for no check")
    return float(value[0]), float(value[1])


def _wan_info(model: str, path: Path) -> ModelInfo:
    tr_cfg = _read_json(path / "transformer" / "config.json")
    vae_cfg = _read_json(path / "vae" / "config.json")
    extra = _read_json(path / "clipmill.json")
    try:
        decode_range = check_decode_range(extra.get("decode_range"))
        if (rms := extra.get("decode_input_rms")) is not None:  # refused, not ignored
            raise ValueError(f"decode_input_rms={rms!r}: not read for a Wan folder (its latents are de-normalised "
                             "per channel before decoding); state decode_range only")
    except ValueError as e:
        raise ModelError(f"{path / 'clipmill.json'}: {e}") from None
    temporal = 2 ** sum(bool(x) for x in vae_cfg.get("temperal_downsample", [False, True, True]))
    spatial = 2 ** len(vae_cfg.get("temperal_downsample", [False, True, True]))
    patch = tr_cfg.get("patch_size", [1, 2, 2])
    multiple = spatial * int(patch[1])
    default = tuple(extra.get("default_size", [832, 480]))
    return ModelInfo(
        name=model,
        path=path,
        family="wan",
        scheduler="flow",
        max_frames=int(extra.get("max_frames", 81)),
        min_frames=temporal + 1,
        frame_step=temporal,
        size_multiple=multiple,
        min_size=max(64, multiple),
        max_size=1280,
        default_size=(int(default[0]), int(default[1])),
        native_fps=int(extra.get("native_fps", 16)),
        max_prompt_tokens=int(extra.get("max_prompt_tokens", TINY_WAN_MAX_TOKENS)),
        default_frames=temporal * 4 + 1,
        guidance_distilled=bool(extra.get("guidance_distilled", True)),
        decode_range=decode_range,
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
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(info.path / "tokenizer")


def load_pipeline(info: ModelInfo, device: str = "cpu", dtype=None):
    """Load the whole pipeline with ``from_pretrained`` (the same path for tiny and real models)."""
    import torch

    quiet_hf()
    from diffusers import AnimateDiffPipeline, WanPipeline

    if dtype is None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
    cls = WanPipeline if info.family == "wan" else AnimateDiffPipeline
    pipe = cls.from_pretrained(info.path, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def load_tiny_vae(info: ModelInfo, device: str = "cpu", dtype=None):
    """The folder's AutoencoderTiny (``vae_tiny/``), or a ModelError saying it has none."""
    import torch

    if not info.has_tiny_vae:
        raise ModelError(f"--decoder tiny: {info.path / 'vae_tiny'} is missing; the model folder has no AutoencoderTiny")
    from diffusers import AutoencoderTiny

    if dtype is None:
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
    return AutoencoderTiny.from_pretrained(info.path / "vae_tiny", dtype=dtype).to(device)
