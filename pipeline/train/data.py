"""Training batches from the shapes world, with cleaned captions and attribute labels.

``ShapesData`` renders clips on the fly (the VAE stage trains on pixels). The denoisers train on
latents instead, drawn from a :class:`LatentPool`: a fixed set of training clips encoded once by
the frozen VAE and kept on disk as float16 (16 KiB a clip, and 4 KiB of shape mask). Encoding a
batch of 8 clips costs about 0.5 s on one core, as much as a third of a teacher step; read from
the pool it is free.
Captions are drawn per use (either language), so the pool holds specs, not captions. It also
holds each clip's shape mask at latent resolution (:func:`latent_mask`): the denoisers weight
their loss up on the shape, a few percent of the frame that carries its colour, shape and motion.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import shapes
from ...storage.local import replacing

Clean = Callable[[str], str]


@dataclass
class Batch:
    """``frames`` (B, T, 3, H, W) in [-1, 1]; ``alpha`` (B, T, H, W) shape coverage in [0, 1];
    ``captions`` cleaned; ``labels`` (B, 5) attribute indices in ``shapes.ATTRIBUTES`` order."""

    frames: torch.Tensor
    alpha: torch.Tensor
    captions: list[str]
    labels: torch.Tensor
    specs: list[shapes.Spec]


def labels_of(spec: shapes.Spec) -> list[int]:
    """The spec's attribute indices, in ``shapes.ATTRIBUTES`` order (a training-only tilt's camera
    index follows the grammar's four: ``shapes.TRAIN_VOCAB``)."""
    return [shapes.TRAIN_VOCAB[a].index(getattr(spec, a)) for a in shapes.ATTRIBUTES]


class ShapesData:
    """An endless, seeded stream of batches from one split, captions in both languages.

    ``clean`` is the project's prompt cleaning (raw caption -> the prompt the renderer sees);
    its results are memoised, since the grammar has only 1,800 captions.
    """

    def __init__(self, clean: Clean, seed: int, split: shapes.Split = "train",
                 languages: tuple[str, ...] = ("en", "zh")):
        self.clean = clean
        self.rng = np.random.default_rng(seed)
        self.pool = shapes.split_specs(split)
        self.languages = languages
        self._cleaned: dict[str, str] = {}

    def cleaned(self, raw: str) -> str:
        if raw not in self._cleaned:
            self._cleaned[raw] = self.clean(raw)
        return self._cleaned[raw]

    def specs(self, n: int) -> list[tuple[shapes.Spec, str]]:
        """``n`` (spec, cleaned caption) pairs."""
        out = []
        for _ in range(n):
            spec = self.pool[int(self.rng.integers(len(self.pool)))]
            lang = self.languages[int(self.rng.integers(len(self.languages)))]
            out.append((spec, self.cleaned(shapes.caption(spec, lang))))  # type: ignore[arg-type]
        return out

    def batch(self, n: int, render: bool = True) -> Batch:
        """``n`` clips (or, with ``render=False``, only their captions and labels)."""
        pairs = self.specs(n)
        specs = [s for s, _ in pairs]
        labels = torch.tensor([labels_of(s) for s in specs])
        if not render:
            return Batch(torch.empty(0), torch.empty(0), [c for _, c in pairs], labels, specs)
        clips = [shapes.render(s, int(self.rng.integers(2**31))) for s in specs]
        frames = _frames_tensor(clips)
        alpha = torch.from_numpy(np.stack([c.alpha for c in clips]))
        return Batch(frames, alpha, [c for _, c in pairs], labels, specs)


