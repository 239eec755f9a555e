"""Streaming previews in farm mode: one queue for preview and batch work.

The review server sends one ``clipmill.preview`` message (the session id, nothing else) to the
``preview`` queue at the broker's top priority. A render worker consumes ``preview`` before
``render`` (``clipmill worker --queues render``; ``--queues preview`` starts one for previews
alone), so it takes a waiting preview between two groups: it streams the session on its warm
model (``jobs.review.preview.Session``: Stream Batch and the frame-time scheduler, with the tiny
decoder and no feature cache for the time of the preview), paces the frames at the budget and
puts them into Redis, and the review server relays them to the page.

Redis keys, all under ``clipmill:preview:SID``:

- ``SID`` (hash): what the page asked for (prompt, seed, model, budget) and where it stands
  (state waiting / starting / streaming / ended, the worker, why it ended). The page's steering writes the
  prompt here; the worker reads it before every frame. Every frame and every steer renews its
  expiry, and a steer never writes into a hash that has expired (it would live for ever).
- ``SID:alive``: the page's heartbeat, refreshed by the review server while the page is open
  and gone ``ALIVE_S`` seconds after it stops. No heartbeat, no stream: a worker that finds it
  missing (the page closed while the message waited, or since) ends the preview at once and is
  free for its next group.
- ``SID:frames`` (stream): the frames, JPEG and their JSON line, the last ``KEEP_FRAMES`` kept.

A message delivered twice streams once (the first worker to claim the hash's ``worker`` field
serves it; the second does nothing). The message is acked when it starts: a worker that dies
mid-preview does not get it back an hour later, when nobody is watching; the page says the
stream ended.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import replace

import redis
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from clipmill.jobs.core.db import Database
from clipmill.jobs.farm.app import app
from clipmill.jobs.farm.dispatch import BrokerDown, send_render
from clipmill.jobs.review.preview import (PreviewError, Seen, SessionTable, check_prompt, check_seed, jpeg, new_id,
                                          new_session, payload, queue_once, record_end, record_open, record_start,
                                          record_unserved)
from clipmill.pipeline.pacing import Pacer

log = logging.getLogger("clipmill.preview")

PREFIX = "clipmill:preview:"
ALIVE_S = 3.0  # the heartbeat's lifetime: the server refreshes it at least every 0.5 s
KEEP_FRAMES = 32
KEEP_S = 3600  # the session's keys expire this long after their last write
TOP = 0  # the Redis transport serves priority 0 first (farm.dispatch.broker_priority)
PAGE_GONE = "its page was gone before a render worker took it (its review server stopped or it closed)"
# the prompt into the session's hash with its expiry renewed, in one step; nothing if it expired
STEER = """if redis.call('exists', KEYS[1]) == 0 then return 0 end
redis.call('hset', KEYS[1], 'prompt', ARGV[1])
redis.call('expire', KEYS[1], ARGV[2])
return 1"""


class Channel:
    """One preview's keys in Redis (see the module); both sides use it."""

    def __init__(self, r: redis.Redis, sid: str):
        self.r, self.sid = r, sid
        self.key = PREFIX + sid
        self.alive_key, self.frames_key = self.key + ":alive", self.key + ":frames"

    # -- the review server's side --------------------------------------------------------------
    def create(self, prompt: str, seed: int, model: str, budget_s: float) -> None:
        with self.r.pipeline() as p:
            p.hset(self.key, mapping={"prompt": prompt, "seed": seed, "model": model, "budget_s": budget_s,
                                      "state": "waiting", "requested": time.time()})
            p.expire(self.key, KEEP_S)
            p.set(self.alive_key, 1, px=int(ALIVE_S * 1000))
            p.execute()

    def heartbeat(self) -> None:
        self.r.set(self.alive_key, 1, px=int(ALIVE_S * 1000))

    def steer(self, prompt: str) -> bool:
        """Steer the stream to ``prompt``; False when the session's hash has expired."""
        return bool(self.r.eval(STEER, 1, self.key, prompt, KEEP_S))

    def read(self, after: str, block_ms: int) -> tuple[str, dict] | None:
        """The frame after stream id ``after`` (waiting up to ``block_ms`` for it): its id and fields."""
        got = self.r.xread({self.frames_key: after}, count=1, block=block_ms)
        return next(((i.decode(), f) for _, entries in got for i, f in entries), None)

    def info(self) -> dict:
        return {k.decode(): v.decode() for k, v in self.r.hgetall(self.key).items()}

    def close(self) -> None:
        """The page went away: the worker sees no heartbeat and stops."""
        with self.r.pipeline() as p:
            p.delete(self.alive_key)
            p.expire(self.frames_key, 60)
            p.execute()

    # -- the worker's side ---------------------------------------------------------------------
    def claim(self, worker: str) -> str | None:
        """Take the preview for ``worker``: None, or why not (PAGE_GONE, or another worker has it)."""
        if not self.r.exists(self.alive_key):
            return PAGE_GONE
        if not self.r.hsetnx(self.key, "worker", worker):
            return "another render worker has it"
        self.r.hset(self.key, "state", "starting")  # loading the model, filling the window
        return None

    def streaming(self) -> None:
        self.r.hset(self.key, "state", "streaming")

    def poll(self) -> tuple[bool, str | None]:
        """(the page is still there, its prompt now)."""
        with self.r.pipeline() as p:
            p.exists(self.alive_key)
            p.hget(self.key, "prompt")
            alive, prompt = p.execute()
        return bool(alive), prompt.decode() if prompt is not None else None

    def publish(self, jpeg_bytes: bytes, meta: dict) -> None:
        with self.r.pipeline() as p:
            p.xadd(self.frames_key, {"jpeg": jpeg_bytes, "meta": json.dumps(meta)}, maxlen=KEEP_FRAMES,
                   approximate=True)
            p.expire(self.frames_key, KEEP_S)
            p.expire(self.key, KEEP_S)  # a stream may outlive KEEP_S: its hash lives as long (no-op once gone)
            p.execute()

    def end(self, why: str, error: bool = False) -> None:
        with self.r.pipeline() as p:
            p.hset(self.key, mapping={"state": "ended", "ended": why, "error": int(error)})
            p.expire(self.key, 60)
            p.expire(self.frames_key, 60)
            p.execute()


