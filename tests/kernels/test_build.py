"""Both builds of the extension (setup.py and the JIT fallback, build.jit_compile) compile with the one
list of flags in ddpm/kernels/build.py, the flags the kernels' bit-exactness depends on."""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools
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


@pytest.mark.parametrize("cpu_only", ["1", "0"])
def test_setup_py_builds_with_the_shared_flags(monkeypatch, cpu_only):
    """setup.py run as pip runs it, with setuptools.setup caught: its extension carries the shared flags."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST"):  # setup.py may set them: restored afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("DIFFUSION_KERNELS_CPU_ONLY", cpu_only)
    monkeypatch.chdir(ROOT)
    runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    (extension,) = captured["ext_modules"]
    assert extension.extra_compile_args["cxx"] == list(build.CXX_FLAGS)
    assert extension.extra_link_args == list(build.LINK_FLAGS)
    if cpu_only == "1":
        assert extension.sources == ["diffusion_ops.cpp"]
    if "diffusion_kernels.cu" in extension.sources:  # a CUDA toolkit was found
        assert extension.extra_compile_args["nvcc"] == list(build.NVCC_FLAGS)


def test_the_jit_fallback_builds_with_the_shared_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs))
    build.jit_compile()
    (call,) = calls
    assert call["extra_cflags"] == list(build.CXX_FLAGS)
    assert call["extra_ldflags"] == list(build.LINK_FLAGS)
    assert call["extra_cuda_cflags"] == list(build.NVCC_FLAGS)
