"""The batch-finished callback: a JSON summary POSTed to the batch's ``--notify`` URL (or its ad
template's ``notify``), signed with HMAC-SHA256, retried with backoff, sent once per batch.

The body is the summary (:func:`summary`: counts of jobs and ads, and each ad with its files);
the header ``X-Clipmill-Signature: sha256=<hex>`` is the HMAC-SHA256 of the exact body bytes
with the secret from ``CLIPMILL_NOTIFY_SECRET``, so the receiver can check it came from us and
was not changed. Retry policy is data (:class:`RetryPolicy`). A batch is notified once: the
``batches.notified_at`` compare-and-set decides who sends; a delivery that fails every try
is recorded (``notify_error``), never raised into rendering.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import and_, func, or_, select, update

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Ad, Batch, Job
from clipmill.jobs.core.queue import now

log = logging.getLogger("clipmill.notify")
SIGNATURE_HEADER = "X-Clipmill-Signature"
OPEN_JOBS = ("queued", "rendering", "post")
OPEN_ADS = ("waiting", "assembling")


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` tries in all, the n-th retry ``backoff * factor**(n-1)`` seconds after the one
    before (capped at ``max_delay``), each try given ``timeout`` seconds. A 2xx answer is done; a
    4xx other than 408 and 429 is final (the receiver refuses the request, and will again)."""

    attempts: int = 5
    backoff: float = 1.0
    factor: float = 2.0
    max_delay: float = 30.0
    timeout: float = 10.0

    def delays(self) -> list[float]:
        return [min(self.max_delay, self.backoff * self.factor**i) for i in range(self.attempts - 1)]


def sign(body: bytes, secret: str) -> str:
    """``sha256=`` and the hex HMAC-SHA256 of ``body`` with ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def finished(db: Database, batch_id: str) -> bool:
    """Whether nothing of the batch is open: no job queued, rendering or in post, no ad waiting
    or assembling."""
    with db.session() as s:
        jobs = s.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id, Job.state.in_(OPEN_JOBS)))
        ads = s.scalar(select(func.count()).select_from(Ad).where(Ad.batch_id == batch_id, Ad.state.in_(OPEN_ADS)))
    return not jobs and not ads


SENDING = "sending"  # notify_error while a worker is sending the callback (None once sent, else why not)
SENDING_STALE_S = 300  # a send taken this long ago and still marked sending: its worker died; sent again


def not_sent():
    """The SQL condition of a batch whose callback nobody sent: never taken, or taken by a
    worker that died while sending it (still marked ``sending`` after ``SENDING_STALE_S``, far
    longer than the retry policy's tries and waits)."""
    return or_(Batch.notified_at.is_(None), and_(Batch.notify_error == SENDING,
                                                 Batch.notified_at < now() - timedelta(seconds=SENDING_STALE_S)))


def due(db: Database, batch_id: str) -> str | None:
    """The batch's callback URL when its callback is due: it has one, nobody has sent it (or its
    sender died), and the batch is finished; else None."""
    with db.session() as s:
        url = s.scalar(select(Batch.notify_url).where(Batch.id == batch_id, not_sent()))
    return url if url and finished(db, batch_id) else None


def summary(db: Database, batch_id: str) -> dict:
    """What the callback says: the batch, its counts of jobs and ads by state, and each ad with
    its files (each format's location, bytes, seconds and SHA-256)."""
    with db.session() as s:
        batch = s.get(Batch, batch_id)
        jobs = dict(s.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id).group_by(Job.state)).all())
        ads = s.scalars(select(Ad).where(Ad.batch_id == batch_id).order_by(Ad.id)).all()
    ad_states: dict[str, int] = {}
    for a in ads:
        ad_states[a.state] = ad_states.get(a.state, 0) + 1
    return {
        "event": "batch.finished",
        "batch": batch_id,
        "source": batch.source if batch else None,
        "counts": {"jobs": jobs, "ads": ad_states},
        "ads": [{"ad": a.id, "id": a.client_id, "line": a.line, "state": a.state, "values": a.values,
                 "error": a.error.splitlines()[-1] if a.error else None,
                 "files": {name: {k: f.get(k) for k in ("location", "bytes", "seconds", "sha256", "width", "height")}
                           for name, f in ((a.outputs or {}).get("formats") or {}).items()}} for a in ads],
        "sent_at": now().isoformat(),
    }


def post(url: str, payload: dict, secret: str | None, policy: RetryPolicy = RetryPolicy(),
         sleep=time.sleep) -> dict:
    """POST ``payload`` as JSON, signed when there is a secret, with ``policy``'s retries.
    Returns {ok, status, tries, error}; never raises for the receiver's failures."""
    body = json.dumps(payload, ensure_ascii=False, sort_keys=True).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "clipmill-notify"}
    if secret:
        headers[SIGNATURE_HEADER] = sign(body, secret)
    delays = policy.delays()
    status, error = None, None
    for n in range(policy.attempts):
        try:
            req = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=policy.timeout) as resp:
                status = resp.status
            return {"ok": True, "status": status, "tries": n + 1, "error": None}
        except urllib.error.HTTPError as e:
            status, error = e.code, f"HTTP {e.code} {e.reason}"
            if 400 <= e.code < 500 and e.code not in (408, 429):
                return {"ok": False, "status": status, "tries": n + 1, "error": error}
        except (urllib.error.URLError, OSError) as e:
            status, error = None, f"{e.__class__.__name__}: {getattr(e, 'reason', e)}"
        if n < len(delays):
            log.warning("notify %s: try %s failed (%s); again in %.1f s", url, n + 1, error, delays[n])
            sleep(delays[n])
    return {"ok": False, "status": status, "tries": policy.attempts, "error": error}


def notify_once(db: Database, batch_id: str, secret: str | None, policy: RetryPolicy = RetryPolicy()) -> dict | None:
    """Send the batch's callback if it has a URL, it is finished, and nobody sent it yet (a
    compare-and-set on ``notified_at``; a send whose worker died is taken again after
    ``SENDING_STALE_S``). Returns the delivery result, or None when there was nothing to send."""
    url = due(db, batch_id)
    if url is None:
        return None
    with db.session() as s, s.begin():  # marked sending until the tries end: a worker killed meanwhile is seen
        took = s.execute(update(Batch).where(Batch.id == batch_id, not_sent())
                         .values(notified_at=now(), notify_error=SENDING)).rowcount
    if not took:
        return None
    result = post(url, summary(db, batch_id), secret, policy)
    with db.session() as s, s.begin():
        s.execute(update(Batch).where(Batch.id == batch_id).values(
            notify_error=None if result["ok"] else f"{result['error']} after {result['tries']} tries"))
    (log.info if result["ok"] else log.error)("notify %s for batch %s: %s", url, batch_id, result)
    return result
