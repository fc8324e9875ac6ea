"""The compiler flags of the diffusion_kernels extension: one list for both builds, setup.py's
(``pip install -e . --no-build-isolation``, ``python setup.py build_ext --inplace``) and the JIT
fallback of optimized_diffusion.py (``torch.utils.cpp_extension.load``).

Plain Python with no torch import: setup.py reads it before torch.utils.cpp_extension loads.
tests/util/test_build_flags.py checks that both builds pass exactly these.
"""

from __future__ import annotations

import sys

# GCC's OpenMP: at::parallel_for is a header template, so without -fopenmp the CPU kernels run on one thread.
OPENMP_FLAGS: tuple[str, ...] = ("-fopenmp",) if sys.platform.startswith("linux") else ()

# -O3 everywhere. No fast math: the step kernel must match noise_schedule.p_step bit for bit, and
# -ffp-contract=off keeps the host compiler from fusing a * b + c into an FMA (the CUDA kernel uses
# round-to-nearest intrinsics for the same reason). -fno-trapping-math changes no result (only
# whether FP exception flags may be raised), but lets GCC vectorize the clamp's select.
# -g0 overrides the -g that Python's own CFLAGS hand to setuptools: debug info for the kernels' template instances
# was a third of the .cpp's compile time and nothing reads it (BENCHMARKS.md, "Building the extension").
CXX_FLAGS: tuple[str, ...] = ("-O3", "-g0", "-ffp-contract=off", "-fno-trapping-math", *OPENMP_FLAGS)
LINK_FLAGS: tuple[str, ...] = OPENMP_FLAGS
# No --use_fast_math (see above). -lineinfo lets compute-sanitizer and ncu point at source lines
# without slowing the kernels. --threads 0: one thread per target architecture, up to the CPU's cores (nvcc
# compiles them one after another otherwise).
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-lineinfo", "--threads", "0")
