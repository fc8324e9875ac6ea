"""diffusers folders and safetensors files in and out (ddpm/formats/diffusers_io.py, artifacts.py), against diffusers
itself.

diffusers is a test dependency only (the tool never imports it); these tests skip without it.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct

import numpy as np
import pytest
import torch
from helpers import assert_user_error, perturbed_unet, run_here, tiny_unet_config

from basic_diffusion import UNet
from ddpm.backends import artifacts
from ddpm.backends.artifacts import load_model_parts
from ddpm.formats.checkpoints import save_checkpoint
from noise_schedule import NoiseSchedule, ScheduleConfig

diffusers = pytest.importorskip("diffusers", reason="diffusers is the reference here: pip install diffusers")

# UNet2DModel configs equal to this tool's presets and to the published DDPMs' (widths cut where noted).
SMALL = dict(  # the "small" preset at 16x16: 64-128-128, attention at the lowest level, scale-shift
    sample_size=16,
    in_channels=1,
    out_channels=1,
    block_out_channels=(64, 128, 128),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
    attention_head_dim=32,
    resnet_time_scale_shift="scale_shift",
    attn_norm_num_groups=32,
    dropout=0.1,
)
DDPM_CIFAR10 = dict(  # google/ddpm-cifar10-32's config.json (Ho et al. 2020 converted): its TensorFlow details included
    sample_size=32,
    in_channels=3,
    out_channels=3,
    block_out_channels=(128, 256, 256, 256),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=None,
    flip_sin_to_cos=False,
    freq_shift=1,
    norm_eps=1e-6,
    downsample_padding=0,
)
CONDITIONAL = dict(  # 10 classes and the null label
    sample_size=8,
    in_channels=1,
    out_channels=1,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=16,
    norm_num_groups=8,
    num_class_embeds=11,
)


def diffusers_unet(config: dict, *, seed: int = 0):
    """A UNet2DModel with random weights (the zero-initialized output layers too), in eval mode."""
    torch.manual_seed(seed)
    unet = diffusers.UNet2DModel(**config).eval()
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return unet


def save_pipeline(unet, folder, *, num_train_timesteps: int = 1000, prediction_type: str = "epsilon"):
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=num_train_timesteps, prediction_type=prediction_type)
    diffusers.DDPMPipeline(unet=unet, scheduler=scheduler).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("config", [SMALL, DDPM_CIFAR10, CONDITIONAL], ids=["small", "ddpm_cifar10", "conditional"])
def test_imported_unet_predicts_diffusers_own_eps(tmp_path, config, one_thread):
    unet = diffusers_unet(config)
    model, schedule, *_ = load_model_parts(save_pipeline(unet, tmp_path / "m"))
    torch.manual_seed(1)
    x = torch.randn(3, config["in_channels"], config["sample_size"], config["sample_size"])
    for t in ([0, 1, 2], [999, 500, 37]):
        t = torch.tensor(t)
        y = torch.tensor([0, 9, 10]) if config.get("num_class_embeds") else None  # 10: the null label
        with torch.no_grad():
            theirs = unet(x, t, class_labels=y).sample
            ours = model(x, t, y)
        assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (ours - theirs).abs().max()
    assert schedule == ScheduleConfig()  # DDPMScheduler(1000)'s linear 1e-4..0.02


@pytest.mark.parametrize(
    "implementation, prediction_type",
    [("original", "epsilon"), ("cuda", "epsilon"), ("original", "v_prediction"), ("cuda", "sample")],
)
def test_imported_model_samples_as_diffusers_ddpm_and_ddim_loops_do(
    tmp_path, implementation, prediction_type, one_thread
):
    """The same generator gives the same images: x_T first, then one noise tensor per stochastic step. A folder whose
    U-Net predicts v or x_0 imports as such: its output converted as diffusers' schedulers convert it."""
    import basic_diffusion
    import optimized_diffusion

    unet = diffusers_unet(CONDITIONAL | dict(num_class_embeds=None))
    folder = save_pipeline(unet, tmp_path / "m", num_train_timesteps=20, prediction_type=prediction_type)
    model, schedule_config, *_ = load_model_parts(folder)
    assert schedule_config.prediction == {"epsilon": "eps", "v_prediction": "v", "sample": "x0"}[prediction_type]
    schedule = NoiseSchedule(schedule_config)
    shape = (2, 1, 8, 8)
    draw = basic_diffusion.sample if implementation == "original" else optimized_diffusion.sample
    for sampler, scheduler in (("ddpm", diffusers.DDPMScheduler), ("ddim", diffusers.DDIMScheduler)):
        ours = draw(
            model,
            schedule.make_plan(sampler, sampling_steps=20),
            shape=shape,
            generator=torch.Generator().manual_seed(3),
        )
        scheduler = scheduler.from_pretrained(tmp_path / "m" / "scheduler")  # DDIM takes DDPM's config
        scheduler.set_timesteps(20)
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(shape, generator=generator)
        # This tool's DDIM (as improved-diffusion's) takes eps again from the clipped x_0 prediction.
        options = dict(use_clipped_model_output=True) if sampler == "ddim" else {}
        with torch.no_grad():
            for t in scheduler.timesteps:
                x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **options).prev_sample
        assert (ours - x).abs().max() < 1e-4, (sampler, (ours - x).abs().max())


