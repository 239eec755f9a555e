"""Exact text K/V cache for cross-attention.

Cross-attention keys and values are projections of the text embedding, which does not change
across denoising steps. This cache computes them once per generation and reuses them at every
step. It is exact: the same projections, computed once instead of once per step.

- **UNet (AnimateDiff).** The pipeline repeats each prompt's embedding once per frame, so a
  plain cross-attention projects the same text ``frames`` times per step. With ``bind`` the
  caller says which rows are repeats of which prompt; the cache projects each distinct prompt
  once and lets all of its frames' queries attend to that one K/V set (the attention of every
  query row is independent, so this is the same computation without the copies).
- **DiT (Wan).** The transformer projects the text embedding (``condition_embedder.text_embedder``)
  inside every forward. A hook caches that projection per input tensor, so every step hands the
  same tensor to the cross-attention layers, whose K/V are then cached per layer.

Entries are keyed by the text context, so cond and uncond contexts (or the one-time negative of
R-CFG) have separate entries. ``reset()`` drops every entry and must be called when a
generation ends; ``Renderer`` does so in a ``finally``. ``remove()`` restores the original
processors and hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers.hooks import ModelHook

HOOK_NAME = "clipmill_text_kv"


@dataclass
class TextKVStats:
    """Work done and avoided since the last ``reset_stats``: K/V projections of one text row each."""

    projected: int = 0  # rows actually projected through to_k and to_v
    avoided: int = 0  # rows a plain cross-attention would have projected but the cache did not

    def as_dict(self) -> dict:
        return {"kv_rows_projected": self.projected, "kv_rows_avoided": self.avoided}


@dataclass
class _Part:
    label: str
    unique: torch.Tensor  # (rows, tokens, dim): one row per distinct prompt
    repeats: int  # rows of the call tensor per unique row (frames for AnimateDiff)


@dataclass
class _Context:
    tensor: torch.Tensor  # the call tensor itself, kept alive so its id cannot be reused
    parts: list[_Part] = field(default_factory=list)


class TextKVCache:
    """Install with ``TextKVCache(model)``; ``bind`` contexts per generation; ``reset`` after it."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.stats = TextKVStats()
        self._contexts: dict[int, _Context] = {}
        self._kv: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # k, v, source
        self._originals: dict[torch.nn.Module, object] = {}
        self._text_embedder = None
        self._hook: _TextProjectionHook | None = None
        cross = [m for m in model.modules() if _is_cross_attention(m)]
        if not cross:
            raise ValueError(f"TextKVCache: {type(model).__name__} has no cross-attention layers to cache")
        for i, m in enumerate(cross):
            self._originals[m] = m.processor
            if type(m).__name__ == "WanAttention":
                m.set_processor(_WanCachedProcessor(self, i, getattr(m.processor, "_attention_backend", None)))
            else:
                m.set_processor(_UNetCachedProcessor(self, i))
        embedder = getattr(getattr(model, "condition_embedder", None), "text_embedder", None)
        if embedder is not None:
            from diffusers.hooks import HookRegistry

            self._hook = _TextProjectionHook(self)
            HookRegistry.check_if_exists_or_initialize(embedder).register_hook(self._hook, HOOK_NAME)
            self._text_embedder = embedder

    # -- per generation -------------------------------------------------------------------------
    def bind(self, tensor: torch.Tensor, parts: list[tuple[str, torch.Tensor, int]]) -> None:
        """Declare that ``tensor`` (the ``encoder_hidden_states`` passed to the model) is the
        concatenation, along the batch, of ``parts``: ``(label, unique_rows, repeats)`` each, whose
        rows are ``unique_rows.repeat_interleave(repeats, 0)``. Labels name the entries
        (``"uncond"``, ``"cond"``); an entry is shared only by parts with the same label and the
        same ``unique_rows`` tensor (R-CFG's one-time negative pass and the later cond-only
        passes share the cond entry). A context can be bound once per generation."""
        if id(tensor) in self._contexts and self._contexts[id(tensor)].tensor is tensor:
            raise ValueError("TextKVCache.bind: this context is already bound; reset() first")
        rows = sum(p.shape[0] * r for _, p, r in parts)
        if rows != tensor.shape[0]:
            raise ValueError(f"TextKVCache.bind: parts cover {rows} rows but the context has {tensor.shape[0]}")
        self._contexts[id(tensor)] = _Context(tensor, [_Part(lbl, p, r) for lbl, p, r in parts])

    def reset(self) -> None:
        """Forget every context and K/V entry (call when a generation ends)."""
        self._contexts.clear()
        self._kv.clear()
        if self._hook is not None:
            self._hook._seen.clear()

    def remove(self) -> None:
        """Restore the model's own processors and remove the hook."""
        self.reset()
        for m, proc in self._originals.items():
            m.set_processor(proc)
        self._originals.clear()
        if self._text_embedder is not None:
            self._text_embedder._diffusers_hook.remove_hook(HOOK_NAME, recurse=False)
            self._text_embedder = None

    @property
    def entries(self) -> int:
        return len(self._kv)

    # -- used by the processors -----------------------------------------------------------------
    @torch.compiler.disable
    def context(self, tensor: torch.Tensor) -> _Context:
        ctx = self._contexts.get(id(tensor))
        if ctx is None or ctx.tensor is not tensor:
            # An unbound context: cache it whole (no de-duplication), by identity.
            ctx = _Context(tensor, [_Part(f"ctx{id(tensor)}", tensor, 1)])
            self._contexts[id(tensor)] = ctx
        return ctx

    @torch.compiler.disable  # bookkeeping on Python state: outside compiled graphs, no recompiles
    def kv(self, layer: int, part: _Part, project) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer, part.label, id(part.unique))
        hit = self._kv.get(key)
        if hit is None or hit[2] is not part.unique:  # the source is kept: an id is never reused while cached
            k, v = project(part.unique)
            hit = (k, v, part.unique)
            self._kv[key] = hit
            self.stats.projected += part.unique.shape[0]
            self.stats.avoided += part.unique.shape[0] * (part.repeats - 1)
        else:
            self.stats.avoided += part.unique.shape[0] * part.repeats
        return hit[0], hit[1]