def client(broker_url: str) -> redis.Redis:
    return redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=3)


def serve(ctx, r: redis.Redis, sid: str, worker: str, max_s: float) -> dict:
    """Stream preview ``sid`` on this worker until its page goes away, ``max_s`` seconds pass
    (0: no limit) or the stream fails; the worker's model is left as it was. What the render
    worker's ``clipmill.preview`` task runs."""
    ch = Channel(r, sid)
    refused = ch.claim(worker)
    if refused is not None:
        # its page went while it waited (a review server killed then left its row open): no
        # worker started it, so no end would come; a started row is its worker's to end
        if refused == PAGE_GONE and record_unserved(ctx.db, sid, PAGE_GONE):
            ch.end(PAGE_GONE)
        log.info("preview %s: %s; nothing to stream", sid, refused)
        return {"served": False}
    record_start(ctx.db, sid, worker)
    why, error, frames = "the page closed", False, 0
    try:
        frames, why = _stream(ctx, ch, ch.info(), worker, max_s)
    except Exception as e:  # noqa: BLE001 - the page is told, the worker goes on with its groups
        log.exception("preview %s failed", sid)
        why, error = f"{e.__class__.__name__}: {e}", True
    record_end(ctx.db, sid, frames, why)  # first: the nightly scheduler counts a row with no end as preview time
    try:
        ch.end(why, error)
    except RedisError as e:  # the page's keys expire by themselves
        log.warning("preview %s: could not tell the page it ended (%s)", sid, e)
    log.info("preview %s: %s frames; ended: %s", sid, frames, why)
    return {"served": True, "frames": frames, "ended": why}


