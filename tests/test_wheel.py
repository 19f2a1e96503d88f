"""The wheel carries every subpackage and the shipped data, and imports on its own.

An editable install reads the source tree, so it hides a package that
``pyproject.toml`` forgets to list. Here the wheel is built (``pip wheel .``),
its file list is checked against the source tree, and it is unpacked into a
folder from which every module is imported in a fresh interpreter, with the
working folder elsewhere: each ``__file__`` must lie in the unpacked wheel.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "mlx_redrafter"
DATA_FOLDERS = ("data", "drafters", "serve/ui")  # shipped as data (serve/ui: the server's static files)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy without build/: setuptools never empties build/lib, so
    # a module deleted from the tree would still ship from an earlier build's.
    src = tmp_path_factory.mktemp("src") / "repo"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*cache", ".hypothesis")
    shutil.copytree(REPO, src, ignore=skip)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    log = build.stdout + build.stderr
    # setuptools ships a folder missing from `packages` as data, with a warning: none may appear.
    assert "absent from the `packages` configuration" not in log, log
    (path,) = out.glob("mlx_redrafter-*.whl")
    return path


def source_files():
    """Wheel path -> source file, for every module and shipped data file of the tree."""
    files = {}
    for p in PACKAGE.rglob("*"):
        rel = p.relative_to(PACKAGE)
        if not p.is_file() or "__pycache__" in rel.parts or p.suffix == ".pyc":
            continue
        data = any(rel.as_posix().startswith(f + "/") for f in DATA_FOLDERS)
        if p.suffix == ".py" or data:
            files[f"mlx_redrafter/{rel.as_posix()}"] = p
    for p in (REPO / "converters").glob("*.py"):
        files[f"mlx_redrafter/converters/{p.name}"] = p
    return files


def test_the_wheel_carries_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(set(source_files()) - names)
    assert not missing, f"not in the wheel: {missing}"
    packages = {p.parent.relative_to(REPO).as_posix() for p in PACKAGE.rglob("__init__.py")}
    assert {
        "mlx_redrafter/llm",
        "mlx_redrafter/step",
        "mlx_redrafter/draft",
        "mlx_redrafter/draft/datastore",
        "mlx_redrafter/hub",
        "mlx_redrafter/chat",
        "mlx_redrafter/serve",
        "mlx_redrafter/tuning",
        "mlx_redrafter/train",
    } <= packages
    assert all(f"{p}/__init__.py" in names for p in packages) and "mlx_redrafter/converters/__init__.py" in names
    assert "mlx_redrafter/drafters/smollm2-135m-instruct/model.safetensors" in names
    assert "mlx_redrafter/data/sharegpt_train_prompts.jsonl.gz" in names
    assert not any(n.startswith("converters/") for n in names)  # no generic top-level package


def test_every_module_imports_from_the_unpacked_wheel(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    modules = sorted(
        n[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        for n in zipfile.ZipFile(wheel).namelist()
        if n.endswith(".py") and not n.endswith("__main__.py")
    )  # a __main__ runs its command when imported
    probe = f"""
import importlib, json
from pathlib import Path
out = {{m: importlib.import_module(m).__file__ for m in {modules!r}}}
from mlx_redrafter.prompts import SHAREGPT
from mlx_redrafter.runtime import shipped_drafter_path
out["sharegpt"] = str(SHAREGPT) if SHAREGPT.is_file() else None
out["drafter"] = str(shipped_drafter_path("default"))
print(json.dumps(out))
"""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    files = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(modules) > 40 and "mlx_redrafter.step.dispatch" in files and "mlx_redrafter.converters.gguf" in files
    outside = {m: f for m, f in files.items() if f is None or not Path(f).resolve().is_relative_to(site.resolve())}
    assert not outside, f"imported from outside the wheel: {outside}"
