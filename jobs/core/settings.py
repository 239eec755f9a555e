"""The settings of the runner and the farm, read from the environment in this one place and typed.

``Settings.from_env()`` reads and checks them all at once; a bad value is an error naming the
variable, its value and what is allowed. The Celery app and the workers are handed a
``Settings``. Variables that stand for a command-line option are also that option's default
(click's ``envvar``: ``CLIPMILL_OUT``, ``CLIPMILL_QC_CONFIG``, ``CLIPMILL_DRAWS``, the render-speed
ones, ``CLIPMILL_MODEL``, ``CLIPMILL_LOG_JSON``, ``CLIPMILL_REVIEW_TOKEN``); outside this table,
``CLIPMILL_MODEL`` also names the review server's preview model (``jobs/cli/review.py``) and
``CLIPMILL_TRAIN_DIR`` the training checkpoints (``jobs/cli/train.py``).

| variable | meaning | default |
|---|---|---|
| CLIPMILL_DATABASE_URL | the job table | sqlite:///clipmill.db |
| CLIPMILL_BROKER_URL | farm mode's Redis broker; unset: embedded | unset |
| CLIPMILL_OUT | storage root (folder or s3://bucket/prefix) | clipmill-out |
| CLIPMILL_DEVICE | a worker's torch device | cuda if available, else cpu |
| CLIPMILL_GROUP_SIZE | jobs per render call on a render worker | 4 |
| CLIPMILL_FEATURE_CACHE | 1: DeepCache / FirstBlockCache on workers | 0 |
| CLIPMILL_DECODER | vae or tiny | vae |
| CLIPMILL_COMPILE | none, torch or tensorrt | none |
| CLIPMILL_GUIDANCE_MODE | cfg, rcfg-self or rcfg-onetime | cfg |
| CLIPMILL_DRAWS | renders a clip of a shapes-world model may take until it reads as asked (1-16; 1: off) | 8 |
| CLIPMILL_VISIBILITY_TIMEOUT | seconds before Redis redelivers an unacked message | 14400 |
| CLIPMILL_TIMEZONE | the zone of times of day (nightly deadline, beat) | this host's |
| CLIPMILL_RECONCILE_EVERY | beat: seconds between reconciles (0: off) | 60 |
| CLIPMILL_RECONCILE_STALE | seconds after which a sent job is sent again | 600 |
| CLIPMILL_NIGHTLY_AT | beat: HH:MM to start the nightly run | unset |
| CLIPMILL_NIGHTLY_DEADLINE | beat: HH:MM the nightly run drains the queue by | 07:00 |
| CLIPMILL_QC_CONFIG | a TOML file of QC thresholds: post workers', and run's default --qc-config | unset |
| CLIPMILL_NOTIFY_SECRET | the HMAC-SHA256 key that signs --notify callbacks | unset (unsigned) |
| CLIPMILL_PREVIEW_MAX | seconds a preview streams (on a render worker, or in the review server) before it ends (0: no limit) | 900 |
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo

from sqlalchemy.engine import make_url

from clipmill.jobs.core.defaults import DEFAULT_DRAWS, MAX_DRAWS
from clipmill.pipeline.choices import COMPILERS, DECODERS, GUIDANCE_MODES

DEFAULT_DATABASE_URL = "sqlite:///clipmill.db"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class SettingsError(ValueError):
    """An environment variable with a value clipmill cannot use."""


def time_of_day(name: str, text: str) -> tuple[int, int]:
    """``HH:MM`` as (hour, minute); ``name`` is what the error message calls it."""
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if not m or int(m.group(1)) > 23 or int(m.group(2)) > 59:
        raise SettingsError(f"{name}={text!r}: not a time of day; expected HH:MM, e.g. 21:00")
    return int(m.group(1)), int(m.group(2))


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:  # nan turned a limit off; inf overflowed its users
        raise SettingsError(f"{name}={text!r}: expected a number of seconds, 0 or more")
    return value


def _broker_url(url: str | None) -> str | None:
    """CLIPMILL_BROKER_URL, if set, a redis:// URL that parses (a bad one raised in kombu, mid-command)."""
    if not url:
        return None
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as e:
        raise SettingsError(f"CLIPMILL_BROKER_URL={redact_url(url)!r}: not a URL ({e}); expected redis://HOST:6379/0")
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise SettingsError(f"CLIPMILL_BROKER_URL={redact_url(url)!r}: expected redis://HOST:6379/0 (or rediss://)")
    return url