class StreamFailed(RuntimeError):
    pass


def _stream(ctx, ch: Channel, spec: dict, worker: str, max_s: float) -> tuple[int, str]:
    """The preview's loop on the worker: (frames sent, why it ended)."""
    renderer = ctx.renderer(spec["model"])
    budget = float(spec["budget_s"])
    # the stream calls the UNet itself: the tiny decoder when the model has one, no feature cache
    opts = replace(renderer.options, feature_cache=False, decoder="tiny" if renderer.info.has_tiny_vae else "vae")
    limit = max_s if max_s > 0 else math.inf
    with renderer.using(opts):
        session = new_session(renderer, spec["prompt"], int(spec["seed"]), budget, ch.sid)
        prompt, why = spec["prompt"], "the page closed"
        t0, pacer, seen = time.perf_counter(), Pacer(budget), Seen(ctx.db, ch.sid)
        try:  # from the first write on: a failing one still closes the session (its thread and hooks)
            ch.streaming()
            while True:
                seen()  # its row's seen_at: a worker that dies stops counting as preview time soon after
                alive, asked = ch.poll()
                if not alive:
                    break
                if time.perf_counter() - t0 > limit:
                    why = f"its time on a render worker is up ({max_s:g} s, CLIPMILL_PREVIEW_MAX)"
                    break
                if asked and asked != prompt:
                    session.steer(asked)
                    prompt = asked
                f, info = session.next_frame(timeout=0.2)
                if f is None:
                    if "error" in info:
                        raise StreamFailed(info["error"])
                    continue
                # paced here, at the budget; the review server relays them as they come
                pacer.wait()
                ch.publish(jpeg(f.image), {"index": f.index, "prompt": f.prompt, **info, "worker": worker})
        finally:
            session.close()
    return session.frames, why


def send_preview(sid: str) -> None:
    try:
        app.send_task("clipmill.preview", (sid,), queue="preview", priority=TOP, retry=False)
    except (KombuError, RedisError, OSError) as e:
        raise BrokerDown(str(e) or e.__class__.__name__) from e


class FarmSession:
    """The review server's end of a farm preview: relays its frames from Redis to the page."""

    WAIT_NOTICE_S = 1.0
    STALL_S = 15.0  # streaming, but no frame for this long: its worker is gone

    def __init__(self, ch: Channel, prompt: str, seed: int):
        self.ch, self.id, self.seed = ch, ch.sid, seed
        self.prompt, self.frames, self.closed = prompt, 0, False
        self.queued: dict | None = None  # what "Queue this" made of it (queue_once)
        self.queue_lock = threading.Lock()
        self.last = "0-0"
        self.meta: dict = {}
        self.opened = self.last_frame = time.monotonic()
        self._noticed = 0.0
        self._streaming: float | None = None

    def next_payload(self, timeout: float = 0.5) -> tuple[dict | None, dict]:
        """The next frame as the page's ``frame`` event, or None and why not: ``waiting`` (no
        render worker has taken it yet, at most once a second) or ``error`` (it ended)."""
        try:
            self.ch.heartbeat()
            got = self.ch.read(self.last, int(timeout * 1000))
            info = {} if got else self.ch.info()
        except RedisError as e:
            return None, {"error": f"the broker is unreachable ({e}); the preview's frames come through it"}
        if got:
            self.last, fields = got
            meta = json.loads(fields[b"meta"])
            self.frames += 1
            self.meta, self.last_frame = meta, time.monotonic()
            return payload(meta.pop("index"), meta.pop("prompt"), fields[b"jpeg"], meta), {}
        state = info.get("state")
        if state == "ended" or not info:
            return None, {"error": f"the preview ended on its render worker: {info.get('ended', 'its keys expired')}"}
        if state == "streaming" and self._streaming is None:
            self._streaming = time.monotonic()
        if state == "streaming" and time.monotonic() - max(self.last_frame, self._streaming) > self.STALL_S:
            return None, {"error": f"no frame from its render worker ({info.get('worker')}) for {self.STALL_S:.0f} s: "
                                   "the worker stopped; press Stream to start again"}
        if state in ("waiting", "starting") and time.monotonic() - self._noticed >= self.WAIT_NOTICE_S:
            self._noticed = time.monotonic()
            waited = time.monotonic() - self.opened
            if state == "starting":
                return None, {"waiting": f"render worker {info.get('worker')} is starting the stream ({waited:.0f} s)"}
            return None, {"waiting": f"waiting {waited:.0f} s for a render worker "
                                     "(they take previews first, between groups)"}
        return None, {}

    def describe(self) -> dict:
        return {"session": self.id, "prompt": self.prompt, "frames": self.frames, "steps": self.meta.get("steps"),
                "tier": self.meta.get("tier"), "worker": self.meta.get("worker")}


