"""The shapes model's networks: small configs of the real AnimateDiff classes.

Sized for steps per minute on one CPU core (see ``pipeline.train``'s docstring for the figures):

- ``AutoencoderKL``, three blocks: 4x spatial compression, 64 x 64 RGB to 4 x 16 x 16 latents.
- ``CLIPTextModel``, width 64, 3 layers, over the byte-level ``CLIPTokenizer`` of the tiny model
  (one token per UTF-8 byte, so Chinese works with no vocabulary files), 256 positions.
- ``UNetMotionModel``: channels 32/64/128 (the teacher stage's), cross-attention at the two lower levels, motion
  modules at every level, conditioned on the text encoder's 64-wide hidden states.
- A 1000-step schedule with SD's betas (0.00085-0.012, linear, which is what the renderer's
  samplers force) and v-prediction.
"""

from __future__ import annotations

from ..models import TINY_MAX_TOKENS, _byte_vocab

LATENT_CHANNELS = 4
LATENT_SIDE = 16  # 64 px / 4
TEXT_WIDTH = 64
MAX_TOKENS = TINY_MAX_TOKENS


def build_vae(channels: tuple[int, int, int] = (32, 64, 64)):
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
    """The byte-level CLIPTokenizer (no merges, no files), as the tiny model's."""
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
            max_position_embeddings=MAX_TOKENS,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        )
    )


def build_unet(channels: tuple[int, int, int] = (64, 128, 128)):
    """UNetMotionModel on 4 x 16 x 16 latents, 8 frames, cross-attention on the text states
    (channels multiples of 16; the teacher stage passes its own, see ``stages.train_teacher``)."""
    from diffusers import UNetMotionModel

    return UNetMotionModel(
        sample_size=LATENT_SIDE,
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        down_block_types=("DownBlockMotion", "CrossAttnDownBlockMotion", "CrossAttnDownBlockMotion"),
        up_block_types=("CrossAttnUpBlockMotion", "CrossAttnUpBlockMotion", "UpBlockMotion"),
        block_out_channels=channels,
        layers_per_block=1,
        norm_num_groups=16,
        cross_attention_dim=TEXT_WIDTH,
        num_attention_heads=4,
        motion_num_attention_heads=4,
        motion_max_seq_length=32,
        use_motion_mid_block=True,
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
