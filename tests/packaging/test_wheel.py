"""specdec as a user installs it: a wheel and an sdist built from this checkout carry what the
library reads beside its code (the shipped models, the training configs, the web view, every
kernel source), and the wheel, installed into a fresh virtual environment outside the checkout,
decodes speculatively with its default prophets on a 4-bit kernel it compiles for itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from specdec import qgemm
from specdec.defaults import cache_dir

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "specdec"
DATA = ("configs", "kernels", "server/static")  # the package's folders of data files
# the shipped models: the top-level models/ folder, installed as specdec/models
FOLDERS = {**{f"specdec/{folder}": PACKAGE / folder for folder in DATA}, "specdec/models": ROOT / "models"}


def package_data() -> set[str]:
    """Every file in the package's data folders and the models, named as in a wheel (specdec/models/...)."""
    return {f"{name}/{p.relative_to(folder).as_posix()}" for name, folder in FOLDERS.items() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points Python or specdec at this checkout or its settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("SPECDEC_")}
    return {**env, **extra}


def run(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def source_tree(into: Path) -> Path:
    """What a build reads (pyproject.toml, README.md, src/, models/), copied: a build writes build/ and
    egg-info beside its sources, and so never into the checkout."""
    into.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, into / name)
    for name in ("src", "models"):
        shutil.copytree(ROOT / name, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return into


def build_wheel(source: Path, out: Path) -> Path:
    """A wheel of `source` (a source tree or an sdist), with no dependencies and no download."""
    run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out)], timeout=600, env=clean_env())
    (wheel,) = out.glob("specdec-*.whl")
    return wheel


def build_sdist(tree: Path, out: Path) -> Path:
    """The sdist of `tree`, by setuptools' own build hook (what `python -m build --sdist` calls)."""
    run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
        timeout=600, cwd=tree, env=clean_env())
    (sdist,) = out.glob("specdec-*.tar.gz")
    return sdist


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if not n.startswith("specdec-")}  # less the dist-info


def test_the_wheel_carries_the_models_configs_kernels_and_web_view(tmp_path):
    want = package_data()
    # the files the defaults and the kernel build read are among them
    kernels = {f"specdec/kernels/{p.name}" for p in (*qgemm.SOURCES, *qgemm.HEADERS)}
    assert kernels | {"specdec/kernels/qgemm_common.h", "specdec/models/target/model.safetensors",
                      "specdec/models/prophet/model.safetensors", "specdec/models/smollm2-eagle/prophet.json",
                      "specdec/configs/bundled.toml", "specdec/configs/smollm2.toml",
                      "specdec/server/static/index.html"} <= want
    names = wheel_names(build_wheel(source_tree(tmp_path / "tree"), tmp_path / "dist"))
    assert want - names == set()


@pytest.mark.slow
def test_a_wheel_in_a_fresh_venv_drafts_with_its_prophets_and_builds_its_kernel(tmp_path):
    assert not tmp_path.resolve().is_relative_to(ROOT)
    tree = source_tree(tmp_path / "tree")
    wheel = build_wheel(tree, tmp_path / "dist")
    sdist = build_sdist(tree, tmp_path / "sdist")
    assert wheel_names(build_wheel(sdist, tmp_path / "dist-from-sdist")) == wheel_names(wheel)  # pip install sdist
    print(f"wheel {wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB; sdist {sdist.name}: "
          f"{sdist.stat().st_size / 1e6:.1f} MB")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120, env=clean_env())
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        timeout=600, env=clean_env())
    # the dependencies: this interpreter's site-packages, read after the fresh one (no download); .pth files
    # there (the checkout's editable install among them) are not run, so specdec comes from the wheel alone
    fresh_site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          timeout=60, env=clean_env()).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (fresh_site / "specdec-test-dependencies.pth").write_text("".join(f"{p}\n" for p in ours))

    cache = tmp_path / "cache"  # a fresh cache: the 4-bit kernel is compiled from the wheel's sources
    converted = cache_dir() / "gguf"  # SmolLM2's GGUF file converted once (what is tested is the kernel's build)
    if converted.is_dir():
        cache.mkdir()
        (cache / "gguf").symlink_to(converted, target_is_directory=True)
    work = tmp_path / "work"  # the working directory: no models/ or configs/ of a checkout here
    work.mkdir()
    env = clean_env(SPECDEC_CACHE=str(cache), PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    where = run([str(python), "-c", "import specdec, specdec.defaults as d; print(specdec.__file__); "
                 "print(d.models_dir()); print(d.configs_dir())"], timeout=120, cwd=work, env=env).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where

    done = run([str(venv / "bin" / "specdec"), "generate", "The capital of France is Paris. The capital of France is",
                "--compare", "--max-new-tokens", "12", "--temperature", "0", "--policy", "fixed",
                "--draft-tokens", "4"], timeout=2400, cwd=work, env=env)
    print(done.stdout)
    print(done.stderr)
    drafted = re.search(r"^\W*drafted\W+(\d+)", done.stderr, re.MULTILINE)
    assert drafted and int(drafted.group(1)) > 0, done.stderr
    assert "smollm2-eagle" in done.stderr  # the default prophets, from the wheel's models/
    assert "(identical tokens)" in done.stderr

    built = sorted(cache.glob("kernels/specdec_qgemm_*/specdec_qgemm_*.so"))
    kernel = run([str(python), "-c", "from specdec import int4, qgemm; print(qgemm.build_dir()); "
                  "print(int4.kernel_choice())"], timeout=600, cwd=work, env=env).stdout.split()
    print(f"4-bit kernel: {kernel[1]}, built in {kernel[0]}: {[p.name for p in built]}")
    assert built and built[0].parent == Path(kernel[0]) and kernel[1] in ("blocks", "blocks16", "amx")
