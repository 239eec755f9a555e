"""Draws: a clip whose prompt can be read back is rendered again, with the next seed, until it
reads as asked.

A shapes-world model's clips can be checked against their prompts (``qc.adherence``, the
world's analyzer). The render stage reads each such clip as soon as it is rendered (the raw
frames, milliseconds a clip), and a clip that shows something other than its prompt asks on
any attribute (a shape moving down when "moves up" was asked, say) is rendered again from the
next seed of a fixed sequence, up to ``draws`` renders in all. A draw counts as right only when
it reads right *clearly* (``qc.adherence.clear``: its shape's travel and its camera's drift
clear the world's stated minimums by a margin), so that a reader drawing its boundaries
elsewhere agrees with it. The first such draw is kept; when none is, the one clear on the most
attributes, then right on the most (the earliest of equals). Clips of any other model, or with
prompts outside the grammar, are rendered once.

This is selection, not a better model: the model's own adherence is what one draw reads
(``clipmill bench --adherence`` reports both). The draw sequence is a pure function of the
attempt's seed, so rendering an attempt twice keeps the same clip, and the seed a kept clip was
drawn from renders that clip again with one draw.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from clipmill.jobs.core.defaults import DEFAULT_DRAWS, MAX_DRAWS
from clipmill.pipeline import shapes
from clipmill.pipeline.render import ClipRequest, ClipResult, GroupSettings, Renderer
from clipmill.qc.adherence import analyze, clear, matches

log = logging.getLogger("clipmill.draws")


def check_draws(value: int, name: str = "draws") -> int:
    """``value`` as a draw count, or a ValueError naming ``name``, the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DRAWS:
        raise ValueError(f"{name}={value!r}: renders a clip may take until it reads as its prompt asks; "
                         f"allowed: a whole number from 1 (every clip rendered once) to {MAX_DRAWS}")
    return value


def draw_seed(seed: int, draw: int) -> int:
    """The seed of draw ``draw`` (0 is the attempt's own seed; later ones derived from it)."""
    if draw == 0:
        return int(seed)
    digest = hashlib.sha256(f"{int(seed)}:draw:{draw}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass
class Drawn:
    """What the draws of one clip found: the kept result, its seed, and every draw's reading."""

    result: ClipResult
    seed: int
    draws: int = 1  # renders this clip took
    # per draw: {"seed", "match": {attribute: read right}, "clear": {attribute: read right clearly}};
    # both None when the analyzer failed on it
    reads: list[dict] = field(default_factory=list)
    render_s: float = 0.0  # render seconds of all its draws (the kept one's own are in its timings)

    @property
    def extra_s(self) -> float:
        """Render seconds spent on the draws that were not kept."""
        return max(self.render_s - self.result.timings.get("render_s", 0.0), 0.0)


def checkable(renderer: Renderer, prompt: str) -> shapes.Spec | None:
    """The spec a clip of ``prompt`` can be read against: a shapes-world model and a prompt in
    its grammar; None otherwise."""
    if renderer.info.world != "shapes":
        return None
    return shapes.parse(prompt)


def render_drawing(
    renderer: Renderer,
    requests: Sequence[ClipRequest],
    settings: GroupSettings,
    draws: int = DEFAULT_DRAWS,
    callback: Callable[[int, int], None] | None = None,
) -> list[Drawn]:
    """Render ``requests`` as one group, then draw again (as a group) the clips that do not read
    as asked, up to ``draws`` renders a clip; one :class:`Drawn` per request, in order."""
    check_draws(draws)
    specs = [checkable(renderer, r.prompt) if draws > 1 else None for r in requests]
    kept: list[Drawn] = []
    right: list[tuple[int, int]] = []  # (clearly right, right) attributes of the kept draw; (-1, -1): not checked
    done = (len(shapes.ATTRIBUTES), len(shapes.ATTRIBUTES))
    # 1. the first draw: every clip, from its own seed
    for req, res, spec in zip(requests, renderer.render(requests, settings, callback), specs):
        kept.append(Drawn(res, req.seed, render_s=res.timings.get("render_s", 0.0)))
        right.append(_read(kept[-1], res, req.seed, spec) if spec is not None else (-1, -1))
    todo = [i for i, spec in enumerate(specs) if spec is not None and right[i] < done]
    # 2. later draws: the clips still reading wrong, each from the next seed of its sequence
    for d in range(1, draws):
        if not todo:
            break
        again = [replace(requests[i], seed=draw_seed(requests[i].seed, d)) for i in todo]
        try:
            results = renderer.render(again, settings, callback)
        except Exception as e:  # noqa: BLE001 - every clip has a draw already: keep those, draw no more
            log.warning("draws: drawing %s clip(s) again failed (%s: %s); the draws so far are kept", len(again),
                        e.__class__.__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
            break
        for i, req, res in zip(todo, again, results):
            k = kept[i]
            k.draws += 1
            k.render_s += res.timings.get("render_s", 0.0)
            n = _read(k, res, req.seed, specs[i])
            if n > right[i]:  # strictly more: the earliest of equals stays
                right[i], k.result, k.seed = n, res, req.seed
        todo = [i for i in todo if right[i] < done]
    return kept


def _read(drawn: Drawn, result: ClipResult, seed: int, spec: shapes.Spec) -> tuple[int, int]:
    """Read one draw against its spec, record it, and return how many attributes it gets right
    clearly and how many right ((0, 0) when the analyzer fails on it: such a draw is kept only
    if no other is read)."""
    try:
        a = analyze(result.frames)
    except Exception as e:  # noqa: BLE001 - a draw the analyzer cannot read counts as read wrong
        log.warning("draws: the analyzer failed on a draw of %r (seed %s): %s", spec, seed, e)
        drawn.reads.append({"seed": seed, "match": None, "clear": None})
        return (0, 0)
    match = matches(a, spec)
    sure = clear(a, spec)
    drawn.reads.append({"seed": seed, "match": match, "clear": sure})
    return (sum(sure.values()), sum(match.values()))
