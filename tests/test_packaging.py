"""The package's shape: one installed name, the architecture's import rules, a fast --help."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("jobs", "pipeline", "qc", "storage")
# imported inside functions on purpose: heavy or optional libraries, loaded only when used
HEAVY = ("torch", "torch_tensorrt", "diffusers", "transformers", "av", "cv2", "skimage", "boto3", "botocore",
         "alembic", "uvicorn", "tzlocal", "clipmill.storage.s3", "PIL", "fontTools",
         "playwright")  # a dev dependency: only `bench --review`'s browser part needs it


def modules() -> dict[str, Path]:
    found = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found["clipmill." + ".".join(parts)] = path
    return found


def imports(path: Path, module: str, top_level_only: bool) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for each import in ``path``."""
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(node)}
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in inside) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.append((base, node.lineno, id(node) in inside))
            out += [(f"{base}.{a.name}", node.lineno, id(node) in inside) for a in node.names]
    return [i for i in out if not (top_level_only and i[2])]


# the owner's layout, and beside it only the usual small things
TOP_LEVEL = {"pyproject.toml", "README.md", "jobs", "pipeline", "qc", "storage", "tests", "deploy",
             "Makefile", ".ci", "examples", ".gitignore", ".dockerignore"}


def test_the_repository_top_level_holds_only_the_owners_layout():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {line.split("/", 1)[0] for line in tracked.splitlines() if line}
    assert top - TOP_LEVEL == set(), f"tracked at the top level outside the owner's layout: {sorted(top - TOP_LEVEL)}"


def test_pyproject_lists_every_package_under_its_installed_name():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(conf["packages"])
    on_disk = {"clipmill." + ".".join(p.parent.relative_to(ROOT).parts) for f in FOLDERS
               for p in (ROOT / f).rglob("__init__.py")}
    assert listed == on_disk
    assert conf["package-dir"] == {f"clipmill.{f}": f for f in FOLDERS}


def test_the_wheel_installs_one_top_level_name(tmp_path):
    """What `pip install` puts at the top of site-packages: clipmill/ and its dist-info only."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("clipmill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"clipmill"}, top
    assert not top & set(FOLDERS)
    for needed in ("clipmill/jobs/cli/__init__.py", "clipmill/jobs/review/templates/batch.html",
                   "clipmill/jobs/review/templates/_cards.js",
                   "clipmill/jobs/core/migrations/script.py.mako", "clipmill/pipeline/render.py", "clipmill/qc/check.py",
                   "clipmill/storage/local.py"):
        assert needed in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "clipmill = clipmill.jobs.cli:main" in entry


def test_libraries_never_import_jobs_and_qc_never_imports_the_render_path():
    render_path = ("clipmill.pipeline.models", "clipmill.pipeline.sampler", "clipmill.pipeline.render",
                   "clipmill.pipeline.guidance", "clipmill.pipeline.textkv", "clipmill.pipeline.deepcache",
                   "clipmill.pipeline.compile", "clipmill.pipeline.prompt_cache")
    bad = []
    for mod, path in modules().items():
        for name, line, _ in imports(path, mod, top_level_only=False):
            if not mod.startswith("clipmill.jobs") and (name.startswith("clipmill.jobs") or name.split(".")[0] in FOLDERS):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
            if mod.startswith("clipmill.qc") and name.startswith(render_path):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name} (the render path)")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_and_no_imports_hidden_in_functions():
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    hidden = []
    for mod, path in mods.items():
        for name, line, in_function in imports(path, mod, top_level_only=False):
            target = next((m for m in (name, name.rpartition(".")[0]) if m in mods and m != mod), None)
            if in_function:
                # the CLI's command modules import the (torch-heavy) API in their bodies, so that
                # `clipmill --help` stays fast; everywhere else only heavy libraries load late
                if not mod.startswith("clipmill.jobs.cli") and not name.startswith(HEAVY):
                    hidden.append(f"{path.relative_to(ROOT)}:{line} imports {name} inside a function")
            elif target:
                graph[mod].add(target)
    assert not hidden, "\n".join(hidden)
    # a cycle is a path back to where it started (packages import their own modules: skip
    # the edge from a package to its children, which Python resolves without a cycle)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_help_loads_no_heavy_library_and_answers_within_half_a_second_of_python_itself():
    code = ("import sys; from click.testing import CliRunner; from clipmill.jobs.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0, r.output; "
            "print(','.join(m for m in ('torch', 'sqlalchemy', 'cv2', 'numpy', 'celery', 'diffusers') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "", f"--help imported {proc.stdout.strip()}"

    def fastest(args: list[str]) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run(args, capture_output=True, check=True, timeout=60)
            best = min(best, time.perf_counter() - t0)
        return best

    python = fastest([sys.executable, "-c", "pass"])
    helped = fastest([sys.executable, "-m", "clipmill.jobs.cli", "--help"])
    assert helped - python < 0.5, f"clipmill --help {helped:.3f} s, python -c pass {python:.3f} s"
