"""How the diffusion_kernels extension is compiled: one list of compiler flags for both builds, setup.py's
(``pip install -e . --no-build-isolation``, ``python setup.py build_ext --inplace``) and the JIT fallback
(:func:`jit_compile`, ``torch.utils.cpp_extension.load``) that ddpm/kernels/ops.py runs when no build is found.

No torch import at the top: setup.py reads the flags before torch.utils.cpp_extension loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

EXTENSION_NAME = "_diffusion_kernels"
BUILD_COMMAND = "pip install -e . --no-build-isolation (or: python setup.py build_ext --inplace)"
ROOT = Path(__file__).resolve().parents[2]  # the repository root, where the kernels' sources are
CPU_SOURCES = ("diffusion_ops.cpp", "diffusion_winograd.cpp", "diffusion_thin_conv.cpp")
CUDA_SOURCES = (*CPU_SOURCES, "diffusion_kernels.cu")

# GCC's OpenMP: at::parallel_for is a header template, so without -fopenmp the CPU kernels run on one thread.
OPENMP_FLAGS: tuple[str, ...] = ("-fopenmp",) if sys.platform.startswith("linux") else ()

# No fast math and -ffp-contract=off (no FMA contraction): the step kernel must match noise_schedule.p_step bit for
# bit. -fno-trapping-math changes no result but lets GCC vectorize the clamp's select. -g0 overrides Python's -g,
# whose debug info for the template instances costs compile time (BENCHMARKS.md, "Building the extension").
CXX_FLAGS: tuple[str, ...] = ("-O3", "-g0", "-ffp-contract=off", "-fno-trapping-math", *OPENMP_FLAGS)
LINK_FLAGS: tuple[str, ...] = OPENMP_FLAGS
# No --use_fast_math (see above); -lineinfo lets compute-sanitizer and ncu point at source lines; --threads 0
# compiles the target architectures in parallel.
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-lineinfo", "--threads", "0")


def jit_compile() -> None:
    """Compile the kernels' sources with these flags and load the library into ``torch.ops.diffusion_kernels``:
    with the .cu when a GPU and a complete CUDA toolkit are present, CPU-only otherwise. Raises what the compiler
    or torch raises (the caller turns it into one line)."""
    import torch
    from torch.utils import cpp_extension

    # The CUDA sources only with a GPU and a complete toolkit (setup.py checks the same way).
    toolkit = cpp_extension.CUDA_HOME
    with_cuda = (
        torch.cuda.is_available()
        and bool(toolkit)
        and Path(toolkit, "bin", "nvcc").is_file()
        and Path(toolkit, "include", "cuda_runtime.h").is_file()
    )
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(ROOT / name) for name in (CUDA_SOURCES if with_cuda else CPU_SOURCES)],
        extra_cflags=list(CXX_FLAGS),  # setup.py's flags (no fast math: bit-exact steps)
        extra_ldflags=list(LINK_FLAGS),
        extra_cuda_cflags=list(NVCC_FLAGS),
        is_python_module=False,  # load the library into torch.ops; no Python module needed
        verbose=False,
    )
