"""`nlq-scale train` in this process, killed with its process group during its NTH background
checkpoint save (tests/faults.py). Usage: train_crash_in_save.py NTH TRAIN_ARGS..."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nlq_scale.cli import main  # noqa: E402
from tests.faults import crash_during_background_save  # noqa: E402

if __name__ == "__main__":
    crash_during_background_save(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
