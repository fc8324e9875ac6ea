"""Both builds of the extension (setup.py and the JIT fallback, build.jit_compile) compile with the one
list of flags in ddpm/kernels/build.py, the flags the kernels' bit-exactness depends on."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools
import torch
from torch.utils import cpp_extension

from ddpm.kernels import build

ROOT = Path(__file__).resolve().parents[2]


def test_the_flags_forbid_fast_math_and_fp_contraction():
    assert "-ffp-contract=off" in build.CXX_FLAGS
    assert not any("fast-math" in flag or "fast_math" in flag for flag in build.CXX_FLAGS + build.NVCC_FLAGS)


def test_the_flags_module_imports_no_torch():
    """setup.py reads it before torch.utils.cpp_extension loads (which reads CUDA_HOME once)."""
    code = "import sys; import ddpm.kernels.build; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize(
    "asked",
    [{"DIFFUSION_KERNELS_CPU_ONLY": "1"}, {}, {"DIFFUSION_KERNELS_CUDA": "1"}],
    ids=["cpu only", "as found", "cuda asked"],
)
def test_setup_py_builds_with_the_shared_flags_and_cuda_kernels_only_where_they_can_run_or_are_asked_for(
    monkeypatch, asked
):
    """setup.py run as pip runs it, with setuptools.setup caught: its extension carries the shared flags; the CUDA
    kernels are compiled where a toolkit is found and a GPU is here, or where the environment asks (as CI does), and
    the CPU kernels alone otherwise (which build sooner)."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "DIFFUSION_KERNELS_CPU_ONLY", "DIFFUSION_KERNELS_CUDA"):
        monkeypatch.setenv(name, "")  # setup.py may set them: restored afterwards
        monkeypatch.delenv(name)
    for name, value in asked.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    (extension,) = captured["ext_modules"]
    assert extension.extra_compile_args["cxx"] == list(build.CXX_FLAGS)
    assert extension.extra_link_args == list(build.LINK_FLAGS)
    toolkit = bool(os.environ.get("CUDA_HOME")) and torch.version.cuda is not None  # setup.py sets it when found
    wanted = "DIFFUSION_KERNELS_CUDA" in asked or torch.cuda.is_available()
    cuda = toolkit and wanted and "DIFFUSION_KERNELS_CPU_ONLY" not in asked
    cpu = ["diffusion_ops.cpp", "diffusion_winograd.cpp", "diffusion_thin_conv.cpp"]
    expected = [*cpu, "diffusion_kernels.cu"] if cuda else cpu
    assert extension.sources == expected
    if cuda:
        assert extension.extra_compile_args["nvcc"] == list(build.NVCC_FLAGS)


def test_the_jit_fallback_builds_with_the_shared_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    build.jit_compile()
    (call,) = calls
    assert call["extra_cflags"] == list(build.CXX_FLAGS)
    assert call["extra_ldflags"] == list(build.LINK_FLAGS)
    assert call["extra_cuda_cflags"] == list(build.NVCC_FLAGS)