def _is_cross_attention(m: torch.nn.Module) -> bool:
    return type(m).__name__ in ("Attention", "WanAttention") and bool(getattr(m, "is_cross_attention", False))


class _TextProjectionHook(ModelHook):
    """Caches ``text_embedder(x)`` per input tensor, so every step sees the same projected tensor."""

    _is_stateful = True

    def __init__(self, cache: TextKVCache):
        super().__init__()
        self.cache = cache
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def deinitalize_hook(self, module):
        self._seen.clear()
        return module

    def new_forward(self, module, x, *args, **kwargs):
        hit = self._seen.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        out = self.fn_ref.original_forward(x, *args, **kwargs)
        self._seen[id(x)] = (x, out)
        self.cache.context(out)  # register the projection so the cache keeps it (and its id) alive
        return out

    def reset_state(self, module):
        self._seen.clear()
        return module


class _UNetCachedProcessor:
    """AttnProcessor2_0 for cross-attention, with K/V from the cache and one K/V set per prompt."""

    def __init__(self, cache: TextKVCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kw):
        if encoder_hidden_states is None or attention_mask is not None or attn.spatial_norm is not None:
            raise ValueError("TextKVCache: this cross-attention layer takes masks or spatial norms, which it does not support")
        residual = hidden_states
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)  # (rows, N, inner)
        heads = attn.heads
        head_dim = query.shape[-1] // heads

        def project(text: torch.Tensor):
            if attn.norm_cross:
                text = attn.norm_encoder_hidden_states(text)
            k = attn.to_k(text).view(text.shape[0], -1, heads, head_dim).transpose(1, 2)
            v = attn.to_v(text).view(text.shape[0], -1, heads, head_dim).transpose(1, 2)
            if attn.norm_k is not None:
                k = attn.norm_k(k)
            return k, v

        ctx = self.cache.context(encoder_hidden_states)
        outs, row = [], 0
        for part in ctx.parts:
            k, v = self.cache.kv(self.layer, part, project)
            n_rows = part.unique.shape[0] * part.repeats
            q = query[row : row + n_rows]
            row += n_rows
            # every query row of a prompt's frames attends to that prompt's one K/V set
            q = q.reshape(part.unique.shape[0], part.repeats * q.shape[1], heads, head_dim).transpose(1, 2)
            if attn.norm_q is not None:
                q = attn.norm_q(q)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
            outs.append(o.transpose(1, 2).reshape(n_rows, -1, heads * head_dim))
        hidden_states = (outs[0] if len(outs) == 1 else torch.cat(outs)).to(query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class _WanCachedProcessor:
    """WanAttnProcessor for text-to-video cross-attention, with normed K and V from the cache."""

    def __init__(self, cache: TextKVCache, layer: int, backend=None):
        self.cache, self.layer, self.backend = cache, layer, backend

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if attn.add_k_proj is not None or encoder_hidden_states is None:
            raise ValueError("TextKVCache: image-to-video cross-attention is not supported")
        heads = attn.heads
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (heads, -1))

        def project(text: torch.Tensor):
            k = attn.norm_k(attn.to_k(text)).unflatten(2, (heads, -1))
            v = attn.to_v(text).unflatten(2, (heads, -1))
            return k, v

        ctx = self.cache.context(encoder_hidden_states)
        if len(ctx.parts) != 1 or ctx.parts[0].repeats != 1:
            raise ValueError("TextKVCache: Wan contexts are cached whole; bind them with one part, repeats=1")
        key, value = self.cache.kv(self.layer, ctx.parts[0], project)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self.backend)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))
