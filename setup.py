"""Build the diffusion_kernels extension (the fused sampling-step ops) with ninja.

    pip install -e . --no-build-isolation          # editable install, builds the extension
    python setup.py build_ext --inplace             # or: just the extension, next to the sources

The result is the module ``_diffusion_kernels``; importing it registers
``torch.ops.diffusion_kernels.*`` (see ddpm/kernels/ops.py, which also JIT-compiles the same
sources when no build is found). Both builds take their compiler flags from ddpm/kernels/build.py.

CUDA or not
-----------
A ``CUDAExtension`` (the CPU sources + diffusion_kernels.cu) is built when a CUDA toolkit is found, torch
is a CUDA build and there is a GPU to run it on, or the environment asks for it (``DIFFUSION_KERNELS_CUDA=1``, or
``TORCH_CUDA_ARCH_LIST`` naming the targets: CI compiles the CUDA kernels so, on a machine with no GPU); otherwise
a CPU-only ``CppExtension`` (diffusion_ops.cpp, diffusion_winograd.cpp and diffusion_thin_conv.cpp, compiled side
by side), which builds sooner. The toolkit is ``$CUDA_HOME`` (or ``$CUDA_PATH``) when set, else the directory
holding the ``nvcc`` on ``PATH`` or ``/usr/local/cuda``; it must contain ``bin/nvcc`` and
``include/cuda_runtime.h``.
``DIFFUSION_KERNELS_CPU_ONLY=1`` forces the CPU-only build.

Without a GPU and without ``TORCH_CUDA_ARCH_LIST``, the CUDA build targets ``8.0;9.0+PTX``: machine code
for sm_80, which the 8.x GPUs run (A100, RTX 30xx, L4/RTX 40xx), and for sm_90 (H100/H200), and PTX that the
driver compiles for newer GPUs; two device compilations instead of one per GPU model, each spread over the CPU's
cores (nvcc --threads). ``MAX_JOBS`` bounds ninja's parallelism.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"

# The compiler flags live in ddpm/kernels/build.py, shared with its JIT build
# (bit-exactness depends on them: no fast math, no FP contraction). That module imports no torch.
sys.path.insert(0, str(ROOT))
from ddpm.kernels.build import CPU_SOURCES, CUDA_SOURCES, CXX_FLAGS, EXTENSION_NAME, LINK_FLAGS, NVCC_FLAGS  # noqa: E402


def _is_cuda_toolkit(path: str | None) -> bool:
    return (
        bool(path) and (Path(path) / "bin" / "nvcc").is_file() and (Path(path) / "include" / "cuda_runtime.h").is_file()
    )


def _find_cuda_toolkit() -> str | None:
    """The CUDA toolkit to build with, or None for a CPU-only build."""
    if os.environ.get("DIFFUSION_KERNELS_CPU_ONLY", "") not in ("", "0"):
        return None
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        return explicit if _is_cuda_toolkit(explicit) else None
    # `nvcc` on PATH may be a wrapper script (e.g. /usr/local/bin/nvcc), so check the toolkit.
    nvcc = shutil.which("nvcc")
    candidates = [str(Path(os.path.realpath(nvcc)).parent.parent)] if nvcc else []
    candidates.append("/usr/local/cuda")
    return next((c for c in candidates if _is_cuda_toolkit(c)), None)


def _extensions() -> list:
    cuda_home = _find_cuda_toolkit()
    if cuda_home is not None:
        # torch.utils.cpp_extension reads CUDA_HOME once, when it is first imported.
        os.environ["CUDA_HOME"] = cuda_home
    import torch
    from torch.utils import cpp_extension

    use_cuda = cuda_home is not None and torch.version.cuda is not None
    asked = os.environ.get("DIFFUSION_KERNELS_CUDA", "") not in ("", "0") or bool(
        os.environ.get("TORCH_CUDA_ARCH_LIST")
    )
    if use_cuda and not asked and not torch.cuda.is_available():
        print(
            "diffusion_kernels: no GPU here: the CPU kernels only (DIFFUSION_KERNELS_CUDA=1 builds the CUDA ones too)"
        )
        use_cuda = False
    elif not use_cuda:
        print(
            f"diffusion_kernels: building the CPU-only extension (CUDA toolkit: {cuda_home}, torch CUDA: "
            f"{torch.version.cuda})"
        )
    if not use_cuda:
        return [
            cpp_extension.CppExtension(
                EXTENSION_NAME,
                list(CPU_SOURCES),
                extra_compile_args={"cxx": list(CXX_FLAGS)},
                extra_link_args=list(LINK_FLAGS),
            )
        ]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
    print(
        f"diffusion_kernels: building the CUDA extension with {cuda_home} "
        f"for TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '(the local GPU)')}"
    )
    return [
        cpp_extension.CUDAExtension(
            EXTENSION_NAME,
            list(CUDA_SOURCES),  # relative paths: setuptools refuses absolute ones
            extra_compile_args={"cxx": list(CXX_FLAGS), "nvcc": list(NVCC_FLAGS)},
            extra_link_args=list(LINK_FLAGS),
        )
    ]


# setuptools runs this file from the project root; keep the relative source paths valid anyway.
os.chdir(ROOT)
EXT_MODULES = _extensions()  # first: it sets CUDA_HOME before torch.utils.cpp_extension loads
from torch.utils.cpp_extension import BuildExtension  # noqa: E402

setup(
    name="ddpm-fast",
    version="0.1.0",
    description="ddpm-fast's fused sampling kernels (the _diffusion_kernels extension)",
    python_requires=">=3.10",
    # Only the extension is installed: main.py, the core modules and the ddpm package run from the
    # checkout (python main.py), so no generic top-level names land in site-packages.
    py_modules=[],
    packages=[],
    ext_modules=EXT_MODULES,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
