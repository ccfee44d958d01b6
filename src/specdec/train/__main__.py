"""python -m specdec.train: the whole bundled-pair pipeline (prepare, target, prophets)."""

import sys
from pathlib import Path

from specdec.defaults import shipped
from specdec.train.pipeline import distill, load_config, prepare, train_target

if __name__ == "__main__":
    cfg = load_config(Path(shipped(sys.argv[1] if len(sys.argv) > 1 else "configs/bundled.toml")))
    work = Path(".cache/bundled")
    prepare(cfg, work)
    train_target(cfg, work, Path("models/target"))
    distill(cfg, work, Path("models/target"), Path("models/prophet"), data_out_dir=work / "prophet-data")
