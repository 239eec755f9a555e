"""The Celery application for a farm of workers (Redis broker, JSON messages of ids only).

Farm mode is on when ``CLIPMILL_BROKER_URL`` is set (for example ``redis://host:6379/0``);
without it, clipmill runs embedded and never touches a broker.

The app is built from :class:`~clipmill.jobs.core.settings.Settings` by :func:`make_app`. This
module is the farm's entry point (``clipmill worker``, ``clipmill beat``, ``celery -A
clipmill.jobs.farm.app flower``), so it builds ``app`` from the environment's settings once,
when it is first imported. ``clipmill beat`` (one per farm) sends :func:`beat_schedule`.
"""

from __future__ import annotations

from celery import Celery
from celery.schedules import crontab

from clipmill.jobs.core.settings import Settings


def beat_schedule(settings: Settings) -> dict:
    """The periodic tasks:

    - ``clipmill.reconcile`` every ``reconcile_every_s`` seconds (0 turns it off), sending again
      jobs whose message is older than ``reconcile_stale_s``;
    - with ``nightly_at``, ``clipmill.nightly`` every day at that time of day, draining the
      queue by ``nightly_deadline``.

    Times of day are in ``settings.timezone``, the one zone of every clipmill time of day.
    """
    schedule: dict = {}
    every = settings.reconcile_every_s
    if every:
        schedule["reconcile"] = {
            "task": "clipmill.reconcile",
            "schedule": every,
            "kwargs": {"stale_s": settings.reconcile_stale_s},
            "options": {"expires": max(every, 5.0)},  # a late one is superseded by the next
        }
    if settings.nightly_at is not None:
        hour, minute = settings.nightly_at
        schedule["nightly"] = {
            "task": "clipmill.nightly",
            "schedule": crontab(hour=hour, minute=minute),
            "kwargs": {"deadline": settings.nightly_deadline},
            # picked up more than an hour late (no worker was up), it would run to the next day's deadline
            "options": {"expires": 3600},
        }
    return schedule


def make_app(settings: Settings) -> Celery:
    """A Celery app for ``settings``, with the clipmill tasks registered."""
    app = Celery("clipmill", broker=settings.broker_url or "redis://127.0.0.1:6379/0",
                 include=["clipmill.jobs.farm.tasks"])
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
            "visibility_timeout": settings.visibility_timeout_s,
            # Redis has no native message priorities: kombu keeps one list per step and serves
            # step 0 first. Its default steps (0, 3, 6, 9) would merge neighbouring priorities,
            # so use all ten (farm.dispatch.broker_priority maps a job's priority onto them).
            "priority_steps": list(range(10)),
            "queue_order_strategy": "priority",  # a worker on several queues serves them in order
        },
        # the periodic tasks are CPU work and short, but for nightly, which holds one post thread
        # until its deadline
        task_routes={
            "clipmill.render": {"queue": "render"},
            "clipmill.preview": {"queue": "preview"},  # render workers serve it first, between groups
            "clipmill.post": {"queue": "post"},
            "clipmill.assemble": {"queue": "post"},
            "clipmill.notify": {"queue": "post"},
            "clipmill.reconcile": {"queue": "post"},
            "clipmill.nightly": {"queue": "post"},
        },
        task_default_queue="render",
        broker_connection_timeout=3,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # for Flower
        timezone=settings.timezone,
        beat_schedule=beat_schedule(settings),
    )
    app.clipmill_settings = settings  # what the tasks' worker context is built from
    return app


app = make_app(Settings.from_env())  # raises SettingsError naming a bad variable
