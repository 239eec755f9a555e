"""The deploy files parse and agree with the CLI they start."""

from __future__ import annotations

from pathlib import Path

import yaml

from jobs.cli import main

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_compose_file_parses_and_starts_real_commands():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "postgres", "post", "reconcile", "review", "flower"} <= set(services)
    renders = {k: v for k, v in services.items() if k.startswith("render-gpu")}
    assert renders
    gpus = []
    for name, svc in renders.items():
        assert svc["command"][:3] == ["worker", "--queues", "render"]
        gpu = svc["command"][svc["command"].index("--gpu") + 1]
        devices = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert devices["device_ids"] == [gpu] and "gpu" in devices["capabilities"]
        gpus.append(gpu)
    assert len(set(gpus)) == len(gpus)  # one worker per GPU
    commands = set(main.commands)
    for name, svc in services.items():
        cmd = svc.get("command")
        if cmd and name not in ("redis",):
            assert cmd[0] in commands, (name, cmd)
        if name not in ("redis", "postgres"):
            env = svc["environment"]
            assert env["CLIPMILL_DATABASE_URL"].startswith("postgresql+psycopg://")
            assert env["CLIPMILL_BROKER_URL"].startswith("redis://redis:6379")
    assert services["review"]["command"][services["review"]["command"].index("--host") + 1] == "0.0.0.0"
    assert "CLIPMILL_REVIEW_TOKEN=" in (DEPLOY / ".env.example").read_text()  # review refuses 0.0.0.0 without it


def test_systemd_units_start_real_commands():
    for unit in (DEPLOY / "systemd").glob("*.service"):
        text = unit.read_text()
        line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
        args = line.split("clipmill ", 1)[1].split()
        assert args[0] in main.commands, unit.name
    assert "--gpu %i" in (DEPLOY / "systemd" / "clipmill-render@.service").read_text()
