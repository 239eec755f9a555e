"""The Celery application for a farm of workers (Redis broker, JSON messages of ids only).

Farm mode is on when ``CLIPMILL_BROKER_URL`` is set (for example ``redis://host:6379/0``);
without it, clipmill runs embedded and never touches a broker.

``clipmill beat`` (one per farm) sends the periodic tasks of :func:`beat_schedule`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from celery import Celery
from celery.schedules import crontab

VISIBILITY_TIMEOUT_S = int(os.environ.get("CLIPMILL_VISIBILITY_TIMEOUT", 4 * 3600))  # longer than any render


def broker_url() -> str | None:
    return os.environ.get("CLIPMILL_BROKER_URL") or None


def _time_of_day(name: str, text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if not m or int(m.group(1)) > 23 or int(m.group(2)) > 59:
        raise ValueError(f"{name}={text!r}: not a time of day; expected HH:MM, e.g. 21:00")
    return int(m.group(1)), int(m.group(2))


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected a number of seconds, 0 or more")
    return value


def beat_schedule(env: Mapping[str, str] = os.environ) -> dict:
    """The periodic tasks, from the environment:

    - ``clipmill.reconcile`` every ``CLIPMILL_RECONCILE_EVERY`` seconds (default 60; 0 turns it
      off), sending again jobs whose message is older than ``CLIPMILL_RECONCILE_STALE`` (600);
    - with ``CLIPMILL_NIGHTLY_AT=HH:MM``, ``clipmill.nightly`` every day at that time, draining
      the queue by ``CLIPMILL_NIGHTLY_DEADLINE`` (HH:MM, default 07:00).

    Times of day are in the app's timezone (``CLIPMILL_TIMEZONE``, default this host's).
    """
    schedule: dict = {}
    every = _seconds("CLIPMILL_RECONCILE_EVERY", env.get("CLIPMILL_RECONCILE_EVERY", "60"))
    if every:
        schedule["reconcile"] = {
            "task": "clipmill.reconcile",
            "schedule": every,
            "kwargs": {"stale_s": _seconds("CLIPMILL_RECONCILE_STALE", env.get("CLIPMILL_RECONCILE_STALE", "600"))},
            "options": {"expires": max(every, 5.0)},  # a late one is superseded by the next
        }
    at = env.get("CLIPMILL_NIGHTLY_AT")
    if at:
        hour, minute = _time_of_day("CLIPMILL_NIGHTLY_AT", at)
        deadline = env.get("CLIPMILL_NIGHTLY_DEADLINE", "07:00")
        _time_of_day("CLIPMILL_NIGHTLY_DEADLINE", deadline)
        schedule["nightly"] = {
            "task": "clipmill.nightly",
            "schedule": crontab(hour=hour, minute=minute),
            "kwargs": {"deadline": deadline},
            # picked up more than an hour late (no worker was up), it would run to the next day's deadline
            "options": {"expires": 3600},
        }
    return schedule


def _local_timezone() -> str:
    try:
        from tzlocal import get_localzone_name

        return get_localzone_name() or "UTC"
    except Exception:  # noqa: BLE001 - no zone configured on this host
        return "UTC"


try:
    SCHEDULE, SCHEDULE_ERROR = beat_schedule(), None
except ValueError as e:  # `clipmill beat` reports it; workers do not need the schedule
    SCHEDULE, SCHEDULE_ERROR = {}, e

app = Celery("clipmill", broker=broker_url() or "redis://127.0.0.1:6379/0", include=["jobs.tasks"])
app.conf.update(
    task_serializer="json",
    accept_content=["json"],  # never pickle
    result_serializer="json",
    task_ignore_result=True,
    # long GPU tasks: ack after the work, give the message back if the worker dies, take one at a time
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        # Redis has no native message priorities: kombu keeps one list per step and serves
        # step 0 first. Its default steps (0, 3, 6, 9) would merge neighbouring priorities, so
        # use all ten (jobs.dispatch.broker_priority maps a job's priority onto them).
        "priority_steps": list(range(10)),
        "queue_order_strategy": "priority",  # a worker on several queues serves them in order
    },
    # the periodic tasks are CPU work and short, but for nightly, which holds one post thread
    # until its deadline
    task_routes={
        "clipmill.render": {"queue": "render"},
        "clipmill.post": {"queue": "post"},
        "clipmill.reconcile": {"queue": "post"},
        "clipmill.nightly": {"queue": "post"},
    },
    task_default_queue="render",
    broker_connection_timeout=3,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=True,  # for Flower
    timezone=os.environ.get("CLIPMILL_TIMEZONE") or _local_timezone(),
    beat_schedule=SCHEDULE,
)