def _frames_tensor(clips: list[shapes.Clip]) -> torch.Tensor:
    """(B, T, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(np.stack([c.frames for c in clips])).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0


def latent_mask(alpha: torch.Tensor, side: int) -> torch.Tensor:
    """Shape coverage (B, T, H, W) in [0, 1] to (B, T, side, side) float16: each latent cell's
    largest coverage, so a cell the shape's edge touches counts as the shape's."""
    b, t = alpha.shape[:2]
    m = torch.nn.functional.adaptive_max_pool2d(alpha.float().flatten(0, 1)[:, None], side)
    return m.view(b, t, side, side).half()


def file_digest(path: Path) -> str:
    """sha256 of a file (the VAE weights a pool was encoded with)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class LatentPool:
    """Training clips' scaled latents (N, C, T, h, w) float16, encoded once by a frozen VAE, with
    their shape masks (N, T, h, w) float16 and each clip's spec index into :func:`pool_specs`
    (``shapes.split_specs(split)``, then, for a pool with tilts, ``shapes.tilt_specs()``).

    :meth:`build` writes a folder: ``meta.json`` (what the pool was encoded with) and one
    ``chunk-NNNN.pt`` per :data:`CHUNK` clips, so a killed build resumes at its last chunk. A pool
    records the digest of the VAE weights it was encoded with, and refuses to load for another.
    """

    CHUNK = 512

    def __init__(self, latents: torch.Tensor, masks: torch.Tensor, spec_index: torch.Tensor,
                 split: shapes.Split = "train", tilt: float = 0.0):
        self.latents, self.masks, self.spec_index, self.split = latents, masks, spec_index, split
        self.specs = pool_specs(split, tilt)

    def __len__(self) -> int:
        return len(self.latents)

    @classmethod
    def build(cls, folder: Path, vae, vae_digest: str, clips: int, seed: int, log: Callable[[str], None],
              encode: Callable, split: shapes.Split = "train", tilt: float = 0.0, workers: int = 1) -> LatentPool:
        """Load the pool in ``folder``, or encode it (``encode(vae, frames) -> latents``), resuming
        a partial build. The clips are drawn from ``seed`` alone, so a rebuild gives the same pool.

        ``tilt``: the share of clips drawn from ``shapes.tilt_specs()`` (vertical camera moves,
        which are not in the grammar) instead of the split; 0 draws the pool it always did.
        ``workers``: processes rendering the clips (the CPU's share of the work; a clip is a pure
        function of its spec and seed, so any number renders the same pool)."""
        folder = Path(folder)
        if not 0.0 <= tilt < 1.0:
            raise ValueError(f"LatentPool.build tilt={tilt}: a share of the clips, 0 to under 1")
        meta = {"vae": vae_digest, "seed": seed, "split": split, "clips": clips, "chunk": cls.CHUNK, "masks": True}
        if tilt:
            meta["tilt"] = tilt
        if (folder / "meta.json").exists():
            theirs = json.loads((folder / "meta.json").read_text())
            if theirs != meta:
                raise ValueError(f"{folder}: this latent pool was encoded with other settings ({theirs}, asked "
                                 f"{meta}); delete the folder to encode a new one")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "meta.json").write_text(json.dumps(meta, indent=1))
        rng = np.random.default_rng([seed, 0x9001])
        pool, first_tilt = pool_specs(split, tilt), len(shapes.split_specs(split))
        idx = rng.integers(0, first_tilt, clips)
        seeds = rng.integers(0, 2**31, clips)
        if tilt:  # a stream of its own, so that the other clips are the ones a pool without tilts has
            extra = np.random.default_rng([seed, 0x7117])
            tilted = extra.random(clips) < tilt
            idx[tilted] = extra.integers(first_tilt, len(pool), int(tilted.sum()))
        starts = range(0, clips, cls.CHUNK)
        todo = [i for i in starts if not (folder / f"chunk-{i // cls.CHUNK:04d}.pt").exists()]
        if todo:
            left = sum(min(cls.CHUNK, clips - i) for i in todo)
            log(f"[pool] encoding {clips} {split} clips into latents ({clips - left} done), {folder}")
            t0, encoded = time.time(), 0
            # spawned, not forked: the parent may hold CUDA and torch's thread pools
            procs = (ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1
                     else contextlib.nullcontext())
            with procs:
                for k, start in enumerate(todo, 1):
                    sl = slice(start, min(start + cls.CHUNK, clips))
                    jobs = [(pool[int(i)], int(s)) for i, s in zip(idx[sl], seeds[sl])]
                    rendered = list(procs.map(_render, jobs, chunksize=16)) if workers > 1 else [_render(j) for j in jobs]
                    frames = _frames_tensor(rendered)
                    z = torch.cat([encode(vae, frames[j:j + 16]) for j in range(0, len(frames), 16)]).half().cpu()
                    mask = latent_mask(torch.from_numpy(np.stack([c.alpha for c in rendered])), z.shape[-1])
                    _atomic_save(folder / f"chunk-{start // cls.CHUNK:04d}.pt", {"latents": z, "masks": mask})
                    encoded += len(frames)
                    rate = (time.time() - t0) / encoded
                    log(f"[pool] chunk {k}/{len(todo)}: {rate * 1000:.0f} ms/clip, eta {(left - encoded) * rate / 60:.0f}min")
        chunks = [torch.load(folder / f"chunk-{i // cls.CHUNK:04d}.pt", weights_only=True, map_location="cpu") for i in starts]
        return cls(torch.cat([c["latents"] for c in chunks]), torch.cat([c["masks"] for c in chunks]),
                   torch.from_numpy(idx), split, tilt)


