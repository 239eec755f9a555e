"""Training batches from the shapes world, with cleaned captions and attribute labels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .. import shapes

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
    """The spec's attribute indices, in ``shapes.ATTRIBUTES`` order."""
    return [shapes.VOCAB[a].index(getattr(spec, a)) for a in shapes.ATTRIBUTES]


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
        frames = torch.from_numpy(np.stack([c.frames for c in clips])).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0
        alpha = torch.from_numpy(np.stack([c.alpha for c in clips]))
        return Batch(frames, alpha, [c for _, c in pairs], labels, specs)
