"""Modes end to end on a CUDA GPU (pytest -m gpu), at test size: the ones scripts/gpu_check.sh's modes stage
found broken on a GPU while every CPU test passed (a plan or a comparison on the CPU beside a model on cuda)."""

import pytest
import torch
from helpers import TINY_TRAIN, run_here

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@requires_gpu
def test_training_on_cuda_writes_its_preview_grid_and_the_export_reads_its_weights_back(tmp_path):
    trained = run_here(*TINY_TRAIN, "--device", "cuda", "--model_path", "m.pt", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert list(tmp_path.glob("m_samples/step_*.png")), sorted(p.name for p in tmp_path.iterdir())
    export = ["--mode", "export", "--device", "cuda", "--model_path", "m.pt", "--format", "safetensors"]
    exported = run_here(*export, "--output", "m.safetensors", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "bit for bit" in exported.stdout