def _render(job: tuple[shapes.Spec, int]) -> shapes.Clip:
    return shapes.render(*job)


def pool_specs(split: shapes.Split, tilt: float) -> list[shapes.Spec]:
    """The specs a pool's clips index: the split's, then (with ``tilt`` > 0) the tilts'."""
    return shapes.split_specs(split) + (shapes.tilt_specs() if tilt else [])


def _atomic_save(path: Path, obj) -> None:
    with replacing(path) as tmp:  # a kill mid-save leaves no half chunk
        torch.save(obj, tmp)


class PoolData(ShapesData):
    """An endless, seeded stream of batches of latents from a :class:`LatentPool` (uniform over
    its clips), each with a cleaned caption in a random language and its attribute labels."""

    def __init__(self, clean: Clean, seed: int, pool: LatentPool, languages: tuple[str, ...] = ("en", "zh")):
        super().__init__(clean, seed, pool.split, languages)
        self.latent_pool = pool

    def latents(self, n: int, reverse: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, list[str], torch.Tensor]:
        """(latents (n, C, T, h, w) float32, shape masks (n, T, h, w) float32, cleaned captions,
        labels (n, 5)).

        With ``reverse`` > 0, each clip is played backwards with that probability, captioned
        with its reversed spec (``shapes.reversed_spec``: the motion and the pan swap), when
        the grammar has words for it and the reversed combination is not held out. The VAE
        encodes frames one by one, so the reversed latents are the latents of the reversed
        clip. (0 draws nothing extra: the stream stays what it was.)"""
        rows = self.rng.integers(0, len(self.latent_pool), n)
        specs = [self.latent_pool.specs[int(self.latent_pool.spec_index[r])] for r in rows]
        flip = [False] * n
        if reverse > 0:
            for i, s in enumerate(specs):
                back = shapes.reversed_spec(s)
                if self.rng.random() < reverse and back is not None and not shapes.is_held_out(back):
                    specs[i], flip[i] = back, True
        langs = [self.languages[int(self.rng.integers(len(self.languages)))] for _ in rows]
        caps = [self.cleaned(shapes.caption(s, lang)) for s, lang in zip(specs, langs)]  # type: ignore[arg-type]
        labels = torch.tensor([labels_of(s) for s in specs])
        pick = torch.from_numpy(rows)
        z, mask = self.latent_pool.latents[pick].float(), self.latent_pool.masks[pick].float()
        if any(flip):
            f = torch.tensor(flip)
            z[f], mask[f] = z[f].flip(2), mask[f].flip(1)
        return z, mask, caps, labels
