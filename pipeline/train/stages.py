"""The training stages of the shapes model, one after another: ``vae``, ``text``, ``teacher``
(then ``student``, the step distillation in ``distill``), then ``decoder``; ``recipe`` runs them
all in order.

Each stage keeps its state under ``root/<stage>/`` (outside the work tree): ``state.pt`` (weights,
optimiser, step, data stream) every ``ckpt_every`` steps, so a restarted run resumes where it
stopped, and a diffusers folder when it ends (``root/vae/model``, ``root/text/model``,
``root/teacher/pipeline``), with a ``done`` marker that makes a rerun skip the stage (a JSON
record written whole or not at all, last; a damaged one is an error that names it).

- ``vae``: AutoencoderKL on 32 x 32 crops (half of them on the shape) with the shape's pixels
  weighted up (the shape is a few percent of a frame; a plain loss drops it). At the end its
  ``scaling_factor`` is set to 1 / the latents' standard deviation.
- ``text``: the CLIP text encoder trained alone, as a classifier of the five attributes from the
  cleaned caption, read at every position from the end token on (the pipeline pads with the end
  token and the encoder is causal, so all those positions see the whole caption). Then frozen.
- ``teacher``: the UNetMotionModel (``nets.UNetSpec``), v-prediction on the frozen VAE's latents
  with min-SNR weighting, 10% empty captions (for guidance), an EMA of its weights. The latents
  come from a pool of training clips encoded once (``data.LatentPool``, under ``root/pool``,
  shared with the student stage), not from a VAE pass per step. Every ``eval_every`` steps the
  EMA samples prompts from the training and the held-out split, and the analyzer
  (``qc.adherence``) logs adherence per attribute. :class:`DenoiserConfig` holds its settings.
- ``decoder``: the VAE's decoder fine-tuned on whole clips with the encoder frozen, against
  reconstructions whose error changes from frame to frame (:class:`DecoderConfig`); the latents,
  and so the denoisers, are unchanged by it (``root/decoder/model``).

Every stage returns a :class:`StageResult`: the loss of each step it ran (empty when it was done
already) and, for the denoisers, a probe loss: the same loss on a fixed batch (fixed clips,
timesteps and noise), logged every ``log_every`` steps. A diffusion loss on random timesteps
swings by 10x from step to step; the probe shows learning where the training loss cannot.
``eval_every=0`` turns the (sampling) evaluations off, as the tests' tiny runs do.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...qc import adherence
from ...storage.local import replacing, write_atomic
from .. import noise as video_noise
from .. import frame_markers, shapes
from . import nets
from .data import Clean, LatentPool, PoolData, ShapesData, file_digest, labels_of, latent_mask

Log = Callable[[str], None]
Device = torch.device | str  # where a stage trains: "cpu", "cuda", "cuda:1"


@dataclass
class StageResult:
    """What a stage run did: each step's training loss, and ``probe`` {step: probe loss}."""

    losses: list[float] = field(default_factory=list)
    probe: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StageConfig:
    """One stage's schedule. ``eval_every`` 0: no evaluation, not even at the end."""

    steps: int
    batch: int
    lr: float
    ckpt_every: int = 100
    log_every: int = 20
    eval_every: int = 500
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch", "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"StageConfig.{name}={getattr(self, name)}: must be at least 1")
        if self.eval_every < 0 or not self.lr > 0:
            raise ValueError(f"StageConfig eval_every={self.eval_every}, lr={self.lr}: need eval_every >= 0 and lr > 0")

    def lr_at(self, step: int, warmup: int) -> float:
        """The learning rate at ``step``: warmed up linearly over ``warmup`` steps, then a cosine
        from ``lr`` down to a tenth of it at the last step."""
        return self.lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / self.steps)))

    def eval_due(self, step: int) -> bool:
        """Whether to evaluate after ``step``: every ``eval_every`` steps and at the end."""
        return self.eval_every > 0 and (step % self.eval_every == 0 or step == self.steps)


# ----------------------------------------------------------------------------- checkpoints


def _load_state(path: Path) -> dict | None:
    # on the CPU whatever device it was written from, so a checkpoint resumes on any machine
    return torch.load(path, weights_only=False, map_location="cpu") if path.exists() else None


