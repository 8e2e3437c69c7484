"""Per-rank training entry for torchrun / srun / sbatch:
    torchrun --nproc-per-node 8 launch/train.py --config RUN.yaml --run-dir DIR [key=value ...]
"""

import sys

from nlq_scale.train.entry import main

if __name__ == "__main__":
    sys.exit(main())
