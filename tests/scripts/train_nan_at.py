"""`nlq-scale train` in this process, with the loss of its STEP-th training step made NaN
(tests/faults.py). Usage: train_nan_at.py STEP TRAIN_ARGS..."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nlq_scale.cli import main  # noqa: E402
from tests.faults import nan_loss_at_train_step  # noqa: E402

if __name__ == "__main__":
    nan_loss_at_train_step(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
