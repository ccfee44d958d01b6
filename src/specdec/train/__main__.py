"""python -m specdec.train: the whole bundled-pair pipeline (prepare, target, prophets)."""

import sys
from pathlib import Path

from specdec.defaults import TRAINED_PROPHET, TRAINED_TARGET, shipped
from specdec.train.pipeline import distill, load_config, prepare, train_target

if __name__ == "__main__":
    cfg = load_config(Path(shipped(sys.argv[1] if len(sys.argv) > 1 else "configs/bundled.toml")))
    work = Path(".cache/bundled")
    prepare(cfg, work)
    train_target(cfg, work, Path(TRAINED_TARGET))
    distill(cfg, work, Path(TRAINED_TARGET), Path(TRAINED_PROPHET), data_out_dir=work / "prophet-data")
