"""Latent diffusion: the link between a DDPM checkpoint and the autoencoder whose latents it models.

A latent model's U-Net denoises the scaled latents of an autoencoder (autoencoder.py, trained with
``--mode train_autoencoder``); sampling decodes its latents to images, so grids, ``.npz`` files and
evaluate see images as they do for a pixel model. The checkpoint names its autoencoder by path and
sha256, and sampling refuses a file that is not the one it was trained with.

    python main.py --mode train_autoencoder --dataset digits --img_size 16
    python main.py --mode train --dataset digits --autoencoder checkpoints/digits_autoencoder.pt   # at its size
    python main.py --mode sample --model_path checkpoints/digits.pt      # decodes with the linked autoencoder
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class FirstStage:
    """A latent model's autoencoder, loaded and checked: its decoder (scaled latents -> images in [-1, 1]),
    the latents' shape (C, h, w), the images' shape (C, H, W), and the link a checkpoint stores."""

    decoder: nn.Module
    latent_shape: tuple[int, ...]
    image_shape: tuple[int, ...]
    link: dict

    @property
    def io(self):
        """The decoder's I/O spec (unet_io.DecoderIO), read by its ONNX export and its engine build."""
        from ddpm.formats.unet_io import DecoderIO

        return DecoderIO(latent_shape=tuple(self.latent_shape), image_shape=tuple(self.image_shape))


def load_first_stage(path: str | Path, *, device: torch.device) -> tuple[FirstStage, object]:
    """(the first stage, the LoadedAutoencoder) of the autoencoder checkpoint at ``path``."""
    from ddpm.latent.autoencoder import load_autoencoder

    loaded = load_autoencoder(path, device=device)  # one-line ValueError for anything but an autoencoder
    link = {"path": str(Path(path).resolve()), "sha256": loaded.sha256}
    stage = FirstStage(loaded.decoder(), tuple(loaded.config.latent_shape), tuple(loaded.config.image_shape), link)
    return stage, loaded


def linked_first_stage(
    link: dict | None,
    *,
    model_config,
    source: str,
    device: torch.device,
    override: str | None = None,
    folder: str | Path | None = None,
) -> tuple[FirstStage | None, object]:
    """(the first stage, the LoadedAutoencoder) a latent model was trained with, at its stored path or at
    ``override`` (--autoencoder, for a moved file: its link then names the new path); refused unless its
    sha256 and latent shape are the model's. A pixel model (``link`` None) has none: (None, None), and an
    ``override`` is refused rather than ignored.

    The stored path is followed only inside ``folder`` (the checkpoint's folder and below), so a checkpoint cannot
    make the tool read any other file; outside it, --autoencoder must name the file."""
    if link is None:
        if override:
            raise ValueError(f"--autoencoder: {source} is a pixel model; it has no autoencoder to replace")
        return None, None
    path = override or link["path"]
    if not override and folder is not None and not Path(path).resolve().is_relative_to(Path(folder).resolve()):
        raise ValueError(
            f"{source} names its autoencoder at {path}, outside the checkpoint's folder (a file's links are followed "
            "only inside its folder); "
            f"pass --autoencoder {path} if it is the one"
        )
    if not Path(path).is_file():
        given = "--autoencoder" if override else "its autoencoder"
        problem = (
            "is missing"
            if not Path(path).exists()
            else "is a folder, not a checkpoint file"
            if Path(path).is_dir()
            else "is not a regular file"
        )
        raise ValueError(
            f"{source} is a latent model, and {given} {path} {problem}; pass --autoencoder with the autoencoder's "
            ".pt file"
        )
    stage, loaded = load_first_stage(path, device=device)
    if stage.link["sha256"] != link["sha256"]:
        raise ValueError(
            f"{source} was trained on the latents of another autoencoder than {path} (sha256 {link['sha256'][:12]}..., "
            f"this file {stage.link['sha256'][:12]}...); pass --autoencoder with the one it was trained with"
        )
    check_latent_unet(model_config, stage, source=source)
    return stage, loaded


def clips_x0(requested: bool, first_stage: FirstStage | None) -> bool:
    """Whether a sampling plan clips x0 to [-1, 1]: as asked for a pixel model, never for a latent model,
    whose latents have unit variance (a clip would cut real values)."""
    return requested and first_stage is None


def check_latent_unet(model_config, stage: FirstStage, *, source: str) -> None:
    """The U-Net must take the autoencoder's latents: same channels and side."""
    expected = stage.latent_shape
    found = model_config.sample_shape(1)[1:]
    if tuple(found) != tuple(expected):
        raise ValueError(
            f"{source}: its U-Net takes {'x'.join(map(str, found))} latents but the autoencoder makes "
            f"{'x'.join(map(str, expected))}"
        )


def encode_dataset(images, loaded, *, source: str):
    """The training set as scaled latents (an ImageSet of float32 (N, C, h, w)), encoded once, in memory."""
    from ddpm.latent.autoencoder import encode_images

    expected = tuple(loaded.config.image_shape)
    found = tuple(images.images.shape[1:])
    if found != expected:
        raise ValueError(
            f"{source} encodes {'x'.join(map(str, expected))} images; the {images.name} data are "
            f"{'x'.join(map(str, found))} (match --img_size and --channels to the autoencoder's)"
        )
    latents = encode_images(loaded, images.images)  # (N, C, h, w) float32
    # No flips: a flipped image's latent is not the flipped latent.
    return replace(images, images=latents, hflip=False)
