"""Every `Example:` line in every command's --help runs as written.

The examples are collected by walking the click command tree, so a new example is run (or
this test fails, asking where it belongs in ORDER). They run in one temporary folder with a
copy of examples/, against a SQLite job table there, in the order below, so later examples
find what earlier ones made (the batch `ad-batch-20261129-210000` is submitted first, from
examples/ad-batch.csv). Nothing in a command is swapped, except the broker host `queue` of
the farm examples, which is a private redis-server on loopback here.

- Commands that serve until stopped (review, preview, worker, beat) run until their first output.
- Measurements and training that take minutes (qc --bench, interpolate --bench, bench,
  train-model) run for a few
  seconds and must still be running cleanly (or have finished with 0).
- An example for a GPU (`--device cuda`) must refuse at once with exit 3 where there is none.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from clipmill.jobs.cli import main
from services import CJK_FONT, IN_CI, free_port, stop, wait_port

REPO = Path(__file__).resolve().parent.parent
BATCH = "ad-batch-20261129-210000"
NEEDS_CJK = (" --ad examples/ad/", "bench --assembly")  # examples that draw an ad template's texts

# Where each example runs, by prefix (first match wins); every example must match one.
ORDER = [
    "clipmill run examples/",
    "clipmill run --resume",
    "clipmill status",
    "clipmill prompts check",
    "clipmill qc clipmill-out/",
    "clipmill qc clip.mp4",
    "clipmill interpolate clip24.mp4",
    "clipmill export",
    "clipmill nightly",
    "clipmill submit",
    "clipmill retry",
    "clipmill cancel",
    "CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill reconcile",
    "clipmill review",
    "clipmill preview",
    "CLIPMILL_BROKER_URL=redis://queue:6379/0 clipmill worker",
    "CLIPMILL_BROKER_URL=redis://queue:6379/0 CLIPMILL_NIGHTLY_AT=21:00 clipmill beat",
    "clipmill qc --bench",
    "clipmill interpolate --bench",
    "clipmill bench",
    "clipmill train-model",
]
SERVE = {"clipmill review": "review at http://", "clipmill preview": "preview at http://", "clipmill worker": " ready.",
         "clipmill beat": "beat: "}
LONG = ("clipmill qc --bench", "clipmill interpolate --bench", "clipmill bench", "clipmill train-model")


def help_examples(cmd: click.Command, name: str = "clipmill") -> list[str]:
    """The example lines of ``cmd``'s help and of every subcommand's, depth first."""
    found = []
    lines = (cmd.help or "").splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Example:":
            for ex in lines[i + 1:]:
                if not ex.strip() or ex.strip() == "\b":
                    break
                found.append(ex.strip())
    if isinstance(cmd, click.Group):
        for sub_name, sub in cmd.commands.items():
            found += help_examples(sub, f"{name} {sub_name}")
    return list(dict.fromkeys(found))


def rank(example: str) -> int:
    for i, prefix in enumerate(ORDER):
        if example.startswith(prefix):
            return i
    raise AssertionError(f"example {example!r} is not in ORDER: say where it runs in tests/test_cli_examples.py")


def test_every_example_is_collected_and_placed():
    examples = help_examples(main)
    assert "clipmill run --resume ad-batch-20261129-210000" in examples
    assert len(examples) >= 25
    for ex in examples:
        assert ex.startswith(("clipmill ", "CLIPMILL_")), ex
        rank(ex)


@pytest.fixture
def redis_url():
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_port(port, proc)
    yield f"redis://127.0.0.1:{port}/0"
    stop(proc)


@pytest.fixture
def s3_endpoint():
    exe = shutil.which(os.path.join(os.path.dirname(sys.executable), "moto_server"))
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_port(port, proc)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


def serve_until(command: str, marker: str, env: dict, cwd: Path, timeout: float = 90) -> str:
    """Start ``command`` in a shell, wait for ``marker`` in its output, stop it; its output."""
    log = cwd / f".serve-{time.monotonic_ns()}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and marker not in log.read_text() and proc.poll() is None:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seen = log.read_text()
    log.unlink()
    assert marker in seen, f"{command!r}: no {marker!r} within {timeout} s:\n{seen[-3000:]}"
    assert "Traceback" not in seen, seen[-3000:]
    return seen


def still_running_cleanly(command: str, env: dict, cwd: Path, seconds: float = 8) -> None:
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=seconds)
        assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{out[-3000:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        assert "Traceback" not in out and "Error" not in out, f"{command!r}:\n{out[-3000:]}"


@pytest.mark.slow
def test_help_examples_run_as_written(tmp_path, monkeypatch, redis_url, s3_endpoint):
    import torch

    from clipmill.jobs.core.db import Database
    from clipmill.jobs.core.models import Job
    from clipmill.jobs.review.decisions import decide
    from clipmill.pipeline.synthetic import camera_move, photo
    from clipmill.pipeline.video import encode_h264

    work = tmp_path / "work"
    shutil.copytree(REPO / "examples", work / "examples")
    db_url = f"sqlite:///{work / 'clipmill.db'}"
    monkeypatch.chdir(work)
    for k in [k for k in os.environ if k.startswith("CLIPMILL_") and k != "CLIPMILL_CACHE"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CLIPMILL_DATABASE_URL", db_url)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1")

    def invoke(example: str, extra_env: dict | None = None) -> str:
        """Run one example in process: shell words, leading VAR=value words, globs."""
        words = shlex.split(example)
        run_env = dict(extra_env or {})
        while "=" in words[0] and words[0].split("=")[0].isupper():
            k, _, v = words.pop(0).partition("=")
            run_env[k] = v
        assert words.pop(0) == "clipmill"
        args = [m for w in words for m in (sorted(glob.glob(w)) if any(c in w for c in "*?[") else [w])]
        res = CliRunner().invoke(main, args, env=run_env, catch_exceptions=False)
        assert res.exit_code == 0, f"{example!r} exited {res.exit_code}:\n{res.output[-3000:]}"
        return res.output

    # the batch the examples name, and small files the file examples name
    invoke(f"clipmill submit examples/ad-batch.csv --template '{{dish}} on a table in {{store}}, {{camera}}' "
           f"--batch {BATCH} --size 64 --frames 8 --max-attempts 1")
    encode_h264(camera_move(photo("coffee"), "pan", 12, (64, 64), __import__("numpy").random.default_rng(0)), 24,
                work / "clip24.mp4")
    db = Database(db_url)
    ran = []
    for example in sorted(help_examples(main), key=rank):
        t0 = time.perf_counter()
        if example.startswith("clipmill qc clip.mp4"):
            shutil.copy(sorted(glob.glob("clipmill-out/*/*/a1.mp4"))[0], "clip.mp4")
        if example.startswith("clipmill export"):
            with db.session() as s:  # an operator approves one clip of the batch first
                job = s.query(Job).filter(Job.batch_id == BATCH, Job.state.in_(("passed", "rejected", "approved"))
                                          ).order_by(Job.id).first()
            if job.state != "approved":
                decide(db, job.id, job.version, "approve", "", "tester")
        if "s3://" in example:
            if s3_endpoint is None:
                continue  # moto_server (moto[server], in .[dev]) is not installed: tests/test_s3.py skips too
            import boto3

            creds = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                     "CLIPMILL_S3_ENDPOINT": s3_endpoint}
            for k, v in creds.items():
                monkeypatch.setenv(k, v)
            boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=re.search(r"s3://([^/]+)", example)[1])
            out = invoke(example)
            assert "1 approved clip(s): 1 copied, 0 already there" in out
            ran.append(example)
            continue
        if any(p in example for p in NEEDS_CJK) and not CJK_FONT.exists():
            assert not IN_CI, f"{CJK_FONT} is missing: .ci/run installs fonts-wqy-microhei"
            print(f"skipped: {example} (the Chinese font {CJK_FONT} is not installed; tests/test_ads.py skips too)")
            continue
        command = example
        if "redis://queue:6379/0" in example:
            if redis_url is None:
                continue  # no redis-server here: the farm tests skip too
            command = example.replace("redis://queue:6379/0", redis_url)
        serving = next((m for p, m in SERVE.items() if p in example), None)
        if " --gpu " in example and not torch.cuda.is_available():  # a GPU worker without its GPU: refused
            res = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=120)
            assert res.returncode == 3 and "torch sees no CUDA device" in res.stderr, res.stderr
        elif serving:
            serve_until(command, serving, dict(env, CLIPMILL_DATABASE_URL=db_url), work)
        elif "--device cuda" in example and not torch.cuda.is_available():
            res = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=120)
            assert res.returncode == 3 and "Error: --device cuda: " in res.stderr, res.stderr
        elif example == "clipmill train-model --export-teacher":  # an empty checkpoint folder: says so
            res = subprocess.run(["bash", "-c", command], cwd=work, env=dict(env, CLIPMILL_TRAIN_DIR=str(work / "train")),
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 2 and "the teacher has no checkpoint yet" in res.stderr, res.stderr
        elif example.startswith(LONG):  # train-model's checkpoints go under tmp_path, not ~/.cache
            for scratch in ("/tmp/smoke", "/tmp/distil", "/tmp/shapes"):
                command = command.replace(scratch, str(work / Path(scratch).name))
            still_running_cleanly(command,
                                  dict(env, CLIPMILL_TRAIN_DIR=str(work / "train")), work)
        else:
            out = invoke(command)
            if example.startswith("clipmill run --resume"):
                assert f"batch {BATCH}: jobs done 8/8" in out
        ran.append(example)
        print(f"{time.perf_counter() - t0:6.1f} s  {example}")
    db.dispose()
    assert len(ran) >= 20, ran
