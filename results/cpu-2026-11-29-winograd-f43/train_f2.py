"""`python main.py ARGS` with every float32 Winograd convolution in F(2x2, 3x3) (ops.winograd_tile forced to 2): the
training run that F(4x4, 3x3)'s is compared with.

    PYTHONPATH=. python results/cpu-2026-11-29-winograd-f43/train_f2.py --mode train --dataset mnist_5k ...
"""

import runpy
import sys

from ddpm.kernels import ops

ops.winograd_tile = lambda side: 2
sys.argv = ["main.py", *sys.argv[1:]]
runpy.run_path("main.py", run_name="__main__")
