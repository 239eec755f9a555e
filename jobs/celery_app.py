"""The Celery application for a farm of workers (Redis broker, JSON messages of ids only).

Farm mode is on when ``CLIPMILL_BROKER_URL`` is set (for example ``redis://host:6379/0``);
without it, clipmill runs embedded and never touches a broker.
"""

from __future__ import annotations

import os

from celery import Celery

VISIBILITY_TIMEOUT_S = int(os.environ.get("CLIPMILL_VISIBILITY_TIMEOUT", 4 * 3600))  # longer than any render


def broker_url() -> str | None:
    return os.environ.get("CLIPMILL_BROKER_URL") or None


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
    task_routes={"clipmill.render": {"queue": "render"}, "clipmill.post": {"queue": "post"}},
    task_default_queue="render",
    broker_connection_timeout=3,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=True,  # for Flower
)
