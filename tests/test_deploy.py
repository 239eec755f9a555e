"""The deploy files parse and agree with the CLI they start."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from clipmill.jobs.cli import main

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_compose_file_parses_and_starts_real_commands():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "postgres", "post", "beat", "review", "flower"} <= set(services)
    renders = {k: v for k, v in services.items() if k.startswith("render-gpu")}
    assert renders
    gpus = []
    for name, svc in renders.items():
        assert svc["command"][:3] == ["worker", "--queues", "render"]
        # a container given one GPU sees it as CUDA device 0: --gpu 1 there hid it (CPU renders)
        assert svc["command"][svc["command"].index("--gpu") + 1] == "0"
        devices = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert len(devices["device_ids"]) == 1 and "gpu" in devices["capabilities"]
        gpus.append(devices["device_ids"][0])
    assert len(set(gpus)) == len(gpus)  # one worker per host GPU
    commands = set(main.commands)
    for name, svc in services.items():
        cmd = svc.get("command")
        if cmd and name not in ("redis",):
            assert cmd[0] in commands, (name, cmd)
        if name not in ("redis", "postgres"):
            env = svc["environment"]  # another host's URLs from .env win over this host's containers
            assert env["CLIPMILL_DATABASE_URL"].startswith("${CLIPMILL_DATABASE_URL:-postgresql+psycopg://")
            assert env["CLIPMILL_BROKER_URL"] == "${CLIPMILL_BROKER_URL:-redis://redis:6379/0}"
            assert "clipmill:clipmill@" not in env["CLIPMILL_DATABASE_URL"]  # no password in the file
            assert svc["stop_grace_period"] == "20m"  # a render group finishes before the container stops
    assert services["review"]["command"][services["review"]["command"].index("--host") + 1] == "0.0.0.0"
    assert "CLIPMILL_REVIEW_TOKEN=" in (DEPLOY / ".env.example").read_text()  # review refuses 0.0.0.0 without it
    assert services["beat"]["command"][0] == "beat" and "deploy" not in services["beat"]  # one, on no GPU
    assert services["flower"]["entrypoint"][:4] == ["celery", "-A", "clipmill.jobs.farm.app", "flower"]
    assert "FLOWER_BASIC_AUTH=" in (DEPLOY / ".env.example").read_text()  # Flower's port is published
    assert "POSTGRES_PASSWORD=" in (DEPLOY / ".env.example").read_text()
    root = DEPLOY.parent
    assert "deploy/.env" in (root / ".gitignore").read_text().split()  # secrets never committed
    assert {".venv/", "deploy/.env"} <= set((root / ".dockerignore").read_text().split())


def test_beat_schedule_from_the_environment():
    from celery.schedules import crontab

    from clipmill.jobs.core.settings import Settings
    from clipmill.jobs.farm.app import app, beat_schedule as from_settings

    def beat_schedule(env):
        return from_settings(Settings.from_env(env))

    default = beat_schedule({})
    assert list(default) == ["reconcile"]
    assert default["reconcile"]["task"] == "clipmill.reconcile" and default["reconcile"]["schedule"] == 60.0
    assert default["reconcile"]["kwargs"] == {"stale_s": 600.0}
    assert app.conf.beat_schedule["reconcile"]["task"] == "clipmill.reconcile"
    assert beat_schedule({"CLIPMILL_RECONCILE_EVERY": "0"}) == {}
    both = beat_schedule({"CLIPMILL_RECONCILE_EVERY": "30", "CLIPMILL_RECONCILE_STALE": "120",
                          "CLIPMILL_NIGHTLY_AT": "21:00", "CLIPMILL_NIGHTLY_DEADLINE": "06:30"})
    assert both["reconcile"]["schedule"] == 30.0 and both["reconcile"]["kwargs"] == {"stale_s": 120.0}
    assert both["nightly"]["task"] == "clipmill.nightly" and both["nightly"]["kwargs"] == {"deadline": "06:30"}
    assert both["nightly"]["schedule"] == crontab(hour=21, minute=0)
    assert beat_schedule({"CLIPMILL_NIGHTLY_AT": "9:05"})["nightly"]["kwargs"] == {"deadline": "07:00"}
    for bad, text in ((("CLIPMILL_NIGHTLY_AT", "21h"), "CLIPMILL_NIGHTLY_AT='21h': not a time of day"),
                      (("CLIPMILL_NIGHTLY_DEADLINE", "7"), "CLIPMILL_NIGHTLY_DEADLINE='7': not a time of day"),
                      (("CLIPMILL_RECONCILE_EVERY", "-1"), "CLIPMILL_RECONCILE_EVERY='-1': expected a number")):
        env = {"CLIPMILL_NIGHTLY_AT": "21:00", bad[0]: bad[1]}
        try:
            beat_schedule(env)
        except ValueError as e:
            assert str(e).startswith(text), e
        else:
            raise AssertionError(f"{env} accepted")
    # both run on the CPU post workers, never on a GPU worker
    routes = app.conf.task_routes
    assert routes["clipmill.reconcile"]["queue"] == routes["clipmill.nightly"]["queue"] == "post"


def test_systemd_units_start_real_commands():
    for unit in (DEPLOY / "systemd").glob("*.service"):
        text = unit.read_text()
        line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
        args = line.split("clipmill ", 1)[1].split()
        assert args[0] in main.commands, unit.name
    assert "--gpu %i" in (DEPLOY / "systemd" / "clipmill-render@.service").read_text()
    assert "clipmill beat --schedule" in (DEPLOY / "systemd" / "clipmill-beat.service").read_text()


def test_a_render_worker_without_its_gpu_refuses_to_start(monkeypatch):
    """It rendered on the CPU without a word (a compose service handed GPU 1 but told --gpu 1
    saw none: inside the container that GPU is device 0)."""
    import torch
    from click.testing import CliRunner

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: the worker would start")
    monkeypatch.setenv("CLIPMILL_BROKER_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the worker sets it; put back as it was afterwards
    res = CliRunner().invoke(main, ["worker", "--queues", "render", "--gpu", "1"])
    assert res.exit_code == 3
    assert "Error: --gpu 1: torch sees no CUDA device 1 on this host (CUDA_VISIBLE_DEVICES=1)" in res.output
