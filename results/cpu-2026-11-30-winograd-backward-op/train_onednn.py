"""`python main.py ARGS` with AVX-512's convolutions left to oneDNN (no Winograd 3x3 convolutions, no 1x1 GEMMs):
the default before 2026-11-30, trained for the equal-quality check against today's default.

    PYTHONPATH=. python results/cpu-2026-11-30-winograd-backward-op/train_onednn.py --mode train --dataset mnist_5k ...
"""

import runpy
import sys

from ddpm.training import winograd

winograd._MIN_SIDE.pop("AVX512")
winograd._GEMM_1X1.pop("AVX512")
sys.argv = ["main.py", *sys.argv[1:]]
runpy.run_path("main.py", run_name="__main__")