@pytest.mark.parametrize("conditional", [False, True])
def test_our_model_exported_as_diffusers_loads_in_ddpm_pipeline_and_predicts_our_eps(tmp_path, conditional, one_thread):
    config = tiny_unet_config(norm_groups=8, num_classes=3 if conditional else 0)
    model = perturbed_unet(config)
    schedule = ScheduleConfig(kind="cosine", num_timesteps=100)
    artifacts.write_diffusers_folder(model, schedule, tmp_path / "out", source="test")
    pipe = diffusers.DDPMPipeline.from_pretrained(tmp_path / "out")
    unet = diffusers.UNet2DModel.from_pretrained(tmp_path / "out" / "unet").eval()
    x, t = torch.randn(2, 1, 16, 16), torch.tensor([5, 90])
    y = torch.tensor([0, 3]) if conditional else None  # 3: the null label
    with torch.no_grad():
        ours = model(x, t, y)
        for theirs in (pipe.unet.eval()(x, t, class_labels=y).sample, unet(x, t, class_labels=y).sample):
            assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()
    ac = NoiseSchedule(schedule).alphas_cumprod.float()
    assert torch.allclose(pipe.scheduler.alphas_cumprod, ac, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("conditional", [False, True])
def test_the_benchmarks_diffusers_row_runs_diffusers_unet_on_our_weights(conditional, one_thread):
    """benchmark --rows diffusers: diffusers' own UNet2DModel, built in memory with this model's weights, predicts
    this model's eps (so the row times the equal network); bf16 casts its weights, the eps stays float32."""
    from ddpm.formats.diffusers_io import DiffusersUNet

    model = perturbed_unet(tiny_unet_config(norm_groups=8, num_classes=3 if conditional else 0))
    x, t = torch.randn(2, 1, 16, 16), torch.tensor([5, 90])
    y = torch.tensor([0, 3]) if conditional else None
    with torch.no_grad():
        ours, theirs = model(x, t, y), DiffusersUNet(model)(x, t, y)
        low = DiffusersUNet(model, dtype=torch.bfloat16)
        assert isinstance(low.unet, diffusers.UNet2DModel) and next(low.unet.parameters()).dtype == torch.bfloat16
        assert low(x, t, y).dtype == torch.float32
    assert (ours - theirs).abs().max() <= 1e-5 * ours.abs().max()


def test_import_export_import_is_exact(tmp_path, one_thread):
    save_pipeline(diffusers_unet(DDPM_CIFAR10 | dict(block_out_channels=(32, 64, 64, 64))), tmp_path / "a")
    first = artifacts.read_diffusers_folder(tmp_path / "a")
    model, schedule, *_ = load_model_parts(tmp_path / "a")
    artifacts.write_diffusers_folder(model, schedule, tmp_path / "b", source="test")
    second = artifacts.read_diffusers_folder(tmp_path / "b")
    assert first["model_config"] == second["model_config"] and first["schedule_config"] == second["schedule_config"]
    assert first["ema"].keys() == second["ema"].keys()
    assert all(torch.equal(first["ema"][k], second["ema"][k]) for k in first["ema"])


@pytest.mark.parametrize(
    "implementation",
    # Slow: onnxruntime exports the U-Net in memory (10 s on 2 cores), as from a checkpoint: tests/latent's
    # conditional model draws through it in the default run.
    ["cuda", pytest.param("onnxruntime", marks=pytest.mark.slow)],
)
def test_cli_exports_diffusers_and_safetensors_that_sample_the_checkpoints_images(tmp_path, one_thread, implementation):
    config = tiny_unet_config(norm_groups=8)
    model = perturbed_unet(config)
    state = {
        "format_version": 1,
        "model_config": config.to_dict(),
        "schedule_config": vars(ScheduleConfig(num_timesteps=50)),
        "model": model.state_dict(),
        "ema": model.state_dict(),
        "step": 5,
    }
    save_checkpoint(tmp_path / "m.pt", state)
    for fmt in ("diffusers", "safetensors"):
        result = run_here("--mode", "export", "--format", fmt, "--model_path", "m.pt", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "the same weights, bit for bit" in result.stdout
    draw = [
        "--mode",
        "sample",
        "--sampler",
        "ddim",
        "--sampling_steps",
        "4",
        "--n_samples",
        "3",
        "--seed",
        "7",
        "--no_grid",
    ]
    images = {}
    for source in ("m.pt", "m_diffusers", "m.safetensors"):
        result = run_here(*draw, "--model_path", source, "--save_npz", f"{source.replace('.', '_')}.npz", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        with np.load(tmp_path / f"{source.replace('.', '_')}.npz") as f:
            images[source] = f[f.files[0]]
    assert (images["m.pt"] == images["m_diffusers"]).all() and (images["m.pt"] == images["m.safetensors"]).all()
    # Every implementation takes the folder: the fused cuda runner, or onnxruntime (exported in memory), draws the same
    # images to a level.
    result = run_here(
        *draw, "--model_path", "m_diffusers", "--implementation", implementation, "--save_npz", "ort.npz", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    with np.load(tmp_path / "ort.npz") as f:
        assert np.abs(f[f.files[0]].astype(int) - images["m.pt"].astype(int)).max() <= 1
    # The folder and the file are inputs: nothing may be written over them (a folder only whole, with --overwrite).
    assert_user_error(
        run_here(
            "--mode",
            "export",
            "--format",
            "diffusers",
            "--model_path",
            "m_diffusers",
            "--output",
            "m_diffusers",
            cwd=tmp_path,
        ),
        "is the model --model_path names",
    )
    assert_user_error(
        run_here(*draw, "--model_path", "m.safetensors", "--no_ema", "--save_npz", "x.npz", cwd=tmp_path),
        "drop --no_ema",
    )


def test_models_diffusers_cannot_represent_are_refused_in_one_line(tmp_path):
    state = {"format_version": 1, "schedule_config": vars(ScheduleConfig(num_timesteps=50)), "step": 0}
    model = UNet(tiny_unet_config())  # 32 groups over 16 channels: this U-Net uses 16, diffusers would fail
    save_checkpoint(
        tmp_path / "m.pt",
        state | {"model_config": model.config.to_dict(), "model": model.state_dict(), "ema": model.state_dict()},
    )
    result = run_here("--mode", "export", "--format", "diffusers", "--model_path", "m.pt", cwd=tmp_path)
    assert_user_error(result, "norm groups do not divide the widths")
    assert not (tmp_path / "m_diffusers").exists()


def _pipeline_with(tmp_path, *, unet_changes: dict | None = None, scheduler_changes: dict | None = None):
    folder = save_pipeline(diffusers_unet(CONDITIONAL), tmp_path / "m")
    for path, changes in (
        (folder / "unet" / "config.json", unet_changes),
        (folder / "scheduler" / "scheduler_config.json", scheduler_changes),
    ):
        if changes:
            path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return folder


@pytest.mark.parametrize(
    "unet_changes, scheduler_changes, named",
    [
        ({"down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"]}, None, "CrossAttnDownBlock2D"),
        ({"time_embedding_type": "fourier"}, None, "time_embedding_type='fourier'"),
        ({"up_block_types": ["UpBlock2D", "UpBlock2D"]}, None, "attention differs between the down and up blocks"),
        ({"resnet_time_scale_shift": "scale_shift"}, None, "attn_norm_num_groups is unset"),
        ({"cross_attention_dim": 768}, None, "'cross_attention_dim'"),
        ({"out_channels": 2}, None, "out_channels 2 differs"),
        (None, {"prediction_type": "flow_prediction"}, "prediction_type='flow_prediction'"),
        (None, {"beta_schedule": "scaled_linear"}, "beta_schedule='scaled_linear'"),
    ],
)
def test_configs_this_unet_cannot_compute_are_refused_naming_the_setting(
    tmp_path, unet_changes, scheduler_changes, named
):
    folder = _pipeline_with(tmp_path, unet_changes=unet_changes, scheduler_changes=scheduler_changes)
    result = run_here(
        "--mode", "sample", "--model_path", str(folder), "--n_samples", "1", "--output", "s.png", cwd=tmp_path
    )
    assert_user_error(result, named)
    assert not (tmp_path / "s.png").exists()


class _Payload:
    def __reduce__(self):
        return (open, ("/tmp/should-not-exist-ddpm-payload", "w"))


def test_hostile_and_corrupt_weight_files_are_refused_in_one_line(tmp_path, one_thread):
    folder = _pipeline_with(tmp_path)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    good = weights.read_bytes()
    draw = ["--mode", "sample", "--model_path", str(folder), "--n_samples", "1", "--output", "s.png"]
    (header_len,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + header_len])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [s * 4 for s in header[name]["shape"]]  # a header lying about a tensor's shape
    lying = json.dumps(header).encode()
    cases = {
        "lying shapes": struct.pack("<Q", len(lying)) + lying + good[8 + header_len :],
        "truncated": good[: len(good) // 2],
        "header past the end": struct.pack("<Q", 10**12) + good[8:],
        "text": b"this is not a safetensors file",
    }
    for data in cases.values():
        weights.write_bytes(data)
        result = run_here(*draw, cwd=tmp_path)
        assert_user_error(result, str(weights))
    weights.unlink()  # a .bin pickle whose unpickling would run code: refused by weights_only, nothing runs
    (folder / "unet" / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps({"conv_in.weight": _Payload()}))
    assert_user_error(run_here(*draw, cwd=tmp_path), "diffusion_pytorch_model.bin")
    assert not __import__("os").path.exists("/tmp/should-not-exist-ddpm-payload")
    assert not (tmp_path / "s.png").exists()


def test_fine_tuning_starts_from_a_diffusers_folders_weights_and_schedule(tmp_path, one_thread):
    """--init_from: a new run with the folder's U-Net, schedule and weights (here one step at a
    learning rate of 1e-12, so the checkpoint holds them to 1e-7), the data and recipe from the flags."""
    unet = diffusers_unet(CONDITIONAL | dict(num_class_embeds=None))
    save_pipeline(unet, tmp_path / "m", num_train_timesteps=50)
    imported = artifacts.read_diffusers_folder(tmp_path / "m")
    result = run_here(
        "--mode",
        "train",
        "--dataset",
        "digits",
        "--init_from",
        "m",
        "--max_steps",
        "1",
        "--lr",
        "1e-12",
        "--batch_size",
        "4",
        "--sample_every",
        "0",
        "--model_path",
        "ft.pt",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "ft.pt", weights_only=True)
    assert state["model_config"] == imported["model_config"] and state["schedule_config"] == imported["schedule_config"]
    for weights in ("model", "ema"):
        assert all(torch.allclose(state[weights][k], imported["ema"][k], atol=1e-7) for k in imported["ema"])
    # The file's model is the whole model: flags describing another are refused, as is --resume with it.
    for extra, named in (
        (["--model_channels", "64"], "--model_channels describes a new model"),
        (["--resume"], "choose one"),
    ):
        args = ["--mode", "train", "--dataset", "digits", "--init_from", "m", "--model_path", "ft2.pt", *extra]
        assert_user_error(run_here(*args, cwd=tmp_path), named)


def test_a_v_student_exported_as_diffusers_keeps_its_prediction_type_and_recipe(tmp_path, one_thread):
    config = tiny_unet_config(norm_groups=8)
    schedule = ScheduleConfig(
        num_timesteps=100,
        prediction="v",
        student_sampler="consistency",
        student_timesteps=(99, 49),
        folded_guidance=0.0,
    )
    artifacts.write_diffusers_folder(perturbed_unet(config), schedule, tmp_path / "out", source="test")
    scheduler = diffusers.DDPMScheduler.from_pretrained(tmp_path / "out" / "scheduler")
    assert scheduler.config.prediction_type == "v_prediction"
    _, loaded, *_ = load_model_parts(tmp_path / "out")
    assert loaded.beta_end == pytest.approx(schedule.beta_end, rel=1e-12)  # through diffusers' linear endpoints
    assert dataclasses.replace(loaded, beta_end=schedule.beta_end) == schedule
