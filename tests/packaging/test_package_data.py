"""Where specdec finds what it ships: models and configs are package data, read in place from a
checkout or an installed wheel; models/NAME and configs/NAME name them (as pages print them)
unless the working directory holds such a path; training writes where its caller says."""

from pathlib import Path

import specdec
from specdec.cli import build_parser
from specdec.defaults import (
    TRAINED_PROPHET,
    bundled_prophet,
    bundled_target,
    configs_dir,
    display_name,
    distill_target,
    models_dir,
    shipped,
)

PACKAGE = Path(specdec.__file__).resolve().parent


def test_the_shipped_models_and_configs_are_package_data(monkeypatch):
    monkeypatch.delenv("SPECDEC_MODELS", raising=False)
    assert configs_dir() == PACKAGE / "configs"
    assert models_dir() == (PACKAGE / "models" if (PACKAGE / "models").is_dir() else PACKAGE.parents[1] / "models")
    assert (Path(bundled_target()) / "model.safetensors").is_file()
    assert (Path(bundled_prophet()) / "model.safetensors").is_file()
    assert (models_dir() / "smollm2-eagle" / "prophet.json").is_file()
    assert {p.name for p in configs_dir().glob("*.toml")} == {"bundled.toml", "smollm2.toml"}
    monkeypatch.setenv("SPECDEC_MODELS", "/somewhere/else")
    assert models_dir() == Path("/somewhere/else")


def test_models_and_configs_names_read_the_shipped_files_unless_the_working_directory_has_them(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.delenv("SPECDEC_MODELS", raising=False)
    monkeypatch.chdir(tmp_path)
    eagle = str(models_dir() / "smollm2-eagle")
    assert shipped("models/smollm2-eagle") == eagle
    assert display_name(eagle) == "models/smollm2-eagle"  # the name printed is the name read
    assert shipped("configs/smollm2.toml") == str(configs_dir() / "smollm2.toml")
    assert shipped("models/target") == bundled_target()
    for unchanged in ("ngram", "smollm2", "HuggingFaceTB/SmolLM2-135M", "models/no-such-model", "configs/nope.toml",
                      "models/", "other/target"):
        assert shipped(unchanged) == unchanged
    (tmp_path / "models" / "target").mkdir(parents=True)  # `specdec train`'s output here wins
    assert shipped("models/target") == "models/target"
    assert shipped(str(tmp_path / "models" / "target")) == str(tmp_path / "models" / "target")


def test_training_writes_under_the_working_directory_never_into_the_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    train, distill = parser.parse_args(["train"]), parser.parse_args(["distill"])
    # distill's --out and --config default to None: without --target X, `cmd_distill` takes runs/prophet and the
    # bundled config (with --target X --minutes N the prophet goes to the user cache, `specdec.train.anytarget`)
    assert distill.out is None and distill.config is None
    for out in (train.out, train.work_dir, TRAINED_PROPHET):
        assert Path(out).resolve().is_relative_to(tmp_path), out
    assert Path(shipped(train.config)) == configs_dir() / "bundled.toml"
    assert Path(distill_target(distill.target)) == Path(bundled_target())  # no `specdec train` output here yet
    Path(train.out).mkdir(parents=True)
    assert distill_target(distill.target) == train.out  # `specdec train`'s, once it wrote one


def test_every_package_under_src_is_listed_in_pyproject():
    """pyproject.toml names its packages (it maps specdec.models from the top-level models/ folder, which
    `packages.find` cannot), so a new package folder under src/ must be added there to reach the wheel."""
    import tomllib

    setup = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("*")
             if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.parts}
    assert found <= set(setup["packages"]), found - set(setup["packages"])
    assert setup["package-dir"]["specdec.models"] == "models"