class FarmPreviews(SessionTable):
    """The review server's previews in farm mode: each page's stream runs on a render worker
    (see the module). Same interface as ``jobs.review.preview.Previews``."""

    pace_s = 0.0  # the worker paces the frames

    def __init__(self, broker_url: str, db: Database, model: str, out: str, budget_s: float = 0.125):
        self.r = client(broker_url)
        self.db, self.model, self.out, self.budget_s = db, model, out, budget_s
        self.sessions: dict[str, FarmSession] = {}
        self._lock = threading.Lock()

    def open(self, prompt: str, seed: int = 0) -> FarmSession:
        prompt, seed = check_prompt(prompt), check_seed(seed)
        sid = new_id()
        ch = Channel(self.r, sid)
        recorded = False
        try:
            ch.create(prompt, seed, self.model, self.budget_s)
            record_open(self.db, sid, self.model, "farm")
            recorded = True
            send_preview(sid)
        except (BrokerDown, RedisError, OSError) as e:
            if recorded:  # no worker will take it: its row ends here, not counted as preview time all night
                record_end(self.db, sid, 0, f"never sent: the broker is unreachable ({e})")
            raise PreviewError(f"the broker is unreachable ({e}); the preview needs a render worker through it")
        session = FarmSession(ch, prompt, seed)
        with self._lock:
            self.sessions[sid] = session
        return session

    def close(self, sid: str, why: str = "the page closed") -> None:
        with self._lock:
            s = self.sessions.pop(sid, None)
        if s is not None and not s.closed:
            s.closed = True
            try:
                s.ch.close()
                never_started = s.ch.info().get("state", "waiting") == "waiting"
            except RedisError as e:  # the heartbeat expires by itself within ALIVE_S
                log.warning("preview %s: could not tell the worker the page closed (%s)", sid, e)
                never_started = False
            if never_started:  # no worker will record its end: record it here
                record_end(self.db, sid, 0, f"{why} before a render worker took it")

    def steer(self, sid: str, prompt: str) -> dict:
        s = self.get(sid)
        prompt = check_prompt(prompt)
        try:
            kept = s.ch.steer(prompt)
        except RedisError as e:
            raise PreviewError(f"preview {sid}: the broker is unreachable ({e}); the prompt was not sent")
        if not kept:
            raise PreviewError(f"preview {sid}: its session expired on the broker (after {KEEP_S} s without a "
                               "frame or a steer); press Stream to start again")
        s.prompt = prompt
        return {"session": sid, "prompt": s.prompt}

    def queue(self, db: Database, sid: str, tier: str) -> dict:
        """Queue the session's prompt, with its seed and ``tier``, as a one-job batch, and send
        it to the render queue."""
        res, made = queue_once(db, self.get(sid), tier, self.model, self.out)
        if not made:
            return res
        try:
            send_render(db, res["jobs"])
        except BrokerDown as e:
            res["note"] = f"queued, but the broker is unreachable ({e}): clipmill reconcile sends it once it is back"
        return res