def _save_state(path: Path, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:  # a kill mid-save keeps the previous checkpoint
        torch.save(state, tmp)


def save_checkpoint(path: Path, parts: dict, data, step: int, **extra) -> None:
    """A stage's checkpoint: the state of each of ``parts`` (modules and optimizers by name),
    the data generator, the step, torch's random state and ``extra``."""
    _save_state(path, {**{k: v.state_dict() for k, v in parts.items()}, "rng": data.rng, "step": step,
                       "torch_rng": torch.get_rng_state(), **extra})


def resume(path: Path, parts: dict, data, log: Log, stage: str, check: Callable[[dict], None] | None = None,
           optional: tuple[str, ...] = ()) -> int:
    """Load a checkpoint written by ``save_checkpoint`` into ``parts`` and ``data``; the step it
    had reached, 0 without one. ``check(state)`` may refuse a checkpoint before anything loads.
    The ``optional`` parts may be missing from it (a checkpoint from before they existed): they
    keep their fresh state."""
    state = _load_state(path)
    if not state:
        return 0
    if check is not None:
        check(state)
    for key, part in parts.items():
        if key in optional and key not in state:
            log(f"[{stage}] {path} has no {key!r}: it starts fresh")
            continue
        part.load_state_dict(state[key])
    data.rng = state["rng"]
    if "torch_rng" in state:  # checkpoints from before it was saved resume with a fresh stream
        torch.set_rng_state(state["torch_rng"])
    log(f"[{stage}] resumed at step {state['step']}")
    return state["step"]


JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_json(path: Path) -> dict:
    """The JSON object in the file ``path``: FileNotFoundError when there is none, ValueError
    naming the file when it is not JSON (cut short, empty) or holds something else."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({'an empty file' if not path.stat().st_size else e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds a JSON {JSON_KINDS.get(type(data), type(data).__name__)}, not a JSON object")
    return data


def read_done(root: Path, stage: str) -> dict | None:
    """What ``stage`` recorded when it finished (its ``done`` marker), None while it has not.
    A damaged marker is an error naming it (ValueError), not a finished stage."""
    path = root / stage / "done"
    try:
        return read_json(path)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ValueError(f"{e}; it is the {stage} stage's done marker, damaged: delete it and run the stage again "
                         "(it resumes from its last checkpoint, if it has one)") from None


def _done(root: Path, stage: str) -> bool:
    return read_done(root, stage) is not None


def _mark_done(root: Path, stage: str, info: dict) -> None:
    """Write ``stage``'s done marker whole or not at all (a kill or a full disk mid-write leaves
    none, never a cut-short one that reads as done)."""
    write_atomic(root / stage / "done", lambda f: f.write(json.dumps(info, indent=1).encode()))


class _Meter:
    """Running means of named values, printed every ``every`` steps with the speed."""

    def __init__(self, log: Log, stage: str, total: int, every: int):
        self.log, self.stage, self.total, self.every = log, stage, total, every
        self.sums: dict[str, float] = {}
        self.n = 0
        self.t = time.time()

    def add(self, step: int, **values: float) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v)
        self.n += 1
        if step % self.every == 0 or step == self.total:
            dt = (time.time() - self.t) / self.n
            vals = " ".join(f"{k}={v / self.n:.4g}" for k, v in self.sums.items())
            eta = (self.total - step) * dt / 60
            self.log(f"[{self.stage}] step {step}/{self.total} {vals} {dt:.2f}s/step eta {eta:.0f}min")
            self.sums, self.n, self.t = {}, 0, time.time()


# ----------------------------------------------------------------------------- vae


def _psnr(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None = None) -> float:
    err = (a - b) ** 2
    mse = err.mean() if w is None else (err * w).sum() / (w.sum() * a.shape[-3]).clamp(min=1)
    return float(10 * torch.log10(4.0 / mse.clamp(min=1e-10)))  # range [-1, 1]: peak-to-peak 2


def _crops(frames: torch.Tensor, alpha: torch.Tensor, rng: np.random.Generator, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``side`` crops of (N, 3, H, W) frames; half of them centred near the shape."""
    n, _, h, w = frames.shape
    fs, as_ = [], []
    for i in range(n):
        ys, xs = torch.nonzero(alpha[i] > 0.5, as_tuple=True)
        if rng.random() < 0.5 and len(ys):
            cy = int(ys.float().mean()) + int(rng.integers(-side // 4, side // 4 + 1))
            cx = int(xs.float().mean()) + int(rng.integers(-side // 4, side // 4 + 1))
            y0, x0 = min(max(cy - side // 2, 0), h - side), min(max(cx - side // 2, 0), w - side)
        else:
            y0, x0 = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
        fs.append(frames[i, :, y0:y0 + side, x0:x0 + side])
        as_.append(alpha[i, y0:y0 + side, x0:x0 + side])
    return torch.stack(fs), torch.stack(as_)


def _shape_weight(alpha: torch.Tensor, gain: float) -> torch.Tensor:
    """1 + gain on the shape and a 2-px ring around it (its edge is where it blurs away)."""
    ring = F.max_pool2d(alpha[:, None], 5, stride=1, padding=2)
    return 1.0 + gain * ring


def _reconstruction_loss(err: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The autoencoder's loss on a reconstruction error (N, 3, H, W): squared plus half the
    absolute error, weighted per pixel by ``w`` (N, 1, H, W)."""
    return (err**2 * w).sum() / (w.sum() * 3) + 0.5 * (err.abs() * w).sum() / (w.sum() * 3)


def vae_reconstruct(vae, frames: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1] through the VAE (posterior mean)."""
    with torch.no_grad():
        return vae.decode(vae.encode(frames).latent_dist.mode()).sample.clamp(-1, 1)


def _to_uint8(frames: torch.Tensor) -> np.ndarray:
    """(B, T, 3, H, W) in [-1, 1] to (B, T, H, W, 3) uint8."""
    return ((frames.permute(0, 1, 3, 4, 2) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()


def eval_vae(vae, clean: Clean, n: int = 24, seed: int = 999) -> dict:
    """PSNR (all pixels, shape pixels) and the analyzer's adherence on reconstructed clips."""
    data = ShapesData(clean, seed, "all")
    b = data.batch(n)
    x = b.frames.flatten(0, 1).to(vae.device)
    y = torch.cat([vae_reconstruct(vae, x[i:i + 64]) for i in range(0, len(x), 64)])
    w = b.alpha.flatten(0, 1)[:, None].to(vae.device)
    clips = _to_uint8(y.view_as(b.frames))
    adh = adherence.adherence([adherence.analyze(c) for c in clips], b.specs)
    return {"psnr": _psnr(y, x), "psnr_shape": _psnr(y, x, w), **{k: round(v, 3) for k, v in adh.items()}}


def train_vae(root: Path, cfg: StageConfig, clean: Clean, log: Log, crop: int = 32, shape_gain: float = 20.0,
              kl: float = 1e-6, channels: tuple[int, int, int] = nets.VAE_CHANNELS, device: Device = "cpu") -> StageResult:
    stage = "vae"
    if _done(root, stage):
        log(f"[{stage}] done already: {root / stage / 'model'}")
        return StageResult()
    torch.manual_seed(cfg.seed)
    vae = nets.build_vae(channels).to(device)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = ShapesData(clean, cfg.seed, "all")
    parts = {"model": vae, "opt": opt}
    step = resume(root / stage / "state.pt", parts, data, log, stage)
    log(f"[{stage}] AutoencoderKL {nets.count(vae) / 1e6:.2f} M params, batch {cfg.batch} crops of {crop}px")
    meter = _Meter(log, stage, cfg.steps, cfg.log_every)
    losses: list[float] = []
    vae.train()
    while step < cfg.steps:
        step += 1
        b = data.batch(max(1, cfg.batch // shapes.FRAMES))
        x, a = _crops(b.frames.flatten(0, 1), b.alpha.flatten(0, 1), data.rng, crop)
        x, a = x.to(device), a.to(device)
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step, warmup=100)
        post = vae.encode(x).latent_dist
        y = vae.decode(post.sample()).sample
        rec = _reconstruction_loss(y - x, _shape_weight(a, shape_gain))
        loss = rec + kl * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        meter.add(step, loss=loss.item(), psnr=_psnr(y.detach(), x), psnr_shape=_psnr(y.detach(), x, a[:, None]))
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_checkpoint(root / stage / "state.pt", parts, data, step)
        if cfg.eval_due(step):
            vae.eval()
            log(f"[{stage}] eval step {step}: {eval_vae(vae, clean)}")
            vae.train()
    vae.eval()
    with torch.no_grad():  # latents' spread, for the scaling factor
        b = ShapesData(clean, cfg.seed + 1, "all").batch(16)
        z = vae.encode(b.frames.flatten(0, 1).to(device)).latent_dist.mode()
    scale = float(1.0 / z.std())
    vae.register_to_config(scaling_factor=scale)
    vae.save_pretrained(root / stage / "model")
    info = {"step": step, "scaling_factor": scale, **(eval_vae(vae, clean, n=48) if cfg.eval_every else {})}
    _mark_done(root, stage, info)
    log(f"[{stage}] saved {root / stage / 'model'}: {info}")
    return StageResult(losses)


@dataclass(frozen=True)
class DecoderConfig:
    """The ``decoder`` stage's loss: the VAE's own reconstruction loss on whole clips, the shape
    and a 2 px ring around it weighted ``1 + shape_gain``, plus ``temporal`` times the weighted
    mean square of the reconstruction error's frame-to-frame change (an edge redrawn a little
    differently in every frame is what QC reads as boiling)."""

    shape_gain: float = 8.0
    temporal: float = 1.0

    def __post_init__(self):
        if self.shape_gain < 0 or self.temporal < 0:
            raise ValueError(f"DecoderConfig shape_gain={self.shape_gain}, temporal={self.temporal}: must be >= 0")


def decoder_loss(vae, frames: torch.Tensor, alpha: torch.Tensor, cfg: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, decoded frames) for clips ``frames`` (B, T, 3, H, W) in [-1, 1] with shape coverage
    ``alpha`` (B, T, H, W): the frozen encoder's posterior mean, decoded."""
    b, t = frames.shape[:2]
    x = frames.flatten(0, 1)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
    y = vae.decode(z).sample
    w = _shape_weight(alpha.flatten(0, 1).float(), cfg.shape_gain)
    err = y - x
    loss = _reconstruction_loss(err, w)
    if cfg.temporal:
        e, wv = err.view(b, t, *err.shape[1:]), w.view(b, t, *w.shape[1:])
        wt = torch.maximum(wv[:, 1:], wv[:, :-1])  # the shape's ring in either frame of the pair
        loss = loss + cfg.temporal * ((e[:, 1:] - e[:, :-1]) ** 2 * wt).sum() / (wt.sum() * 3)
    return loss, y


def train_decoder(root: Path, cfg: StageConfig, clean: Clean, log: Log, dcfg: DecoderConfig = DecoderConfig(),
                  device: Device = "cpu") -> StageResult:
    """The VAE's decoder fine-tuned on whole clips (``cfg.batch`` frames a step, in clips of
    ``shapes.FRAMES``), its encoder frozen: the latents the teacher and the student were trained
    on do not change, so this stage may run after them. The ``vae`` stage trained on 32 px crops,
    frame by frame; its reconstruction of a moving shape's edge changed from frame to frame with
    the shape's place in the 4x4 latent cell, which QC rejected as boiling in about 1 clip in 4 of
    the generator's own clips passed through it. Saves ``root/decoder/model``."""
    stage = "decoder"
    if _done(root, stage):
        log(f"[{stage}] done already: {root / stage / 'model'}")
        return StageResult()
    from diffusers import AutoencoderKL

    torch.manual_seed(cfg.seed)
    vae = AutoencoderKL.from_pretrained(root / "vae" / "model").to(device)
    vae.requires_grad_(False)
    tuned = [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]
    for p in tuned:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(tuned, lr=cfg.lr, weight_decay=0.0)
    data = ShapesData(clean, cfg.seed + 1, "all")
    parts = {"decoder": vae.decoder, "post_quant_conv": vae.post_quant_conv, "opt": opt}
    step = resume(root / stage / "state.pt", parts, data, log, stage)
    clips = max(1, cfg.batch // shapes.FRAMES)
    log(f"[{stage}] the decoder ({nets.count(vae.decoder) / 1e6:.2f} M params) on {clips} whole clip(s) a step, "
        f"the encoder frozen")
    meter = _Meter(log, stage, cfg.steps, cfg.log_every)
    losses: list[float] = []
    vae.eval()
    vae.decoder.train()
    while step < cfg.steps:
        step += 1
        b = data.batch(clips)
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step, warmup=50)
        frames = b.frames.to(device)
        loss, y = decoder_loss(vae, frames, b.alpha.to(device), dcfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tuned, 1.0)
        opt.step()
        losses.append(loss.item())
        meter.add(step, loss=loss.item(), psnr=_psnr(y.detach(), frames.flatten(0, 1)))
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_checkpoint(root / stage / "state.pt", parts, data, step)
    vae.eval()
    vae.save_pretrained(root / stage / "model")
    info = {"step": step, **(eval_vae(vae, clean, n=48) if cfg.eval_every else {})}
    _mark_done(root, stage, info)
    log(f"[{stage}] saved {root / stage / 'model'}: {info}")
    return StageResult(losses)


# ----------------------------------------------------------------------------- text


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    """Token ids, padded to the tokenizer's max length as the pipeline pads them."""
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                     return_tensors="pt").input_ids


class AttributeHeads(torch.nn.Module):
    """One linear classifier per attribute over the text encoder's hidden states."""

    def __init__(self, width: int):
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, len(shapes.VOCAB[a])) for a in shapes.ATTRIBUTES)

    def loss_and_acc(self, hidden: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy over the positions from the first end token on, and per-attribute
        accuracy of the first end token's reading."""
        first = (ids == eos).int().argmax(dim=1)
        pos = torch.arange(ids.shape[1], device=ids.device)[None, :]
        mask = (pos >= first[:, None]).float()
        losses, accs = [], []
        for i, head in enumerate(self.heads):
            logits = head(hidden)  # (B, L, V)
            ce = F.cross_entropy(logits.transpose(1, 2), labels[:, i:i + 1].expand(-1, ids.shape[1]), reduction="none")
            losses.append((ce * mask).sum() / mask.sum())
            pred = logits[torch.arange(len(ids), device=ids.device), first].argmax(-1)
            accs.append((pred == labels[:, i]).float().mean())
        return torch.stack(losses).mean(), torch.stack(accs)


def eval_text(text_encoder, tokenizer, heads: AttributeHeads, clean: Clean) -> dict:
    """Accuracy per attribute over every caption of the grammar (both languages, held-out too)."""
    data = ShapesData(clean, 0, "all")
    specs = shapes.all_specs()
    caps = [data.cleaned(shapes.caption(s, lang)) for lang in ("en", "zh") for s in specs]
    labels = torch.tensor([labels_of(s) for _ in ("en", "zh") for s in specs]).to(text_encoder.device)
    accs = []
    with torch.no_grad():
        for i in range(0, len(caps), 200):
            ids = tokenize(tokenizer, caps[i:i + 200]).to(text_encoder.device)
            _, acc = heads.loss_and_acc(text_encoder(ids)[0], ids, labels[i:i + 200], tokenizer.eos_token_id)
            accs.append(acc * len(ids))
    acc = torch.stack(accs).sum(0) / len(caps)
    return dict(zip(shapes.ATTRIBUTES, [round(float(a), 4) for a in acc]))


def train_text(root: Path, cfg: StageConfig, clean: Clean, log: Log, device: Device = "cpu") -> StageResult:
    stage = "text"
    if _done(root, stage):
        log(f"[{stage}] done already: {root / stage / 'model'}")
        return StageResult()
    torch.manual_seed(cfg.seed)
    te, tok = nets.build_text_encoder().to(device), nets.build_tokenizer()
    heads = AttributeHeads(nets.TEXT_WIDTH).to(device)
    params = list(te.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.01)
    # every caption of the grammar is a valid training input for the classifier (the held-out
    # split is over clips, and the text encoder must read held-out prompts too)
    data = ShapesData(clean, cfg.seed, "all")
    parts = {"model": te, "heads": heads, "opt": opt}
    step = resume(root / stage / "state.pt", parts, data, log, stage)
    log(f"[{stage}] CLIPTextModel {nets.count(te) / 1e6:.3f} M params, batch {cfg.batch}")
    meter = _Meter(log, stage, cfg.steps, cfg.log_every)
    losses: list[float] = []
    te.train()
    while step < cfg.steps:
        step += 1
        b = data.batch(cfg.batch, render=False)
        ids = tokenize(tok, b.captions).to(device)
        for g in opt.param_groups:
            g["lr"] = cfg.lr * min(1.0, step / 50)
        loss, acc = heads.loss_and_acc(te(ids)[0], ids, b.labels.to(device), tok.eos_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        meter.add(step, loss=loss.item(), acc=acc.mean().item())
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_checkpoint(root / stage / "state.pt", parts, data, step)
    te.eval()
    info = {"step": step, **(eval_text(te, tok, heads, clean) if cfg.eval_every else {})}
    te.save_pretrained(root / stage / "model")
    tok.save_pretrained(root / stage / "model")
    torch.save(heads.state_dict(), root / stage / "heads.pt")
    _mark_done(root, stage, info)
    log(f"[{stage}] saved {root / stage / 'model'}: accuracy {info}")
    return StageResult(losses)


# ----------------------------------------------------------------------------- teacher


class TextCache:
    """Frozen text encoder hidden states per caption (the grammar has 1,800, plus ''); with
    ``markers`` (the token ids of a text encoder that holds trained frame markers), also each
    caption's per-frame states (:meth:`frames`)."""

    def __init__(self, text_encoder, tokenizer, markers: tuple[int, ...] = ()):
        self.te, self.tok, self.markers = text_encoder, tokenizer, tuple(markers)
        self.cache: dict[str, torch.Tensor] = {}
        self.marked: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, captions: list[str]) -> torch.Tensor:
        new = [c for c in dict.fromkeys(captions) if c not in self.cache]
        if new:
            with torch.no_grad():
                hidden = self.te(tokenize(self.tok, new).to(self.te.device))[0]
            self.cache.update(zip(new, hidden))
        return torch.stack([self.cache[c] for c in captions])

    def frames(self, captions: list[str], frames: int, on: list[bool] | None = None) -> torch.Tensor:
        """Per-frame states (len(captions) * frames, tokens, dim), clip-major: each caption's
        frames marked with their place in the clip (a caption whose ``on`` is False, and every
        caption when there are no markers, repeated plain)."""
        on = [bool(self.markers)] * len(captions) if on is None else [bool(x) and bool(self.markers) for x in on]
        new = [c for c in dict.fromkeys(c for c, m in zip(captions, on) if m) if (c, frames) not in self.marked]
        if new:
            ids = frame_markers.mark(tokenize(self.tok, new), frames, self.markers)
            with torch.no_grad():
                hidden = self.te(ids.to(self.te.device))[0]
            self.marked.update(((c, frames), h) for c, h in zip(new, hidden.view(len(new), frames, *hidden.shape[1:])))
        unmarked = [c for c, m in zip(captions, on) if not m]
        plain = dict(zip(unmarked, self(unmarked))) if unmarked else {}
        return torch.cat([self.marked[(c, frames)] if m else plain[c].expand(frames, -1, -1)
                          for c, m in zip(captions, on)])


class MarkerEmbeddings(torch.nn.Module):
    """The trained embeddings of a model's frame-marker tokens (``pipeline.frame_markers``): the
    teacher learns them with its UNet while the rest of the text encoder stays frozen.
    :meth:`states` encodes per-frame prompts with them; :meth:`write_into` puts them into a text
    encoder's token table, which then encodes the same states by itself (as the renderer runs it)."""

    FIRST_ID = 1  # the byte tokens U+0001...: control characters, which prompt cleaning removes

    def __init__(self, count: int, width: int, scale: float):
        super().__init__()
        if not 2 <= count <= frame_markers.MAX_MARKERS:
            raise ValueError(f"MarkerEmbeddings count={count}: allowed 2 to {frame_markers.MAX_MARKERS}")
        self.ids = tuple(range(self.FIRST_ID, self.FIRST_ID + count))
        self.weight = torch.nn.Parameter(torch.randn(count, width) * scale / math.sqrt(width))

    @classmethod
    def for_encoder(cls, text_encoder, count: int) -> MarkerEmbeddings:
        """Markers of the encoder's width, drawn (from torch's generator) at the typical norm of
        its trained token embeddings."""
        table = text_encoder.get_input_embeddings().weight
        return cls(count, table.shape[1], float(table[257:].detach().norm(dim=1).mean())).to(table.device)

    def states(self, text_encoder, tokenizer, captions: list[str], frames: int, on: list[bool]) -> torch.Tensor:
        """Per-frame states (len(captions) * frames, tokens, dim) with these marker embeddings
        (gradients reach them); a caption whose ``on`` is False is repeated plain."""
        rows = frame_markers.mark(tokenize(tokenizer, captions), frames, self.ids, on).to(self.weight.device)
        last = rows[:, -1]
        ids = torch.tensor(self.ids, device=rows.device)
        hit = (last[:, None] == ids).any(1)
        which = (last[hit, None] == ids).int().argmax(1)

        def swap(_module, _inp, out):
            out = out.clone()
            out[hit, -1] = self.weight[which].to(out.dtype)
            return out

        handle = text_encoder.get_input_embeddings().register_forward_hook(swap)
        try:
            return text_encoder(rows)[0]
        finally:
            handle.remove()

    @classmethod
    def read_from(cls, text_encoder, ids: Sequence[int]) -> MarkerEmbeddings:
        """The markers a text encoder's token table holds at ``ids`` (what :meth:`write_into`
        wrote), to train on from there."""
        table = text_encoder.get_input_embeddings().weight
        out = cls(len(ids), table.shape[1], 1.0)
        with torch.no_grad():
            out.weight.copy_(table[list(ids)])
        return out

    @classmethod
    def from_state(cls, state: dict) -> MarkerEmbeddings:
        """Markers from a checkpoint's ``state_dict``."""
        out = cls(*state["weight"].shape, 1.0)
        out.load_state_dict(state)
        return out

    @torch.no_grad()
    def write_into(self, text_encoder):
        """A copy of ``text_encoder`` whose token table holds these markers."""
        out = copy.deepcopy(text_encoder)
        out.get_input_embeddings().weight[list(self.ids)] = self.weight.detach().to(out.dtype)
        return out


def encode_latents(vae, frames: torch.Tensor) -> torch.Tensor:
    """(B, T, 3, H, W) in [-1, 1] to scaled latents (B, C, T, h, w), the UNetMotionModel layout,
    on the VAE's device."""
    b, t = frames.shape[:2]
    with torch.no_grad():
        z = vae.encode(frames.flatten(0, 1).to(vae.device)).latent_dist.mode() * vae.config.scaling_factor
    return z.view(b, t, *z.shape[1:]).permute(0, 2, 1, 3, 4).contiguous()


def decode_latents(vae, z: torch.Tensor) -> np.ndarray:
    """Scaled latents (B, C, T, h, w) to (B, T, H, W, 3) uint8."""
    b, _, t = z.shape[:3]
    flat = z.to(vae.device).permute(0, 2, 1, 3, 4).flatten(0, 1) / vae.config.scaling_factor
    with torch.no_grad():
        x = torch.cat([vae.decode(flat[i:i + 64]).sample for i in range(0, len(flat), 64)])
    return _to_uint8(x.clamp(-1, 1).view(b, t, *x.shape[1:]))


def uncond_rows(uncond: torch.Tensor, clips: int, frames: int) -> torch.Tensor:
    """The empty caption's states for ``clips`` clips, one row per frame: ``uncond`` is one row
    (1, tokens, dim), one clip's per-frame rows (frames, tokens, dim) of a model with frame
    markers, or every clip's (clips * frames, tokens, dim)."""
    if len(uncond) == clips * frames:
        return uncond
    if len(uncond) == frames:
        return uncond.repeat(clips, 1, 1)
    return uncond.expand(clips * frames, -1, -1)


def sample(unet, scheduler, cond: torch.Tensor, uncond: torch.Tensor, steps: int, guidance: float,
           generator: torch.Generator, frames: int = shapes.FRAMES, noise_shared: float = 0.0) -> torch.Tensor:
    """DDIM (the schedule's own spacing) with classifier-free guidance, from noise with the
    model's prior (``noise_shared``, ``pipeline.noise``; drawn on the CPU from ``generator``, so a
    seed gives the same noise on any device); returns scaled latents on ``cond``'s device.
    ``cond`` is one row per clip or per frame (``TextCache.frames``), ``uncond`` as
    :func:`uncond_rows` takes it."""
    b = len(cond)
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(steps)
    x = video_noise.video_noise((b, nets.LATENT_CHANNELS, frames, nets.LATENT_SIDE, nets.LATENT_SIDE), noise_shared,
                                generator).to(cond.device)
    x = x * sched.init_noise_sigma
    ehs = torch.cat([frame_markers.per_frame(cond, b, frames), uncond_rows(uncond, b, frames)])
    with torch.no_grad():
        for t in sched.timesteps:
            inp = sched.scale_model_input(torch.cat([x, x]), t)
            out = unet(inp, t, encoder_hidden_states=ehs).sample
            c, u = out.chunk(2)
            x = sched.step(u + guidance * (c - u), t, x).prev_sample
    return x


def eval_teacher(unet, vae, text: TextCache, scheduler, clean: Clean, n: int = 16, steps: int = 25,
                 guidance: float = 3.0, seed: int = 4242, noise_shared: float = 0.0) -> dict:
    """Adherence of sampled clips on ``n`` train-split and ``n`` held-out prompts (fixed seeds)."""
    out = {}
    for split in ("train", "heldout"):
        data = ShapesData(clean, seed, split)  # type: ignore[arg-type]
        b = data.batch(n, render=False)
        g = torch.Generator().manual_seed(seed)
        z = sample(unet, scheduler, text.frames(b.captions, shapes.FRAMES), text.frames([""], shapes.FRAMES), steps,
                   guidance, g, noise_shared=noise_shared)
        clips = decode_latents(vae, z)
        adh = adherence.adherence([adherence.analyze(c) for c in clips], b.specs)
        out[split] = {k: round(v, 3) for k, v in adh.items()}
    return out


@dataclass
class Probe:
    """A fixed batch for a probe loss: latents, their captions' text states, timesteps spread
    over the schedule, and noise, all from their own seeds (the training's RNG is untouched)."""

    z0: torch.Tensor
    mask: torch.Tensor  # (n, T, h, w) shape masks at latent resolution
    cond: torch.Tensor  # (n, tokens, dim), not repeated per frame
    t: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def make(cls, vae, text: TextCache, clean: Clean, n: int = 4, seed: int = 77, t_max: int = 1000,
             noise_shared: float = 0.0) -> Probe:
        b = ShapesData(clean, seed, "train").batch(n)
        z0 = encode_latents(vae, b.frames)
        g = torch.Generator().manual_seed(seed)
        t = ((torch.arange(n) + 0.5) * t_max / n).long()
        return cls(z0, latent_mask(b.alpha, z0.shape[-1]).float().to(z0.device), text(b.captions), t.to(z0.device),
                   video_noise.video_noise(tuple(z0.shape), noise_shared, g).to(z0.device))


def shape_weight(mask: torch.Tensor, gain: float) -> torch.Tensor:
    """Per-cell loss weights (B, 1, T, h, w) from shape masks (B, T, h, w): ``1 + gain * mask``,
    normalised to mean 1 per clip, so the loss keeps its scale while the shape (a few percent of
    the cells, but its colour, shape and motion) gets a share of it worth learning from."""
    w = 1.0 + gain * mask[:, None]
    return w / w.mean(dim=(1, 2, 3, 4), keepdim=True)


WEIGHTINGS = ("min_snr", "min_snr_plus1")


def timestep_weight(snr: torch.Tensor, min_snr: float, weighting: str = "min_snr") -> torch.Tensor:
    """The v-prediction MSE's weight per timestep, from its SNR (``alpha_bar / (1 - alpha_bar)``).

    - ``min_snr`` (Hang et al. 2023, for v-prediction): ``min(SNR, min_snr) / (SNR + 1)``. In
      terms of the clean-latent error that is ``min(SNR, min_snr)``: at high noise it falls to
      about SNR, as the epsilon loss, so the first half of the schedule, where the sampler lays
      out where the shape is and how the scene moves, weighs under a fifth of the rest.
    - ``min_snr_plus1``: ``min(SNR + 1, min_snr) / (SNR + 1)``, i.e. ``min(1, min_snr / (SNR + 1))``:
      the plain v loss (clean-latent weight SNR + 1, as progressive distillation's) at high noise,
      capped like min-SNR at low noise.
    """
    if weighting == "min_snr":
        return snr.clamp(max=min_snr) / (snr + 1)
    if weighting == "min_snr_plus1":
        return (snr + 1).clamp(max=min_snr) / (snr + 1)
    raise ValueError(f"weighting={weighting!r}; allowed: {', '.join(WEIGHTINGS)}")


def teacher_loss(unet, z0: torch.Tensor, cond: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, scheduler,
                 min_snr: float, cells: torch.Tensor | None = None, weighting: str = "min_snr",
                 temporal: float = 0.0) -> torch.Tensor:
    """The teacher's loss: v-prediction MSE weighted per timestep (:func:`timestep_weight`) and per
    cell (``cells``, :func:`shape_weight`) when given (``cond``: text states, one row per clip or
    per frame), plus ``temporal`` times the same MSE of the
    error's frame-to-frame differences (:func:`temporal_error`), unweighted by cell."""
    acp, t = scheduler.alphas_cumprod.to(z0.device), t.to(z0.device)  # the UNet takes t on the latents' device
    zt = scheduler.add_noise(z0, noise, t)
    target = scheduler.get_velocity(z0, noise, t)
    snr = acp[t] / (1 - acp[t])
    weight = timestep_weight(snr, min_snr, weighting).view(-1, 1, 1, 1, 1)
    if cells is not None:
        weight = weight * cells
    pred = unet(zt, t, encoder_hidden_states=frame_markers.per_frame(cond, len(z0), z0.shape[2])).sample
    err = pred - target
    loss = (weight * err**2).mean()
    if temporal:
        loss = loss + temporal * temporal_error(err, timestep_weight(snr, min_snr, weighting))
    return loss


def temporal_error(err: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The mean square of an error's frame-to-frame differences (B, C, T, h, w), weighted per clip.

    The v error is the clean-latent error times a per-clip constant, so this is the error in
    how each frame changes into the next: a background redrawn a little differently every frame
    (boiling) or a shape off its path costs here, however small each frame's own error is. Half of
    it, as the difference of two frames' errors has twice their variance when they are independent."""
    d = err[:, :, 1:] - err[:, :, :-1]
    return 0.5 * (weight.view(-1, 1, 1, 1, 1) * d**2).mean()


def export_pipeline(dest: Path, unet, vae, text_encoder, tokenizer, scheduler) -> None:
    """Save an AnimateDiffPipeline folder (diffusers format) with these parts (copied to the CPU
    first when they train elsewhere: the folder loads on any machine)."""
    from diffusers import AnimateDiffPipeline

    unet, vae, text_encoder = (m if m.device.type == "cpu" else copy.deepcopy(m).cpu() for m in (unet, vae, text_encoder))
    pipe = AnimateDiffPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                               motion_adapter=None, scheduler=scheduler)
    pipe.save_pretrained(dest)


MARKER_WARMUP = 100  # steps of learning-rate warm-up when the teacher starts training with frame markers


@dataclass(frozen=True)
class DenoiserConfig:
    """The teacher's network and loss, and the latent pool it (and the student) trains on.

    - ``unet``: the UNetMotionModel's sizes (``nets.UNetSpec``).
    - ``pool_clips``: training clips encoded once into ``root/pool`` (16 KiB each; about 60 ms
      of VAE encoding each on one core). Each is seen with a fresh timestep, noise and caption
      language every time, so a pool a few times smaller than the clips a run draws is enough.
    - ``timesteps``: ``uniform`` over the 1000-step schedule, or ``logit_normal`` (t / 1000 =
      sigmoid(N(0, 1)): the middle of the schedule, where the layout is decided, more often).
    - ``warmup``: steps of linear learning-rate warm-up.
    - ``shape_gain``: a latent cell the shape touches weighs ``1 + shape_gain`` times a cell it
      does not (:func:`shape_weight`, normalised to mean 1 per clip). The first teacher,
      unweighted, drew colour, background and camera right by step 2,000 but the shape's motion
      at chance: the shape is 3-9% of the pixels (about twice that of the latent cells, which
      count when its edge touches them), so its trajectory was a small part of the loss.
    - ``min_snr`` and ``weighting``: the loss's weight per timestep (:func:`timestep_weight`).
    - ``noise_shared``: the share of the training noise's variance common to all frames of a clip
      (``pipeline.noise``, PYoCo's mixed prior); the model must be sampled with the same prior, so
      it is exported into the model's ``clipmill.json``. 0: independent noise per frame.
    - ``prior_from``: the teacher step after which its training noise has the prior (a teacher
      trained on independent noise first and then fine-tuned with the prior; 0: from the start).
      The student always distils with ``noise_shared``.
    - ``temporal``: the weight of the frame-to-frame error term (:func:`temporal_error`).
    - ``reverse``: the probability that a training clip is played backwards, with its caption's
      motion and pan swapped (``PoolData.latents``): the same frames under both captions, so
      that only the direction of time tells "moves up" from "moves down". The student draws
      its clips the same way (its targets are still the teacher's).
    - ``tilt``: the share of the pool's clips with a vertical camera move (``shapes.TILTS``,
      training-only: no prompt of the grammar asks for one), so that the whole frame moves up or
      down in training as often as the pans move it sideways. The shipped model's "moves up" and
      "moves down" are its weak directions, and its time reading was found to follow the
      horizontal only (README, "Why the motion fails"). 0: the grammar's cameras only.
    - ``markers``: the number of frame markers (``pipeline.frame_markers``: one prompt per frame,
      its last token the frame's place in the clip) the teacher trains from ``markers_from`` on,
      their embeddings (:class:`MarkerEmbeddings`) learnt with the UNet while the rest of the text
      encoder stays frozen; ``markers_drop`` of the clips keep the plain prompt (so the model
      still renders without them: the streaming preview). From ``markers_from`` on the UNet
      trains at ``markers_lr`` and the markers at ``marker_embedding_lr``, both warmed up over
      ``MARKER_WARMUP`` steps, and the EMA starts its warm-up again, as a fine-tune of the
      teacher of that step. 0: no markers (the text is the same in every frame).
    """

    unet: nets.UNetSpec = nets.TEACHER
    pool_clips: int = 16384
    cfg_drop: float = 0.1
    min_snr: float = 5.0
    weighting: str = "min_snr"
    ema_decay: float = 0.999
    timesteps: str = "uniform"
    warmup: int = 200
    shape_gain: float = 8.0
    noise_shared: float = 0.0
    prior_from: int = 0
    temporal: float = 0.0
    reverse: float = 0.0
    tilt: float = 0.0
    markers: int = 0
    markers_from: int = 0
    markers_drop: float = 0.1
    markers_lr: float = 3e-4
    marker_embedding_lr: float = 3e-3

    def __post_init__(self):
        if self.timesteps not in ("uniform", "logit_normal"):
            raise ValueError(f"DenoiserConfig.timesteps={self.timesteps!r}; allowed: uniform, logit_normal")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"DenoiserConfig.weighting={self.weighting!r}; allowed: {', '.join(WEIGHTINGS)}")
        if self.pool_clips < 1:
            raise ValueError(f"DenoiserConfig.pool_clips={self.pool_clips}: must be at least 1")
        video_noise.check_shared(self.noise_shared)
        if self.temporal < 0 or self.prior_from < 0:
            raise ValueError(f"DenoiserConfig temporal={self.temporal}, prior_from={self.prior_from}: must be >= 0")
        if not 0.0 <= self.reverse <= 1.0:
            raise ValueError(f"DenoiserConfig.reverse={self.reverse}: a probability, 0 to 1")
        if not 0.0 <= self.tilt < 1.0:
            raise ValueError(f"DenoiserConfig.tilt={self.tilt}: a share of the pool's clips, 0 to under 1")
        if self.markers and not 2 <= self.markers <= frame_markers.MAX_MARKERS or self.markers < 0:
            raise ValueError(f"DenoiserConfig.markers={self.markers}: 0 (none) or 2 to {frame_markers.MAX_MARKERS}")
        if not 0.0 <= self.markers_drop < 1.0 or self.markers_from < 0:
            raise ValueError(f"DenoiserConfig markers_drop={self.markers_drop}, markers_from={self.markers_from}: "
                             "the drop is a share of the clips, 0 to under 1; the step is >= 0")

    def marked_at(self, step: int) -> bool:
        """Whether the teacher trains with frame markers at ``step`` (1-based)."""
        return bool(self.markers) and step > self.markers_from

    def ema_decay_at(self, step: int) -> float:
        """The EMA's decay at ``step``: warmed up from the start, and again from ``markers_from``."""
        k = step - self.markers_from if self.marked_at(step) else step
        return min(self.ema_decay, (1 + k) / (10 + k))

    def shared_at(self, step: int) -> float:
        """The noise prior the teacher trains with at ``step`` (1-based): ``noise_shared`` after
        ``prior_from``, independent noise before."""
        return self.noise_shared if step > self.prior_from else 0.0

    def sample_timesteps(self, n: int, num_train_timesteps: int = 1000) -> torch.Tensor:
        """``n`` training timesteps, drawn from torch's global generator."""
        if self.timesteps == "logit_normal":
            return (torch.sigmoid(torch.randn(n)) * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)
        return torch.randint(0, num_train_timesteps, (n,))


def latent_pool(root: Path, vae, clips: int, seed: int, log: Log, tilt: float = 0.0) -> LatentPool:
    """The training clips' latents under ``root/pool``, encoded by the frozen VAE at
    ``root/vae/model`` on first use (resumable), shared by the teacher and the student. With
    the VAE on a GPU the clips are rendered by all but one of the CPU's cores (rendering is then
    most of the pool's time); on the CPU by this process alone (its cores train)."""
    digest = file_digest(root / "vae" / "model" / "diffusion_pytorch_model.safetensors")
    workers = 1 if vae.device.type == "cpu" else max(1, (os.cpu_count() or 1) - 1)
    return LatentPool.build(root / "pool", vae, digest, clips, seed, log, encode_latents, tilt=tilt, workers=workers)


def train_teacher(root: Path, cfg: StageConfig, clean: Clean, log: Log,
                  net: DenoiserConfig = DenoiserConfig(), device: Device = "cpu") -> StageResult:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTokenizer

    stage = "teacher"
    if _done(root, stage):
        log(f"[{stage}] done already: {root / stage / 'pipeline'}")
        return StageResult()
    torch.manual_seed(cfg.seed)
    vae = AutoencoderKL.from_pretrained(root / "vae" / "model").to(device).eval().requires_grad_(False)
    te = CLIPTextModel.from_pretrained(root / "text" / "model").to(device).eval().requires_grad_(False)
    # a text stage saved with 256 positions gives the same first 77 states (the encoder is causal)
    tok = CLIPTokenizer.from_pretrained(root / "text" / "model", model_max_length=nets.MAX_TOKENS)
    text = TextCache(te, tok)
    scheduler = nets.build_scheduler()
    unet = nets.build_unet(net.unet).to(device)
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    opt = torch.optim.AdamW(unet.parameters(), lr=cfg.lr, weight_decay=0.0)
    pool = latent_pool(root, vae, net.pool_clips, cfg.seed, log, net.tilt)
    data = PoolData(clean, cfg.seed, pool)

    def same_size(state: dict) -> None:
        if state.get("unet") != net.unet.as_dict():
            raise ValueError(f"[{stage}] {root / stage / 'state.pt'} holds a UNet of another size "
                             f"({state.get('unet', 'the first plan')}; this run asks for {net.unet.as_dict()}): "
                             f"move {root / stage} aside to train this one")

    parts = {"model": unet, "ema": ema, "opt": opt}
    markers = markers_ema = marker_opt = None
    if net.markers:  # learnt from markers_from on; a checkpoint from before them starts them fresh
        markers = MarkerEmbeddings.for_encoder(te, net.markers)
        markers_ema = copy.deepcopy(markers).requires_grad_(False)
        marker_opt = torch.optim.AdamW(markers.parameters(), lr=net.marker_embedding_lr, weight_decay=0.0)
        parts.update(markers=markers, markers_ema=markers_ema, marker_opt=marker_opt)
    step = resume(root / stage / "state.pt", parts, data, log, stage, check=same_size,
                  optional=("markers", "markers_ema", "marker_opt"))
    log(f"[{stage}] UNetMotionModel {nets.count(unet) / 1e6:.2f} M params, batch {cfg.batch} clips from a pool of "
        f"{len(pool)}, latents {nets.LATENT_CHANNELS}x{shapes.FRAMES}x{nets.LATENT_SIDE}x{nets.LATENT_SIDE}, "
        f"{net.timesteps} timesteps weighted {net.weighting} {net.min_snr:g}, lr {cfg.lr}, shape cells weighted "
        f"{1 + net.shape_gain:g}x")
    probe = Probe.make(vae, text, clean, seed=cfg.seed + 77, noise_shared=net.shared_at(step + 1))
    result = StageResult()

    def run_probe() -> None:  # always min-SNR weighted, so that runs of either weighting compare
        with torch.no_grad():
            result.probe[step] = teacher_loss(unet, probe.z0, probe.cond, probe.t, probe.noise, scheduler, net.min_snr,
                                              shape_weight(probe.mask, net.shape_gain)).item()
        log(f"[{stage}] step {step} probe loss {result.probe[step]:.5f}")

    run_probe()
    meter = _Meter(log, stage, cfg.steps, cfg.log_every)
    losses = result.losses
    unet.train()
    while step < cfg.steps:
        step += 1
        z0, mask, captions, _ = data.latents(cfg.batch, net.reverse)
        z0, mask = z0.to(device), mask.to(device)
        caps = [("" if data.rng.random() < net.cfg_drop else c) for c in captions]
        marked = net.marked_at(step)
        if marked:  # one prompt per frame; markers_drop of the clips keep the plain one
            on = [bool(data.rng.random() >= net.markers_drop) for _ in caps]
            cond = markers.states(te, tok, caps, z0.shape[2], on)
        else:
            cond = text(caps)
        noise = video_noise.like(z0, net.shared_at(step))
        t = net.sample_timesteps(len(z0), scheduler.config.num_train_timesteps)
        if marked:
            ramp = min(1.0, (step - net.markers_from) / MARKER_WARMUP)
            for g in opt.param_groups:
                g["lr"] = net.markers_lr * ramp
            for g in marker_opt.param_groups:
                g["lr"] = net.marker_embedding_lr * ramp
        else:
            for g in opt.param_groups:
                g["lr"] = cfg.lr * min(1.0, step / net.warmup)
        loss = teacher_loss(unet, z0, cond, t, noise, scheduler, net.min_snr, shape_weight(mask, net.shape_gain),
                            net.weighting, net.temporal)
        opt.zero_grad(set_to_none=True)
        if marked:
            marker_opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(unet.parameters()) + ([markers.weight] if marked else []), 1.0)
        opt.step()
        if marked:
            marker_opt.step()
        with torch.no_grad():
            d = net.ema_decay_at(step)
            for pe, p in zip(ema.parameters(), unet.parameters()):
                pe.lerp_(p, 1 - d)
            if marked:
                markers_ema.weight.lerp_(markers.weight, 1 - d)
        losses.append(loss.item())
        meter.add(step, loss=loss.item())
        if step % cfg.log_every == 0 or step == cfg.steps:
            run_probe()
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            save_checkpoint(root / stage / "state.pt", parts, data, step, unet=net.unet.as_dict())
        if cfg.eval_due(step):
            t0 = time.time()
            te_now = markers_ema.write_into(te) if marked else te
            res = eval_teacher(ema, vae, TextCache(te_now, tok, markers_ema.ids) if marked else text, scheduler, clean,
                               noise_shared=net.shared_at(step))
            log(f"[{stage}] eval step {step} (EMA, DDIM 25, cfg 3; {time.time() - t0:.0f}s): {json.dumps(res)}")
            export_pipeline(root / stage / "pipeline", ema, vae, te_now, tok, scheduler)
    marked = net.marked_at(step)
    export_pipeline(root / stage / "pipeline", ema, vae, markers_ema.write_into(te) if marked else te, tok, scheduler)
    _mark_done(root, stage, {"step": step, "unet": net.unet.as_dict(), "params": nets.count(ema),
                             "noise_shared": net.shared_at(step),
                             **({"frame_markers": list(markers_ema.ids)} if marked else {})})
    log(f"[{stage}] saved {root / stage / 'pipeline'}")
    return result


# the stages before distillation; ``recipe.STAGES`` adds ``student`` (``distill``)
STAGES: dict[str, Callable[..., StageResult]] = {"vae": train_vae, "text": train_text, "teacher": train_teacher}
