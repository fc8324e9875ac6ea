"""3-D volumes through the whole tool: the same U-Net code with Conv3d, the same samplers and fused step,
export, training on spheres, sampling to .npz and a slice PNG, and evaluate's sphere metrics.

Specification: the 3-D U-Net keeps its input's shape at 16^3 and 32^3; the cuda implementation (its CPU
kernels) draws the original's volumes bit for bit; activation checkpointing changes memory, not
gradients; an exported 3-D U-Net gives PyTorch's eps through onnxruntime; train -> sample -> evaluate
runs end to end from the command line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import main
from basic_diffusion import UNet, UNetConfig, depth_to_space, sample, space_to_depth, unet_preset
from noise_schedule import NoiseSchedule, ScheduleConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY_3D = dict(
    image_size=8,
    in_channels=1,
    model_channels=8,
    channel_mult=(1, 2),
    num_res_blocks=1,
    attention_resolutions=(4,),
    num_heads=2,
    dropout=0.0,
    norm_groups=4,
    dims=3,
)


@pytest.mark.parametrize("size", [16, 32])
def test_the_3d_unet_keeps_the_volume_shape(size):
    config = unet_preset("small", image_size=size, in_channels=1, dims=3, model_channels=8)
    assert config.attention_resolutions == (4,)  # attention only at 4^3 positions
    model = UNet(config).eval()
    x = torch.randn(2, 1, size, size, size)
    with torch.no_grad():
        assert model(x, torch.tensor([0, 999])).shape == x.shape
    assert isinstance(model.conv_in, torch.nn.Conv3d)


def test_patches_fold_into_channels_and_back_like_pixel_unshuffle():
    images = torch.randn(2, 3, 8, 12)
    folded = space_to_depth(images, 2)
    torch.testing.assert_close(folded, torch.nn.functional.pixel_unshuffle(images, 2), rtol=0, atol=0)
    torch.testing.assert_close(depth_to_space(folded, 2), images, rtol=0, atol=0)
    volumes = torch.randn(2, 1, 4, 8, 4)
    folded = space_to_depth(volumes, 2)  # (2, 8, 2, 4, 2): channel k = the patch voxel (k // 4, k // 2 % 2, k % 2)
    assert folded.shape == (2, 8, 2, 4, 2)
    torch.testing.assert_close(folded[:, 5], volumes[:, 0, 1::2, 0::2, 1::2], rtol=0, atol=0)
    torch.testing.assert_close(depth_to_space(folded, 2), volumes, rtol=0, atol=0)


def test_the_32_voxel_preset_runs_its_unet_on_2_voxel_patches():
    config = unet_preset("small", image_size=32, in_channels=1, dims=3, model_channels=8)
    assert config.patch_size == 2 and config.resolutions == (16, 8, 4)
    assert unet_preset("small", image_size=16, in_channels=1, dims=3).patch_size == 1
    model = UNet(config)
    assert model.conv_in.in_channels == 8 and model.conv_out.out_channels == 8
    with pytest.raises(ValueError, match="after 2-voxel patches"):
        UNetConfig(**{**TINY_3D, "image_size": 10, "patch_size": 2})


def test_the_cuda_implementation_draws_the_original_volumes_on_the_cpu():
    import optimized_diffusion as od

    torch.manual_seed(0)
    model = UNet(UNetConfig(**TINY_3D)).eval()
    for p in model.parameters():  # past the zero initialisation, so eps depends on the input
        p.data.add_(0.05 * torch.randn_like(p))
    schedule = NoiseSchedule(ScheduleConfig(num_timesteps=50))
    for sampler in ("ddpm", "dpm_solver_sde"):
        plan = schedule.make_plan(sampler, sampling_steps=6)
        shape = (2, 1, 8, 8, 8)
        with torch.no_grad():
            reference = sample(model, plan, shape=shape, generator=torch.Generator().manual_seed(1))
            fused = od.FusedSampler(model, plan, shape=shape, precision="fp32")
            drawn = fused(generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(drawn, reference, rtol=0, atol=0)


def test_activation_checkpointing_keeps_the_gradients():
    torch.manual_seed(0)
    model = UNet(UNetConfig(**TINY_3D)).train()
    x, t = torch.randn(2, 1, 8, 8, 8), torch.tensor([3, 700])

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        model.zero_grad()
        model.grad_checkpoint = checkpointed
        (model(x, t) ** 2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    for plain, checkpointed in zip(grads(False), grads(True)):
        torch.testing.assert_close(checkpointed, plain)


@pytest.mark.parametrize(
    "patch_size",
    [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)],  # 26 s an export
)
def test_an_exported_3d_unet_gives_pytorchs_eps_through_onnxruntime(patch_size):
    pytest.importorskip("onnxruntime")
    from ddpm.backends.runtimes import as_onnxruntime

    torch.manual_seed(0)
    model = UNet(
        UNetConfig(**{**TINY_3D, "patch_size": patch_size, "attention_resolutions": (4 // patch_size,)})
    ).eval()
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    runner = as_onnxruntime(model, device=torch.device("cpu"))  # export to ONNX (checked), then a session
    x, t = torch.randn(3, 1, 8, 8, 8), torch.tensor([0, 10, 999])
    with torch.no_grad():
        torch.testing.assert_close(runner(x, t), model(x, t), rtol=1e-4, atol=1e-5)


def test_spheres_train_sample_and_evaluate_from_the_command_line(tmp_path, capsys):
    pytest.importorskip("skimage")
    ckpt = tmp_path / "spheres.pt"
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "spheres",
        "--img_size",
        "8",
        "--model_channels",
        "8",
        "--max_steps",
        "2",
        "--batch_size",
        "4",
        "--timesteps",
        "20",
        "--save_every",
        "0",
        "--sample_every",
        "0",
        "--model_path",
        str(ckpt),
    ]
    assert main.main(train) == 0, capsys.readouterr().err
    assert "spheres volumes (1x8x8x8)" in capsys.readouterr().out
    grid, npz = tmp_path / "v.png", tmp_path / "v.npz"
    args = [
        "--device",
        "cpu",
        "--mode",
        "sample",
        "--model_path",
        str(ckpt),
        "--n_samples",
        "3",
        "--batch_size",
        "2",
        "--sampler",
        "dpm_solver_sde",
        "--sampling_steps",
        "4",
        "--output",
        str(grid),
        "--save_npz",
        str(npz),
    ]
    for implementation in ("original", "cuda"):
        assert main.main([*args, "--implementation", implementation]) == 0, capsys.readouterr().err
        with np.load(npz) as data:
            assert data["images"].shape == (3, 8, 8, 8, 1) and data["images"].dtype == np.uint8
        assert grid.read_bytes()[:4] == b"\x89PNG"
        grid.unlink()
        npz.unlink()
    # Mistakes end in one line: a grid scale for a volume PNG, a new kind of model on --resume.
    assert main.main([*args, "--grid_scale", "2"]) == 2
    assert "--grid_scale" in capsys.readouterr().err and not grid.exists()
    assert main.main([*train, "--resume", "--time_conditioning", "add"]) == 2
    assert "--time_conditioning makes a new model" in capsys.readouterr().err
    assert main.main([*train, "--resume", "--patch_size", "2"]) == 2
    assert "--patch_size makes a new model" in capsys.readouterr().err
    out_json = tmp_path / "e.json"
    evaluate = [
        "--device",
        "cpu",
        "--mode",
        "evaluate",
        "--model_path",
        str(ckpt),
        "--sampler",
        "ddpm,dpm_solver_sde",
        "--sampling_steps",
        "4",
        "--n_samples",
        "6",
        "--json",
        str(out_json),
    ]
    assert main.main(evaluate) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "(ceiling: held-out real volumes)" in out and "(floor: uniform noise)" in out
    result = json.loads(out_json.read_text())
    assert result["metric"] == "voxels" and len(result["rows"]) == 2
    assert result["ceiling"]["iou"] > 0.8 > result["floor"]["iou"]


def test_a_voxel_folder_is_counted_from_its_headers_and_refused_when_it_would_not_fit(tmp_path, monkeypatch):
    from ddpm.data import volumes
    from ddpm.data.datasets import load_images
    from ddpm.util import memory

    np.save(tmp_path / "one.npy", np.zeros((6, 6, 6), dtype=np.float32))
    np.save(tmp_path / "stack.npy", np.ones((3, 6, 6, 6), dtype=np.uint8) * 200)
    assert volumes.count_voxel_volumes(tmp_path) == 4
    data = load_images("voxels", data_dir=tmp_path, image_size=8)
    assert data.images.shape == (4, 1, 8, 8, 8) and data.dims == 3
    monkeypatch.setattr(memory, "available_bytes", lambda device: 1000)  # 4 x 8^3 bytes need 2,048
    with pytest.raises(ValueError, match="voxels images at 1x8x8x8 need"):
        load_images("voxels", data_dir=tmp_path, image_size=8)
