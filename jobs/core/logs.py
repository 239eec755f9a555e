"""Logging: plain text for people, or one JSON object per line for log pipelines; records
about a clip carry its batch, job and attempt ids."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

ID_FIELDS = ("batch", "job", "attempt", "group", "worker")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k in ID_FIELDS:
            if hasattr(record, k):
                out[k] = getattr(record, k)
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ids = " ".join(f"{k}={getattr(record, k)}" for k in ID_FIELDS if hasattr(record, k))
        base = f"{record.levelname} {record.name}: {record.getMessage()}"
        return f"{base} [{ids}]" if ids else base


def setup(level: int, as_json: bool = False) -> None:
    """Log at ``level`` to stderr, as text or JSON lines (the CLI's --log-json / CLIPMILL_LOG_JSON)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("alembic", "urllib3", "botocore", "boto3", "s3transfer", "httpx", "PIL", "matplotlib"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def ids(job=None, attempt=None, batch=None, **more) -> dict:
    """``extra=`` for a log call about a clip."""
    d = {"batch": batch or (job.batch_id if job is not None else None),
         "job": job.id if job is not None else None,
         "attempt": attempt.number if attempt is not None else None, **more}
    return {k: v for k, v in d.items() if v is not None}
