"""Latent diffusion through the whole tool: a U-Net trained on an autoencoder's latents, sampled and
decoded by each implementation, and the link between the two files.

Specification: latent train -> sample writes images of the autoencoder's size (not latents) and every
implementation that runs latent models draws the same images; the decoder run by onnxruntime matches
PyTorch's; a latent model refuses an autoencoder that is not the one it was trained with, or a missing
one, in one line and accepts --autoencoder pointing at the right file; a U-Net of latent channels with
no autoencoder is refused; the latents are fed to training as stored (not rescaled, not flipped); an
exported latent model (ONNX, TorchScript) carries its decoder beside it, draws the checkpoint's images, and
refuses a decoder file that is not the one it names.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import main
from autoencoder import Autoencoder, AutoencoderConfig, checkpoint_state
from safe_files import atomic_write

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

AE_CONFIG = AutoencoderConfig(image_size=8, in_channels=1, latent_channels=2, downsample=2, base_channels=8)


def write_autoencoder(path, *, seed: int = 0, latent_scale: float = 1.5) -> None:
    torch.manual_seed(seed)
    model = Autoencoder(AE_CONFIG)
    state = checkpoint_state(model, latent_scale=latent_scale, dataset="digits", metrics={}, step=0)
    atomic_write(path, lambda f: torch.save(state, f))


@pytest.fixture(scope="module")
def latent_model(tmp_path_factory):
    """An autoencoder file and a latent DDPM trained two steps on its latents of the offline digits."""
    folder = tmp_path_factory.mktemp("latent")
    write_autoencoder(folder / "ae.pt")
    train = ["--device", "cpu", "--mode", "train", "--dataset", "digits", "--autoencoder", str(folder / "ae.pt"),
             "--model_channels", "8", "--num_res_blocks", "1", "--max_steps", "2", "--batch_size", "8",
             "--timesteps", "20", "--save_every", "0", "--sample_every", "0", "--model_path", str(folder / "lat.pt")]  # fmt: skip
    assert main.main(train) == 0
    return folder


def sample_args(folder, *extra: str) -> list[str]:
    return ["--device", "cpu", "--mode", "sample", "--model_path", str(folder / "lat.pt"), "--n_samples", "3",
            "--sampler", "dpm_solver_sde", "--sampling_steps", "3", "--output", str(folder / "s.png"),
            "--save_npz", str(folder / "s.npz"), *extra]  # fmt: skip


def test_a_latent_model_draws_decoded_images_alike_in_every_implementation(latent_model, capsys):
    pytest.importorskip("onnxruntime")
    drawn = {}
    for implementation in ("original", "cuda", "onnxruntime"):
        assert main.main(sample_args(latent_model, "--implementation", implementation)) == 0, capsys.readouterr().err
        with np.load(latent_model / "s.npz") as data:
            drawn[implementation] = data["images"].astype(int)
        assert (latent_model / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn["original"].shape == (3, 8, 8, 1)  # the autoencoder's images, not its 2x4x4 latents
    for implementation in ("cuda", "onnxruntime"):
        assert np.abs(drawn[implementation] - drawn["original"]).max() <= 1  # uint8 levels
    assert main.main(sample_args(latent_model, "--implementation", "tensorrt", "--device", "cpu")) == 2
    assert "\n" not in capsys.readouterr().err.strip()


def test_a_latent_model_never_clips_its_unit_variance_latents(latent_model, capsys):
    drawn = []
    for extra in ((), ("--no_clip",)):
        assert main.main(sample_args(latent_model, *extra)) == 0, capsys.readouterr().err
        with np.load(latent_model / "s.npz") as data:
            drawn.append(data["images"])
    np.testing.assert_array_equal(drawn[0], drawn[1])


def test_the_autoencoder_is_an_input_a_training_run_cannot_overwrite(latent_model, tmp_path, capsys):
    autoencoder = tmp_path / "ae.pt"
    shutil.copy(latent_model / "ae.pt", autoencoder)
    before = autoencoder.read_bytes()
    train = ["--device", "cpu", "--mode", "train", "--dataset", "digits", "--autoencoder", str(autoencoder),
             "--model_path", str(autoencoder), "--overwrite", "--max_steps", "1"]  # fmt: skip
    assert main.main(train) == 2
    assert "--autoencoder" in capsys.readouterr().err and autoencoder.read_bytes() == before
    # An autoencoder whose latents the U-Net preset cannot halve twice is refused before any data is read.
    assert main.main(["--mode", "train_autoencoder", "--dataset", "mnist", "--downsample", "2",
                      "--model_path", str(tmp_path / "m.pt"), "--data_dir", str(tmp_path / "none")]) == 2  # fmt: skip
    assert "14x14 latent" in capsys.readouterr().err


def test_the_decoder_run_by_onnxruntime_matches_pytorch(tmp_path):
    pytest.importorskip("onnxruntime")
    from latents import load_first_stage
    from runtimes import OnnxRuntimeDecoder

    write_autoencoder(tmp_path / "ae.pt")
    stage, _ = load_first_stage(tmp_path / "ae.pt", device=torch.device("cpu"))
    runner = OnnxRuntimeDecoder.exported(
        stage.decoder, latent_shape=stage.latent_shape, image_shape=stage.image_shape, device=torch.device("cpu"), opset=21
    )
    z = torch.randn(5, *stage.latent_shape, generator=torch.Generator().manual_seed(0))  # another batch than the export's
    with torch.no_grad():
        torch.testing.assert_close(runner(z), stage.decoder(z), rtol=1e-4, atol=1e-5)


def test_another_or_a_missing_autoencoder_is_refused_in_one_line(latent_model, tmp_path, capsys):
    model = latent_model / "lat.pt"
    moved = tmp_path / "lat.pt"
    shutil.copy(model, moved)
    shutil.copy(latent_model / "ae.pt", tmp_path / "right.pt")
    write_autoencoder(tmp_path / "other.pt", seed=1)  # the same shapes, other weights
    args = ["--device", "cpu", "--mode", "sample", "--model_path", str(moved), "--n_samples", "2", "--sampling_steps", "2",
            "--sampler", "ddim", "--output", str(tmp_path / "x.png")]  # fmt: skip
    assert main.main([*args, "--autoencoder", str(tmp_path / "other.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "another autoencoder" in err and "\n" not in err
    assert main.main([*args, "--autoencoder", str(tmp_path / "missing.pt")]) == 2
    assert "--autoencoder" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
    assert main.main([*args, "--autoencoder", str(tmp_path / "right.pt")]) == 0, capsys.readouterr().err
    assert (tmp_path / "x.png").is_file()


def test_a_latent_unet_without_an_autoencoder_is_refused(latent_model, tmp_path, capsys):
    from checkpoints import load_checkpoint, save_checkpoint
    from checkpoints import LINK_KEY

    state = load_checkpoint(latent_model / "lat.pt")
    del state[LINK_KEY]
    save_checkpoint(tmp_path / "orphan.pt", state)
    args = ["--device", "cpu", "--mode", "sample", "--model_path", str(tmp_path / "orphan.pt"), "--output", str(tmp_path / "x.png")]
    assert main.main(args) == 2
    assert "no autoencoder" in capsys.readouterr().err


def test_latents_train_as_stored_without_flips_and_the_sizes_must_match(latent_model):
    from autoencoder import load_autoencoder
    from data import load_images
    from latents import encode_dataset

    loaded = load_autoencoder(latent_model / "ae.pt", device="cpu")
    digits = load_images("digits", data_dir="unused", image_size=8)
    latents = encode_dataset(digits, loaded, source="ae.pt")
    assert latents.images.dtype == torch.float32 and latents.images.shape[1:] == (2, 4, 4) and not latents.hflip
    batch = latents.batch(0, batch_size=4, seed=0)
    order = torch.randperm(len(latents), generator=torch.Generator().manual_seed(0))[:4]
    torch.testing.assert_close(batch, latents.images[order], rtol=0, atol=0)
    with pytest.raises(ValueError, match="match --img_size"):
        encode_dataset(load_images("digits", data_dir="unused", image_size=16), loaded, source="ae.pt")


@pytest.mark.parametrize("fmt, suffix, extra", [("onnx", ".onnx", ("--implementation", "onnxruntime")),
                                               ("torchscript", ".ts", ("--trust_torchscript",))])  # fmt: skip
def test_an_exported_latent_model_carries_its_decoder_and_draws_the_checkpoints_images(latent_model, tmp_path, capsys, fmt, suffix, extra):
    pytest.importorskip("onnxruntime")
    unet = tmp_path / f"lat{suffix}"
    export = ["--device", "cpu", "--mode", "export", "--format", fmt, "--model_path", str(latent_model / "lat.pt"),
              "--output", str(unet)]  # fmt: skip
    assert main.main(export) == 0, capsys.readouterr().err
    decoder = tmp_path / f"lat.decoder{suffix}"
    assert decoder.is_file() and "the decoder" in capsys.readouterr().out
    drawn = {}
    for name, path, flags in (("checkpoint", latent_model / "lat.pt", ()), ("exported", unet, extra)):
        args = ["--device", "cpu", "--mode", "sample", "--model_path", str(path), "--n_samples", "3", "--sampler", "ddim",
                "--sampling_steps", "3", "--no_grid", "--save_npz", str(tmp_path / f"{name}.npz"), *flags]  # fmt: skip
        assert main.main(args) == 0, capsys.readouterr().err
        with np.load(tmp_path / f"{name}.npz") as data:
            drawn[name] = data["images"].astype(int)
    assert drawn["exported"].shape == (3, 8, 8, 1)
    assert np.abs(drawn["exported"] - drawn["checkpoint"]).max() <= 1
    # The decoder is the one the U-Net names: another file in its place, or none, is refused in one line.
    decoder.write_bytes(decoder.read_bytes()[:-1] + b"x")
    args = ["--device", "cpu", "--mode", "sample", "--model_path", str(unet), "--n_samples", "2", "--no_grid",
            "--save_npz", str(tmp_path / "x.npz"), *extra]  # fmt: skip
    assert main.main(args) == 2
    assert "not the decoder" in capsys.readouterr().err
    decoder.unlink()
    assert main.main(args) == 2
    assert "decoder" in capsys.readouterr().err and not (tmp_path / "x.npz").exists()
