"""A bounded LRU cache of prompt embeddings, across jobs.

Ad batches repeat templates and negative prompts, so the text encoder runs once per distinct
prompt and every later job with that prompt reuses the embedding. Embeddings are exact functions
of the prompt text and the model's weights, so this cache holds no per-job state; it belongs to
one loaded model and is dropped with it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch


class PromptEmbeddingCache:
    """``get(prompts, encode)`` returns one embedding row per prompt, encoding only the misses."""

    def __init__(self, maxsize: int = 256):
        if maxsize < 1:
            raise ValueError(f"PromptEmbeddingCache: maxsize={maxsize}; it must be at least 1")
        self.maxsize = maxsize
        self._rows: OrderedDict[tuple[str, str], torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, prompts: Sequence[str], encode: Callable[[list[str]], torch.Tensor], variant: str = "") -> torch.Tensor:
        """Embeddings of ``prompts``, shape (len(prompts), ...) as ``encode`` gives them (tokens,
        dim; or frames, tokens, dim). ``encode(list)`` runs the text encoder on the distinct
        prompts not cached, in one call. ``variant`` names how they are encoded (a model with
        frame markers encodes a prompt once per frame count): a prompt's rows are kept per variant."""
        missing = list(dict.fromkeys(p for p in prompts if (variant, p) not in self._rows))
        if missing:
            rows = encode(missing)
            for p, row in zip(missing, rows):
                self._rows[(variant, p)] = row.unsqueeze(0).clone()  # its own storage, so eviction frees it
                self._rows.move_to_end((variant, p))
        self.misses += len(missing)
        self.hits += len(prompts) - len(missing)
        out = []
        for p in prompts:
            self._rows.move_to_end((variant, p))
            out.append(self._rows[(variant, p)])
        while len(self._rows) > self.maxsize:
            self._rows.popitem(last=False)
        return torch.cat(out)

    def clear(self) -> None:
        """Drop every row and zero the hit and miss counts."""
        self._rows.clear()
        self.hits = self.misses = 0
