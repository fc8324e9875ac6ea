"""The training benchmark's peers (the default row, diffusers' UNet2DModel and loop) and its compile rows' reports."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_here, tiny_unet_config

from basic_diffusion import UNet
from ddpm.benchmarks import training_bench
from ddpm.kernels import ops
from ddpm.training import winograd
from ddpm.training.winograd import weight_grad_available
from noise_schedule import ScheduleConfig


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "native_bf16, side, precision, capability, mixed, convs",
    [
        # 3x3 convolutions in Winograd's domain, 1x1 as GEMMs, the thin first and last directly
        ("0", 28, "fp32", "AVX2", False, "+Winograd+1x1 GEMMs+thin convs direct"),
        (
            "0",
            28,
            "fp32",
            "AVX512",
            False,
            "+Winograd+1x1 GEMMs+thin convs direct",
        ),  # AVX-512's (1x1 GEMMs on small maps)
        ("1", 28, "bf16", "AVX512", False, ""),  # AMX: oneDNN's bf16 convolutions
        ("1", 28, "bf16", "AVX512", True, "+Winograd"),  # AVX512-BF16 alone: fp32 Winograd on bf16 activations
        ("1", 8, "fp32", "AVX512", True, "+Winograd+1x1 GEMMs+thin convs direct"),  # the latent step's U-Net
        ("1", 8, "fp32", "AVX2", False, "+Winograd+1x1 GEMMs+thin convs direct"),
        ("0", 28, "fp32", "DEFAULT", False, ""),
    ],
)
def test_the_default_row_trains_in_the_precision_and_kernels_train_would_pick(
    monkeypatch, native_bf16, side, precision, capability, mixed, convs
):
    monkeypatch.setenv("DDPM_NATIVE_BF16", native_bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(winograd, "mixed_is_fast", lambda: mixed)
    variants = training_bench.training_variants(torch.device("cpu"), pixels=side * side, side=side)
    rows = {key: (name, fields) for key, name, fields in variants}
    name, fields = rows["default"]
    assert fields["precision"] == precision and not fields["compile"]
    # The CPU trains channels-last in fp32, and in bf16 where the extension's fused norms train it.
    fused = ops.norm_training_available()
    layout = "+channels-last" + ("+fused norms" if fused else "") if precision == "fp32" or fused else ""
    layout += convs if weight_grad_available() else ""
    assert name == f"default: {precision}{layout} eager"
    assert {"default", "diffusers"} <= set(training_bench.variant_keys())


def test_the_diffusers_row_trains_a_unet2dmodel_with_exactly_our_parameters():
    pytest.importorskip("diffusers")
    from ddpm.data.datasets import ImageSet

    config = tiny_unet_config(dropout=0.0, norm_groups=8)  # diffusers: groups dividing every width
    images = ImageSet("random", torch.randint(0, 256, (8, 1, 16, 16), dtype=torch.uint8))
    trainer = training_bench.DiffusersTrainer(
        config, ScheduleConfig(num_timesteps=50), images=images, device=torch.device("cpu"), seed=0, batch_size=4
    )
    # diffusers_io maps every weight one to one (its attention's 1x1 convolutions are diffusers' linear layers).
    assert _count(trainer.model) == _count(UNet(config))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses = [trainer.train_step() for _ in range(2)]
    assert all(0.0 < loss < 10.0 for loss in losses)  # the noise MSE of an untrained U-Net: about 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # AdamW stepped
    assert trainer.step == 2


def test_a_tiny_benchmark_writes_the_peer_rows_into_its_json(tmp_path):
    pytest.importorskip("diffusers")
    cmd = "--mode benchmark --bench training --device cpu --img_size 8 --channels 1 --model_channels 16"
    cmd += " --num_res_blocks 1 --batch_size 4 --train_steps 2 --warmup 1 --rows default,diffusers --json t.json"
    result = run_here(*cmd.split(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "t.json").read_text())["training_rows"]
    assert [r["key"] for r in rows] == ["fp32", "default", "diffusers"]
    for r in rows:
        assert r["status"] == "ok", r["reason"]
        assert r["images_per_s"] == pytest.approx(4 * 1000 / r["ms_per_step"])
        assert r["first_step_s"] > 0
    assert "1st step s" in result.stdout


def test_a_compile_row_that_cannot_compile_gives_its_reason_not_eager_time(monkeypatch):
    class Refusing(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError("cannot determine truth value of Relational: 64*s0*s53 < 64\nthe rest of it")

    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: Refusing())
    config = tiny_unet_config(image_size=8)
    rows = training_bench.time_variants(
        config,
        ScheduleConfig(num_timesteps=50),
        device=torch.device("cpu"),
        batch_size=4,
        steps=1,
        warmup=1,
        seed=0,
        rows="fp32_compile",
        progress=lambda line: None,
    )
    assert [r["key"] for r in rows] == ["fp32", "fp32_compile"]
    assert rows[0]["status"] == "ok" and rows[0]["first_step_s"] > 0
    failed = rows[1]
    assert failed["status"] == "failed" and "images_per_s" not in failed
    assert failed["reason"] == "RuntimeError: cannot determine truth value of Relational: 64*s0*s53 < 64"
