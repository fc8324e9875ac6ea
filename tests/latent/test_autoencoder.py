"""The first stage of latent diffusion: the KL autoencoder, its training mode, its checkpoint and latents.

Specification: the encoder pads to an even latent side and the decoder crops back (28x28 -> 8x8,
32x32x3 -> 8x8, 8x8 -> 4x4 with factor 2); a hundred steps on the offline digits reconstruct
held-out digits better than the bilinear baseline through the latent's grid; the latent scale gives
unit-variance latents on the training set; the latent decoder is decode(z / scale) clamped, and traces;
load_autoencoder refuses anything but a valid autoencoder checkpoint in one line naming the file;
--mode train_autoencoder writes the checkpoint and the PNG, and never replaces a checkpoint without --overwrite.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from helpers import TINY_TRAIN, assert_user_error, run_here
from PIL import Image

from ddpm.cli import resolve
from ddpm.data.datasets import load_images
from ddpm.kernels import ops
from ddpm.latent.autoencoder import (
    Autoencoder,
    AutoencoderConfig,
    LatentDecoder,
    ResnetBlock,
    autoencoder_loss,
    encode_images,
    load_autoencoder,
    requested_config,
    to_unit_range,
)
from ddpm.requests import AutoencoderTrainRequest
from ddpm.training.autoencoder_trainer import psnr_ssim, split_heldout, train_autoencoder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY_AUTOENCODER = [
    "--mode",
    "train_autoencoder",
    "--dataset",
    "digits",
    "--max_steps",
    "5",
    "--batch_size",
    "16",
    "--device",
    "cpu",
]


@pytest.mark.parametrize(
    "size,channels,factor,padded,latent",
    [(28, 1, 4, 32, (4, 8, 8)), (32, 3, 4, 32, (4, 8, 8)), (8, 1, 2, 8, (4, 4, 4)), (16, 1, 4, 16, (4, 4, 4))],
)
def test_the_encoder_pads_to_an_even_latent_and_the_decoder_crops_back(size, channels, factor, padded, latent):
    config = AutoencoderConfig(image_size=size, in_channels=channels)
    assert (config.downsample, config.padded_size, config.latent_shape) == (factor, padded, latent)
    model = Autoencoder(config).eval()
    x = torch.rand(2, channels, size, size) * 2 - 1
    with torch.no_grad():
        mean, logvar = model.encode(x)
        assert mean.shape == logvar.shape == (2, *latent)
        assert model.decode(mean).shape == x.shape


def test_the_fused_norms_the_cpu_trainer_swaps_in_give_pytorchs_outputs_and_gradients():
    if not ops.norm_training_available():  # asked here, not while collecting: every worker would load the extension
        pytest.skip("the extension is not built with the norms' backward")
    torch.manual_seed(0)
    config = AutoencoderConfig(image_size=12, in_channels=1, base_channels=8, latent_channels=2)
    plain = Autoencoder(config).to(memory_format=torch.channels_last)
    fused = copy.deepcopy(plain)
    blocks = sum(1 for m in fused.modules() if isinstance(m, ResnetBlock))
    assert ops.use_fused_norms(fused) == blocks > 0  # every residual block's two norms
    calls = []
    for block in (m for m in fused.modules() if isinstance(m, ResnetBlock)):
        block.norm_act = lambda norm, h, swapped=block.norm_act: calls.append(norm) or swapped(norm, h)
    x = torch.rand(4, 1, 12, 12).mul(2).sub(1).contiguous(memory_format=torch.channels_last)
    results = []
    for model in (plain, fused):
        mean, logvar = model.encode(x)
        out = model.decode(mean + 0.1 * logvar)
        (out.square().sum() + mean.sum()).backward()
        results.append((out, [p.grad for p in model.parameters()]))
    (out_plain, grads_plain), (out_fused, grads_fused) = results
    torch.testing.assert_close(out_fused, out_plain, rtol=1e-4, atol=1e-5)
    for g_fused, g_plain in zip(grads_fused, grads_plain):
        torch.testing.assert_close(g_fused, g_plain, rtol=1e-3, atol=1e-4)
    assert len(calls) == 2 * blocks  # the blocks' forward went through the swapped function
    assert fused.state_dict().keys() == plain.state_dict().keys()


def test_the_28_pixel_autoencoder_is_small():
    model = Autoencoder(AutoencoderConfig(image_size=28, in_channels=1))
    assert sum(p.numel() for p in model.parameters()) < 400_000


def test_the_loss_is_l1_plus_the_weighted_kl_to_a_standard_normal():
    x, x_hat = torch.zeros(2, 1, 4, 4), torch.full((2, 1, 4, 4), 0.5)
    mean, logvar = torch.ones(2, 3, 1, 1), torch.zeros(2, 3, 1, 1)  # KL per image: 3 * 0.5 * 1^2 = 1.5
    loss, l1, kl = autoencoder_loss(x, x_hat, mean, logvar, kl_weight=0.16)
    assert (l1.item(), kl.item()) == (0.5, 1.5)
    assert loss.item() == pytest.approx(0.5 + 0.16 * 1.5 / 16)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"extra": 1}, "unknown key 'extra'"),
        ({"kl_weight": None}, "kl_weight must be a finite number"),
        ({"downsample": 3}, "must be 2, 4 or 8"),
        ({"in_channels": 2}, "channels must be 1"),
        ({"latent_channels": 1.0}, "latent_channels must be an integer"),
    ],
)
def test_a_config_from_a_file_is_checked(change, message):
    data = {**AutoencoderConfig(image_size=8, in_channels=1).to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        AutoencoderConfig.from_dict(data)


def test_a_config_from_a_file_names_what_it_lacks_and_round_trips():
    config = AutoencoderConfig(image_size=28, in_channels=1, kl_weight=1e-4)
    assert AutoencoderConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="missing base_channels"):
        AutoencoderConfig.from_dict({k: v for k, v in config.to_dict().items() if k != "base_channels"})


def test_psnr_and_ssim_match_their_definitions():
    truth = torch.randint(0, 256, (3, 1, 8, 8), dtype=torch.uint8)
    noisy = (truth.int() + torch.randint(-9, 10, truth.shape)).clamp(0, 255).to(torch.uint8)
    psnr, ssim = psnr_ssim(noisy, truth)
    mse = ((noisy.double() - truth.double()) / 255).square().flatten(1).mean(1)
    assert psnr == pytest.approx(float((10 * torch.log10(1 / mse)).mean()), rel=1e-9)
    assert psnr_ssim(truth, truth) == pytest.approx((100.0, 1.0))  # an exact copy: PSNR capped, SSIM 1
    assert 0 < ssim < 1


# ----- a trained autoencoder ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    work = tmp_path_factory.mktemp("autoencoder")
    request = AutoencoderTrainRequest(
        device=torch.device("cpu"),
        checkpoint=str(work / "ae.pt"),
        reconstructions=str(work / "ae_reconstructions.png"),
        overwrite=False,
        dataset="digits",
        data_dir=str(work),
        image_size=8,
        channels=1,
        max_steps=100,  # held-out PSNR 17.5 dB, 5.6 above the bilinear baseline (200 steps: 22 dB)
        batch_size=32,
        lr=2e-3,
        base_channels=16,
    )
    metrics = train_autoencoder(request, progress=False)
    return request, metrics


def test_reconstructions_beat_the_bilinear_baseline_on_held_out_digits(trained):
    _, metrics = trained
    scores = metrics["scores"]
    assert metrics["heldout_images"] == 180 and metrics["train_images"] == 1617  # a fixed 10% never trained on
    autoencoder, baseline = scores["autoencoder"], scores["bilinear_latent_side"]
    assert baseline["side"] == 4 and baseline["numbers"] == 16 and autoencoder["numbers"] == 64
    assert autoencoder["psnr"] > baseline["psnr"] + 3 and autoencoder["ssim"] > baseline["ssim"]


def test_the_checkpoint_recomputes_its_reported_psnr(trained):
    request, metrics = trained
    loaded = load_autoencoder(request.checkpoint, device="cpu")
    _, heldout, _ = split_heldout(
        load_images("digits", data_dir=request.data_dir, image_size=8), data_dir=request.data_dir
    )
    with torch.no_grad():
        images = loaded.decoder()(encode_images(loaded, heldout))
    recon = ((images + 1) / 2 * 255 + 0.5).clamp(0, 255).to(torch.uint8)
    assert psnr_ssim(recon, heldout)[0] == pytest.approx(metrics["scores"]["autoencoder"]["psnr"], abs=0.05)


def test_the_latent_scale_gives_unit_variance_on_the_training_set(trained):
    request, _ = trained
    loaded = load_autoencoder(request.checkpoint, device="cpu")
    train, _, _ = split_heldout(
        load_images("digits", data_dir=request.data_dir, image_size=8), data_dir=request.data_dir
    )
    latents = encode_images(loaded, train.images, batch_size=100)
    assert latents.shape == (1617, 4, 4, 4) and latents.dtype == torch.float32
    assert abs(float(latents.std()) - 1.0) < 0.05
    with torch.no_grad():
        unscaled = loaded.model.encode(to_unit_range(train.images[:5]))[0]
    torch.testing.assert_close(latents[:5], unscaled * loaded.latent_scale)


def test_the_latent_decoder_is_decode_of_unscaled_latents_clamped_and_traces(trained):
    request, _ = trained
    loaded = load_autoencoder(request.checkpoint, device="cpu")
    z = torch.randn(3, 4, 4, 4) * 3
    decoder = LatentDecoder(loaded.model, loaded.latent_scale).eval()
    with torch.no_grad():
        expected = loaded.model.decode(z / loaded.latent_scale).clamp(-1, 1)
        torch.testing.assert_close(decoder(z), expected)
        traced = torch.jit.trace(decoder, torch.zeros(1, 4, 4, 4))
        torch.testing.assert_close(traced(z), expected)  # another batch size: nothing fixed at trace time


def test_the_reconstructions_png_shows_originals_above_reconstructions(trained):
    request, _ = trained
    picture = np.asarray(Image.open(request.reconstructions))
    assert picture.shape == ((2 * 10 + 2) * 8, (16 * 10 + 2) * 8, 3)  # 2 rows of 16 tiles, 8 px + 2 padding, x8


# ----- refusals ----------------------------------------------------------------------------------
def refused_in_one_line(path, match):
    with pytest.raises(ValueError, match=match) as info:
        load_autoencoder(path, device="cpu")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_load_refuses_a_missing_file_and_garbage(tmp_path):
    refused_in_one_line(tmp_path / "none.pt", "does not exist")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint" * 10)
    refused_in_one_line(tmp_path / "junk.pt", "corrupt")


def test_load_refuses_a_ddpm_checkpoint(tmp_path):
    flags = ["--img_size", "8", "--max_steps", "1", "--timesteps", "10", "--model_path", "ddpm.pt", "--device", "cpu"]
    result = run_here(*TINY_TRAIN, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    refused_in_one_line(tmp_path / "ddpm.pt", "is a DDPM checkpoint")


def test_load_refuses_weights_that_do_not_fit_the_config_and_bad_entries(trained, tmp_path):
    request, _ = trained
    state = torch.load(request.checkpoint, weights_only=True)
    for name, change, match in [
        ("shapes.pt", {"config": {**state["config"], "base_channels": 32}}, "do not match its model config"),
        ("scale.pt", {"latent_scale": math.nan}, "latent scale must be a finite positive number"),
        ("kind.pt", {"kind": "engine"}, "not an autoencoder checkpoint"),
        ("format.pt", {"format": 2}, "has format 2"),
        ("keys.pt", {"optimizer": {}}, "unknown entries"),
    ]:
        torch.save({**state, **change}, tmp_path / name)
        refused_in_one_line(tmp_path / name, match)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--dataset", "spheres"], "is for images"),
        (["--precision", "bf16"], "trains in fp32"),
        (["--model_path", "ae.onnx"], "must name a .pt"),
        (["--img_size", "2"], "image_size must be an integer between 4"),
    ],
)
def test_flag_mistakes_are_refused_before_any_work(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve.parse([*TINY_AUTOENCODER, *flags])


def test_the_cli_trains_and_refuses_to_replace_a_checkpoint_without_overwrite(tmp_path):
    _, request = resolve.parse(["--mode", "train_autoencoder", "--dataset", "digits", "--device", "cpu"])
    assert (request.checkpoint, request.reconstructions) == (
        "checkpoints/digits_autoencoder.pt",
        "checkpoints/digits_autoencoder_reconstructions.png",
    )
    assert (request.batch_size, request.lr, request.image_size, requested_config(request).latent_shape) == (
        64,
        1e-3,
        8,
        (4, 4, 4),
    )
    result = run_here(*TINY_AUTOENCODER, "--model_path", "ae/d.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    checkpoint = tmp_path / "ae" / "d.pt"
    assert checkpoint.is_file() and (tmp_path / "ae" / "d_reconstructions.png").is_file()
    assert "PSNR" in result.stdout and load_autoencoder(checkpoint, device="cpu").config.latent_shape == (4, 4, 4)
    before = checkpoint.read_bytes()
    assert_user_error(run_here(*TINY_AUTOENCODER, "--model_path", "ae/d.pt", cwd=tmp_path), "--overwrite")
    assert checkpoint.read_bytes() == before
    assert (
        run_here(*TINY_AUTOENCODER, "--model_path", "ae/d.pt", "--overwrite", "--seed", "1", cwd=tmp_path).returncode
        == 0
    )
    assert checkpoint.read_bytes() != before


def test_the_latent_decoder_exports_to_onnx_and_matches_pytorch():
    """A 28x28 decoder (its output cropped from 32x32) through torch.onnx's exporter and onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    decoder = LatentDecoder(Autoencoder(AutoencoderConfig(image_size=28, in_channels=1)), latent_scale=0.7).eval()
    program = torch.onnx.export(
        decoder,
        (torch.zeros(2, 4, 8, 8),),
        input_names=["z"],
        output_names=["images"],
        opset_version=21,
        dynamo=True,
        dynamic_shapes={"z": {0: torch.export.Dim("batch", min=1, max=64)}},
        verbose=False,
    )
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    z = torch.randn(3, 4, 8, 8)
    with torch.no_grad():
        expected = decoder(z)
    got = torch.from_numpy(session.run(None, {"z": z.numpy()})[0])
    assert got.shape == (3, 1, 28, 28)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