def _int(name: str, text: str, lo: int, hi: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise SettingsError(f"{name}={text!r}: expected an integer from {lo} to {hi}")
    return value


def _flag(name: str, text: str) -> bool:
    v = text.strip().lower()
    if v not in _TRUE + _FALSE:
        raise SettingsError(f"{name}={text!r}: allowed: 0 or 1")
    return v in _TRUE


def _choice(name: str, text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise SettingsError(f"{name}={text!r}: allowed: {', '.join(allowed)}")
    return text


def redact_url(url: str) -> str:
    """``url`` with its password, if any, shown as ``***``: what may be printed or logged."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy parses (a broker URL, say)
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def local_timezone() -> str:
    """This host's IANA zone name, or UTC when none is configured."""
    try:
        from tzlocal import get_localzone_name

        return get_localzone_name() or "UTC"
    except Exception:  # noqa: BLE001 - no zone configured on this host
        return "UTC"


@dataclass(frozen=True)
class Settings:
    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str | None = None
    out: str = "clipmill-out"
    device: str | None = None  # None: cuda if available, else cpu
    group_size: int = 4
    feature_cache: bool = False
    decoder: str = "vae"
    compile: str = "none"
    guidance_mode: str = "cfg"
    draws: int = DEFAULT_DRAWS
    visibility_timeout_s: int = 4 * 3600  # longer than any render
    timezone: str = "UTC"
    reconcile_every_s: float = 60.0
    reconcile_stale_s: float = 600.0
    nightly_at: tuple[int, int] | None = None
    nightly_deadline: str = "07:00"
    qc_config: str | None = None  # a TOML file of QC thresholds: a post worker's, and the default --qc-config
    notify_secret: str | None = None  # signs the batch-finished callbacks (core.notify)
    preview_max_s: float = 900.0  # a preview (farm or embedded) ends after this long (a page left open overnight)

    @property
    def farm(self) -> bool:
        return self.broker_url is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read and check every CLIPMILL_* variable (see the module's table)."""
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name)
            return value if value not in (None, "") else None

        nightly_at = get("CLIPMILL_NIGHTLY_AT")
        deadline = get("CLIPMILL_NIGHTLY_DEADLINE") or "07:00"
        time_of_day("CLIPMILL_NIGHTLY_DEADLINE", deadline)
        zone = get("CLIPMILL_TIMEZONE") or local_timezone()
        try:
            ZoneInfo(zone)
        except Exception:  # noqa: BLE001 - ZoneInfoNotFoundError, ValueError
            raise SettingsError(f"CLIPMILL_TIMEZONE={zone!r}: not a time zone name; expected e.g. Europe/Paris or UTC")
        return cls(
            database_url=get("CLIPMILL_DATABASE_URL") or DEFAULT_DATABASE_URL,
            broker_url=_broker_url(get("CLIPMILL_BROKER_URL")),
            out=get("CLIPMILL_OUT") or "clipmill-out",
            device=get("CLIPMILL_DEVICE"),
            group_size=_int("CLIPMILL_GROUP_SIZE", get("CLIPMILL_GROUP_SIZE") or "4", 1, 16),
            feature_cache=_flag("CLIPMILL_FEATURE_CACHE", get("CLIPMILL_FEATURE_CACHE") or "0"),
            decoder=_choice("CLIPMILL_DECODER", get("CLIPMILL_DECODER") or "vae", DECODERS),
            compile=_choice("CLIPMILL_COMPILE", get("CLIPMILL_COMPILE") or "none", COMPILERS),
            guidance_mode=_choice("CLIPMILL_GUIDANCE_MODE", get("CLIPMILL_GUIDANCE_MODE") or "cfg", GUIDANCE_MODES),
            draws=_int("CLIPMILL_DRAWS", get("CLIPMILL_DRAWS") or str(DEFAULT_DRAWS), 1, MAX_DRAWS),
            visibility_timeout_s=_int("CLIPMILL_VISIBILITY_TIMEOUT", get("CLIPMILL_VISIBILITY_TIMEOUT") or str(4 * 3600),
                                      60, 7 * 24 * 3600),
            timezone=zone,
            reconcile_every_s=_seconds("CLIPMILL_RECONCILE_EVERY", get("CLIPMILL_RECONCILE_EVERY") or "60"),
            reconcile_stale_s=_seconds("CLIPMILL_RECONCILE_STALE", get("CLIPMILL_RECONCILE_STALE") or "600"),
            nightly_at=time_of_day("CLIPMILL_NIGHTLY_AT", nightly_at) if nightly_at else None,
            nightly_deadline=deadline,
            qc_config=_qc_file(get("CLIPMILL_QC_CONFIG")),
            notify_secret=get("CLIPMILL_NOTIFY_SECRET"),
            preview_max_s=_seconds("CLIPMILL_PREVIEW_MAX", get("CLIPMILL_PREVIEW_MAX") or "900"),
        )


def _qc_file(path: str | None) -> str | None:
    """CLIPMILL_QC_CONFIG: a readable file (its keys are checked when it is loaded)."""
    if path is not None and not os.path.isfile(path):
        raise SettingsError(f"CLIPMILL_QC_CONFIG={path!r}: no such file; expected a TOML file of QC thresholds")
    return path
