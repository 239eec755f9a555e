"""The shapes model's networks: small configs of the real AnimateDiff classes, and every size in
one place (:class:`UNetSpec` and the constants below; a recipe picks a spec by value).

Sized for steps per minute on one CPU core (measured in ``../shared/NOTES.md``, "A cheaper
teacher recipe"):

- ``AutoencoderKL``, three blocks: 4x spatial compression, 64 x 64 RGB to 4 x 16 x 16 latents.
- ``CLIPTextModel``, width 64, 3 layers, over the byte-level ``CLIPTokenizer`` of the tiny model
  (one token per UTF-8 byte, so Chinese works with no vocabulary files). The encoder keeps 256
  positions, but the tokenizer pads to :data:`MAX_TOKENS` (77, as CLIP's; the grammar's longest
  cleaned caption is 56 bytes with its start and end tokens). The encoder is causal, so the
  first 77 states are the same whatever the padded length: only the UNet's cross-attention,
  over 3.3x fewer keys, sees the difference.
- ``UNetMotionModel`` (:class:`UNetSpec`): by default (:data:`TEACHER`) channels 32/64/64,
  cross-attention at the two lower levels, temporal transformers at the two lower levels only
  (the 16 x 16 level's motion module has no transformer layer: at that level it costs a quarter
  of the step and the motion is still modelled one and two levels down), 2 heads.
- A 1000-step schedule with SD's betas (0.00085-0.012, linear, which is what the renderer's
  samplers force) and v-prediction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..models import TINY_MAX_TOKENS, _byte_vocab

LATENT_CHANNELS = 4
LATENT_SIDE = 16  # 64 px / 4
TEXT_WIDTH = 64
TEXT_POSITIONS = TINY_MAX_TOKENS  # the text encoder's position table (unchanged: old text checkpoints stay valid)
MAX_TOKENS = 77  # the tokenizer's padded length: what the UNet cross-attends over
VAE_CHANNELS = (32, 64, 64)


@dataclass(frozen=True)
class UNetSpec:
    """A UNetMotionModel's sizes, one entry per level, from the 16 x 16 level down.

    - ``channels``: block widths (multiples of 16, the group-norm groups).
    - ``cross_attention``: whether the level's blocks attend to the text states.
    - ``motion_layers``: temporal transformer layers in the level's motion modules (0: the
      module is only its norm and projections).
    - ``heads`` / ``motion_heads``: attention heads of the spatial / temporal transformers.
    """

    channels: tuple[int, ...] = (32, 64, 64)
    cross_attention: tuple[bool, ...] = (False, True, True)
    motion_layers: tuple[int, ...] = (0, 1, 1)
    heads: int = 2
    motion_heads: int = 2
    motion_mid_block: bool = True

    def __post_init__(self):
        n = len(self.channels)
        if not 2 <= n <= 4 or len(self.cross_attention) != n or len(self.motion_layers) != n:
            raise ValueError(f"UNetSpec: channels {self.channels}, cross_attention {self.cross_attention} and "
                             f"motion_layers {self.motion_layers} need one entry per level (2 to 4 levels)")
        if any(c % 16 or c % self.heads or c % self.motion_heads for c in self.channels):
            raise ValueError(f"UNetSpec.channels={self.channels}: each must be a multiple of 16 and of the heads "
                             f"({self.heads}, {self.motion_heads})")
        if any(m < 0 for m in self.motion_layers):
            raise ValueError(f"UNetSpec.motion_layers={self.motion_layers}: must be >= 0")

    def as_dict(self) -> dict:
        return asdict(self)


TEACHER = UNetSpec()  # 2.3 M params: ~0.85 s per training step of 8 clips on one core
FIRST_PROBE = UNetSpec(channels=(32, 64, 128), motion_layers=(1, 1, 1), heads=4, motion_heads=4)  # the 5.9 M first plan
SMOKE = UNetSpec(channels=(16, 32, 32), heads=1, motion_heads=1)


def build_vae(channels: tuple[int, int, int] = VAE_CHANNELS):
    """AutoencoderKL: 64 x 64 x 3 <-> 16 x 16 x 4 (three blocks; channels multiples of 16)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        block_out_channels=channels,
        layers_per_block=1,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=64,
    )


def build_tokenizer():
    """The byte-level CLIPTokenizer (no merges, no files), as the tiny model's, padding to
    :data:`MAX_TOKENS`."""
    from transformers import CLIPTokenizer

    vocab, merges = _byte_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=MAX_TOKENS)


def build_text_encoder():
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            hidden_size=TEXT_WIDTH,
            intermediate_size=4 * TEXT_WIDTH,
            num_attention_heads=4,
            num_hidden_layers=3,
            vocab_size=514,
            max_position_embeddings=TEXT_POSITIONS,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )


def build_unet(spec: UNetSpec = TEACHER):
    """UNetMotionModel on 4 x 16 x 16 latents, 8 frames, cross-attention on the text states."""
    from diffusers import UNetMotionModel

    down = tuple("CrossAttnDownBlockMotion" if x else "DownBlockMotion" for x in spec.cross_attention)
    up = tuple("CrossAttnUpBlockMotion" if x else "UpBlockMotion" for x in reversed(spec.cross_attention))
    return UNetMotionModel(
        sample_size=LATENT_SIDE,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        down_block_types=down,
        up_block_types=up,
        block_out_channels=spec.channels,
        layers_per_block=1,
        norm_num_groups=16,
        cross_attention_dim=TEXT_WIDTH,
        num_attention_heads=spec.heads,
        motion_num_attention_heads=spec.motion_heads,
        motion_max_seq_length=32,
        use_motion_mid_block=spec.motion_mid_block,
        temporal_transformer_layers_per_block=spec.motion_layers,
    )


def build_scheduler():
    """The teacher's 1000-step training schedule (DDPM betas of SD, v-prediction)."""
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="linear",
        prediction_type="v_prediction",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        timestep_spacing="trailing",
    )


def count(module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in module.parameters())


# the parts of a temporal transformer block that write into its residual stream
_BLOCK_OUTPUTS = ("attn1.to_out.0.", "attn2.to_out.0.", "ff.net.2.")


def grow_unet(state: dict, spec: UNetSpec):
    """A UNet of ``spec`` that computes exactly what the UNet with weights ``state`` computes, when
    ``spec`` only adds temporal transformer layers to it: the old weights are loaded, and each new
    layer's outputs into the residual stream (its attentions' and feed-forward's last
    projections) start at zero, so every new layer starts as the identity and training adds to
    what the old network had learnt. With nothing to add it is a strict load of ``state`` in
    float32. Raises ValueError naming the weights that do not fit."""
    import torch

    unet = build_unet(spec)
    mine = unet.state_dict()
    if extra := [k for k in state if k not in mine]:
        raise ValueError(f"grow_unet: {len(extra)} weight(s) have no place in UNetSpec {spec} (for example "
                         f"{extra[0]}): a UNet can only grow temporal layers")
    if bad := [k for k in state if state[k].shape != mine[k].shape]:
        raise ValueError(f"grow_unet: {bad[0]} has shape {tuple(state[bad[0]].shape)}, UNetSpec {spec} needs "
                         f"{tuple(mine[bad[0]].shape)}: a UNet can only grow temporal layers")
    new = [k for k in mine if k not in state]
    if wrong := [k for k in new if ".motion_modules." not in k or ".transformer_blocks." not in k]:
        raise ValueError(f"grow_unet: {wrong[0]} would start untrained: a UNet can only grow temporal layers")
    unet.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if name in new and any(o in name for o in _BLOCK_OUTPUTS):
                p.zero_()
    return unet
