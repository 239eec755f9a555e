"""Helpers for tests: real servers on loopback (free ports, waiting, stopping), and the hooks left on a model."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
CJK_FONT = Path("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc")  # the font of examples/ad/*.toml (conftest: cjk_font)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen | None = None, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"server exited with {proc.returncode}: {out}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def need_program(path_or_name: str, what: str) -> str:
    found = shutil.which(path_or_name)
    if not found:
        msg = f"{what} ({path_or_name}) is not installed"
        if IN_CI:
            pytest.fail(f"{msg}; CI must provide it", pytrace=False)
        pytest.skip(msg)
    return found


def hooks_on(model) -> list[str]:
    """Every torch forward hook and diffusers hook left on ``model`` or its submodules."""
    found = []
    for name, m in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks"):
            found += [f"{name or 'model'}.{kind}"] * len(getattr(m, kind))
        registry = getattr(m, "_diffusers_hook", None)
        if registry is not None and registry.hooks:
            found += [f"{name or 'model'}: {h}" for h in registry.hooks]
    return found
