"""Checks that run before any work: option ranges, the device, the model folder and the
storage root. ``clipmill run`` and ``submit`` call them before the job table changes and
before the first render.

Two kinds of error, kept apart from a job's own failure (a render error, a QC reject):

- ``BadOption``: a value given cannot be used (``--fps 0``, ``--device foo``). Bad input.
- ``SetupProblem``: this machine cannot do the work as asked (no CUDA, a model folder whose
  configs do not load, storage that cannot be written, no cloud credentials). The run stops
  once, and jobs stay queued.

Each message is one line naming the option, its value and what is allowed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from clipmill.jobs.core.prompts import MAX_FPS, MIN_FPS, Defaults, parse_size
from clipmill.pipeline.choices import SAMPLERS
from clipmill.pipeline.models import ModelError, ModelInfo, model_info, resolve
from clipmill.storage import StorageError, StorageUnavailable, open_storage

MIN_GUIDANCE, MAX_GUIDANCE = 1.0, 30.0
MIN_ATTEMPTS, MAX_ATTEMPTS = 1, 10
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MIN_GROUP, MAX_GROUP = 1, 16
BATCH_RE = re.compile(r"^(?![0-9]+\Z)[A-Za-z0-9][A-Za-z0-9._-]{0,79}\Z")  # \Z: "$" also matched before a final newline; digits alone would read as a job id
DEVICE_RE = re.compile(r"(cpu|cuda|mps)(?::(\d+))?")
NOTIFY_URL_RE = re.compile(r"^https?://[^\s/]+")  # --notify, and an ad template's notify


class BadOption(ValueError):
    """An option value that cannot be used: bad input."""


class SetupProblem(RuntimeError):
    """The model, device or storage cannot be used on this machine: stop the run, keep the jobs queued."""


def check_submit_options(opts) -> None:
    """The ranges of ``SubmitOptions`` that need no model: fps, guidance, attempts, lost
    attempts, priority, sampler and batch name."""
    d = opts.defaults
    if isinstance(d.fps, bool) or not isinstance(d.fps, int) or not MIN_FPS <= d.fps <= MAX_FPS:
        raise BadOption(f"--fps {d.fps}: out of range; allowed: an integer from {MIN_FPS} to {MAX_FPS}")
    if not MIN_GUIDANCE <= opts.guidance <= MAX_GUIDANCE:  # also refuses nan
        raise BadOption(f"--guidance {opts.guidance:g}: out of range; allowed: {MIN_GUIDANCE:g} (off) to {MAX_GUIDANCE:g}")
    if not MIN_ATTEMPTS <= opts.max_attempts <= MAX_ATTEMPTS:
        raise BadOption(f"--max-attempts {opts.max_attempts}: out of range; allowed: {MIN_ATTEMPTS} to {MAX_ATTEMPTS}")
    if not MIN_ATTEMPTS <= opts.max_lost <= MAX_ATTEMPTS:
        raise BadOption(f"--max-lost {opts.max_lost}: out of range; allowed: {MIN_ATTEMPTS} to {MAX_ATTEMPTS}")
    if not MIN_PRIORITY <= opts.priority <= MAX_PRIORITY:
        raise BadOption(f"--priority {opts.priority}: out of range; allowed: an integer from {MIN_PRIORITY} to "
                        f"{MAX_PRIORITY} (higher goes first)")
    if opts.sampler is not None and opts.sampler not in SAMPLERS:
        raise BadOption(f"--sampler {opts.sampler!r}: not known; allowed: {', '.join(SAMPLERS)}")
    if opts.batch is not None and not BATCH_RE.match(opts.batch):
        raise BadOption(f"--batch {opts.batch!r}: not a valid name; allowed: 1-80 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit, not digits alone (they name a job)")
    notify = getattr(opts, "notify", None)
    if notify is not None and not NOTIFY_URL_RE.match(notify):
        raise BadOption(f"--notify {notify!r}: not a URL; allowed: http://HOST/... or https://HOST/...")


def check_defaults(defaults: Defaults, info: ModelInfo) -> None:
    """``--frames`` and ``--size`` against what the model takes."""
    if defaults.frames is not None and (msg := info.check_frames(defaults.frames)):
        raise BadOption(f"--frames {defaults.frames}: {msg}")
    if defaults.size is not None and (msg := info.check_size(*defaults.size)):
        raise BadOption(f"--size {defaults.size[0]}x{defaults.size[1]}: {msg}")


def parse_size_option(value: str, info: ModelInfo) -> tuple[int, int]:
    size, msg = parse_size(value, info)
    if msg:
        raise BadOption(f"--size {value!r}: {msg}")
    return size


def check_group_size(n: int) -> None:
    if not MIN_GROUP <= n <= MAX_GROUP:
        raise BadOption(f"--group-size {n}: out of range; allowed: {MIN_GROUP} to {MAX_GROUP}")


def available_devices() -> list[str]:
    """The torch devices this machine has: cpu, then cuda and cuda:N per GPU, then mps."""
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        devices += ["cuda"] + [f"cuda:{i}" for i in range(n)]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


def check_device(device: str, option: str = "--device") -> str:
    """``device`` if this machine has it. Not a device name: BadOption; a device this machine
    lacks (``cuda`` without CUDA, ``cuda:7`` with one GPU): SetupProblem."""
    m = DEVICE_RE.fullmatch(device.strip())
    if not m:
        raise BadOption(f"{option} {device!r}: not a device; allowed: cpu, cuda, cuda:N, mps")
    have = available_devices()
    name = m.group(0)
    if name in have or (m.group(1) == "cpu" and m.group(2) in (None, "0")):
        return name
    import torch

    if m.group(1) == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)")
    elif m.group(1) == "cuda":
        why = f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    else:
        why = f"this machine has no {m.group(1)} device"
    raise SetupProblem(f"{option} {device}: {why}; allowed here: {', '.join(have)}")


# the file each diffusers component keeps its config in
_CONFIG_FILES = {"scheduler": "scheduler_config.json", "tokenizer": "tokenizer_config.json",
                 "tokenizer_2": "tokenizer_config.json", "feature_extractor": "preprocessor_config.json"}


def check_model(model: str, decoder: str = "vae") -> ModelInfo:
    """What ``model`` takes, once its folder's configs are known to load.

    A name or folder that is not a model (ModelError) is bad input; a diffusers folder whose
    component configs are missing or unreadable, or a ``--decoder tiny`` the folder has no
    ``vae_tiny/`` for, is a setup problem.
    """
    try:
        resolve(model)  # a name or folder that is not a model: bad input
    except ModelError as e:
        raise BadOption(str(e))
    try:
        info = model_info(model)
    except ModelError as e:  # a model folder whose configs do not load: setup
        msg = str(e)
        raise SetupProblem(msg if msg.startswith("--model") else f"--model {model}: {msg}")
    try:
        index = json.loads((info.path / "model_index.json").read_text())
    except (OSError, ValueError) as e:
        raise SetupProblem(f"--model {model}: {info.path / 'model_index.json'} does not load ({e})")
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or spec[1] is None:
            continue
        cfg = info.path / name / _CONFIG_FILES.get(name, "config.json")
        if name.startswith("tokenizer") and not cfg.exists() and (info.path / name).is_dir():
            continue  # some tokenizers keep only their vocabulary files
        try:
            data = json.loads(cfg.read_text())
        except FileNotFoundError:
            raise SetupProblem(f"--model {model}: {cfg} is missing; model_index.json names a {spec[1]} there "
                               "(save the pipeline again with save_pretrained)")
        except (OSError, ValueError) as e:
            raise SetupProblem(f"--model {model}: {cfg} does not load ({e.__class__.__name__}: {e})")
        if not isinstance(data, dict):
            raise SetupProblem(f"--model {model}: {cfg} is not a JSON object")
    if decoder == "tiny" and not info.has_tiny_vae:
        raise SetupProblem(f"--decoder tiny: {info.path / 'vae_tiny'} is missing; the model folder has no "
                           "AutoencoderTiny; allowed here: --decoder vae")
    return info


def check_storage(url: str, option: str = "--out") -> None:
    """The storage root can be written: a local folder (created if missing; a probe file is
    written and deleted) or an S3 prefix (the bucket is reachable with the credentials in use,
    and a probe object is written and deleted). An unsupported URL is bad input; storage that
    cannot be written is a setup problem."""
    try:
        storage = open_storage(url)
    except StorageUnavailable as e:
        raise SetupProblem(f"{option} {url}: {e}")
    except StorageError as e:
        shown = url if url.strip() else repr(url)
        raise BadOption(f"{option} {shown}: {str(e).removeprefix(repr(url) + ': ')}")
    try:
        storage.check_writable()
    except StorageUnavailable as e:
        raise SetupProblem(f"{option} {url}: {e}")


def check_input_file(path: str | os.PathLike, what: str = "") -> Path:
    """A file that exists, is a file and can be read; else BadOption naming it and why.

    A regular file is opened and one byte read. A pipe (``clipmill qc <(cat clip.y4m)``), a FIFO
    or a device is only checked for read permission: reading from it would consume the byte its
    reader needs (or, on a FIFO, end its writer with SIGPIPE and leave the reader waiting)."""
    p = Path(path)
    label = f"{what} {path}" if what else str(path)
    if not p.exists():
        raise BadOption(f"{label}: no such file")
    if p.is_dir():
        raise BadOption(f"{label}: is a folder; give a file")
    if not p.is_file():
        if not os.access(p, os.R_OK):
            raise BadOption(f"{label}: cannot be read (Permission denied)")
        return p
    try:
        with open(p, "rb") as f:
            f.read(1)
    except OSError as e:
        raise BadOption(f"{label}: cannot be read ({e.strerror or e})")
    return p


MEMORY_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str, option: str) -> int:
    """``500MB``, ``2GiB``, ``1.5GB`` as bytes; BadOption naming ``option`` otherwise."""
    m = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).lower() not in MEMORY_UNITS:
        raise BadOption(f"{option} {text!r}: not a size; give a number and a unit ({', '.join(MEMORY_UNITS)}), "
                        "for example 500MB or 2GiB")
    n = int(float(m.group(1)) * MEMORY_UNITS[m.group(2).lower()])
    if n <= 0:
        raise BadOption(f"{option} {text!r}: must be more than 0 bytes")
    return n


def available_memory() -> int | None:
    """Bytes this process can still take without the kernel swapping or killing it: the host's
    ``MemAvailable``, and in a container the least room left under any memory limit of its
    cgroup or the cgroups above it (v2 ``memory.max`` less ``memory.current``, v1
    ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``; both count page cache the kernel
    can take back, so its ``inactive_file`` is counted as room, as ``docker stats`` does); None
    where none is known (not Linux)."""
    known = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                known.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        own = []
    for line in own:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            mount, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1
            mount, files = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                            "total_inactive_file")
        else:
            continue
        # the cgroup and each one above it; a container sees its own cgroup at the mount's root
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            if (room := _cgroup_room(mount.joinpath(*parts[:depth]), *files)) is not None:
                known.append(room)
    return min(known) if known else None


def _cgroup_room(folder: Path, limit_file: str, used_file: str, reclaimable: str) -> int | None:
    """Bytes left under the memory limit of the cgroup at ``folder`` (its reclaimable page
    cache counted as room), or None where it has no limit or no such files."""
    try:
        limit, used = (folder / limit_file).read_text().strip(), int((folder / used_file).read_text())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 2**60:  # v1 states "no limit" as a huge number
        return None
    cache = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == reclaimable:
                cache = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - max(0, used - cache))
