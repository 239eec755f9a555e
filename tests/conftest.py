"""Shared fixtures: a tiny-model cache, and real SQLite / PostgreSQL databases.

A test that needs PostgreSQL fails in CI (CI=true) when the server is missing, and skips with
a message naming it elsewhere, so `make test` still passes on a laptop without one.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid

import pytest

from services import CJK_FONT, IN_CI

REDIS = ("127.0.0.1", 6379)
PG_URL = os.environ.get("CLIPMILL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


# The fast tier (`make test-fast`, `pytest --fast`): no servers, no browser, no worker
# processes, under 2 minutes on 2 cores. It leaves out every test that uses one of these
# fixtures, the PostgreSQL half of the SQLite/PostgreSQL pairs, and tests marked `slow`.
SERVICE_FIXTURES = {"pg_url", "broker", "farm", "s3", "server", "batch"}


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast tier: no PostgreSQL, Redis, S3, browser or worker processes; no slow tests")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a test of more than a few seconds; left out of the fast tier")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        uses_pg = params is not None and params.params.get("db_url") == "postgresql"
        if SERVICE_FIXTURES & set(item.fixturenames) or uses_pg or item.get_closest_marker("slow") \
                or item.get_closest_marker("load"):
            drop.append(item)
        else:
            keep.append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


def need_service(name: str, error: Exception) -> None:
    msg = f"{name} is not reachable ({error.__class__.__name__}: {error})"
    if IN_CI:
        pytest.fail(f"{msg}; CI must provide it", pytrace=False)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def cjk_font():
    """The Chinese font of examples/ad/*.toml (fonts-wqy-microhei, which .ci/run installs)."""
    if not CJK_FONT.exists():
        msg = f"the Chinese font {CJK_FONT} is not installed (Debian: fonts-wqy-microhei)"
        if IN_CI:
            pytest.fail(f"{msg}; .ci/run installs it", pytrace=False)
        pytest.skip(msg)
    return CJK_FONT


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    """One tiny model for the whole session, built through save_pretrained/from_pretrained."""
    cache = os.environ.get("CLIPMILL_TEST_CACHE") or str(tmp_path_factory.mktemp("cache"))
    os.environ["CLIPMILL_CACHE"] = cache
    # run/submit/prompts render with 'tiny' unless a test passes --model: their assertions are
    # about the job table and the stages, and tiny's frames and sizes are what they check;
    # the built-in shapes model (the users' default) has tests of its own (test_shapes_model, test_train)
    os.environ["CLIPMILL_MODEL"] = "tiny"
    return cache


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'clipmill.db'}"


@pytest.fixture
def pg_url():
    """A fresh schema in the local PostgreSQL `test` database, dropped afterwards."""
    import sqlalchemy as sa

    schema = f"t_{uuid.uuid4().hex[:10]}"
    try:
        admin = sa.create_engine(PG_URL)
        with admin.begin() as c:
            c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    except Exception as e:  # noqa: BLE001 - any connection failure means the service is missing
        need_service(f"PostgreSQL at {PG_URL}", e)
    sep = "&" if "?" in PG_URL else "?"
    yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    with admin.begin() as c:
        c.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request):
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def db(db_url):
    from clipmill.jobs.core.db import Database

    d = Database(db_url)
    yield d
    d.dispose()


@pytest.fixture
def broker():
    """A Redis database of its own, emptied before and after."""
    import redis

    n = random.randint(1, 15)
    r = redis.Redis(*REDIS, db=n)
    try:
        r.ping()
    except Exception as e:  # noqa: BLE001
        need_service(f"Redis at {REDIS[0]}:{REDIS[1]}", e)
    r.flushdb()
    yield f"redis://{REDIS[0]}:{REDIS[1]}/{n}"
    r.flushdb()


@pytest.fixture
def farm(pg_url, broker, tmp_path, tiny_cache):
    """A farm on this machine: ``(env, start, cli, db)``: start a ``clipmill worker`` with
    ``start(*args)``, run a CLI command with ``cli(*args)``; the job table ``db`` on PostgreSQL."""
    # one torch/OpenCV thread per process: render and post workers share 2 CI cores
    env = dict(os.environ, CLIPMILL_DATABASE_URL=pg_url, CLIPMILL_BROKER_URL=broker, CLIPMILL_DEVICE="cpu",
               OMP_NUM_THREADS="1")
    procs: list[subprocess.Popen] = []

    def start(*args, extra_env=None):
        log = open(tmp_path / f"worker-{len(procs)}.log", "w")
        p = subprocess.Popen([sys.executable, "-m", "clipmill.jobs.cli", "worker", *args, "--loglevel", "INFO"],
                             env=dict(env, **(extra_env or {})), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    def cli(*args, extra_env=None, check=True):
        proc = subprocess.run([sys.executable, "-m", "clipmill.jobs.cli", *args], env=dict(env, **(extra_env or {})),
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    from clipmill.jobs.core.db import Database
    from services import stop

    db = Database(pg_url)
    yield env, start, cli, db
    for p in procs:
        stop(p)
    db.dispose()


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs at tmp_path/small: a disk that fills after a few writes (mount needs root,
    CAP_SYS_ADMIN; the test skips, naming why, where it is not allowed)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 64 KiB tmpfs to fill a disk (needs root with CAP_SYS_ADMIN): "
                    f"{(proc.stderr or proc.stdout).strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
