"""The datasets this tool trains on, by name: which are 3-D volumes, which have a test split, and the
(image_size, channels) each trains at unless the flags say otherwise.

    default_shape("digits")   # -> (8, 1)

Loading them is datasets.py's; this list is what flags, checkpoints and evaluate check names against.
"""

from __future__ import annotations

from pathlib import Path

DATASETS = ("mnist", "fashion_mnist", "cifar10", "digits", "mnist_5k", "folder", "spheres", "voxels")
DEFAULT_DATASET = "mnist"  # --dataset left out
VOLUME_DATASETS = ("spheres", "voxels")  # 3-D: (N, 1, S, S, S)
# mnist_5k's test split: a fixed 1,000 of its 5,000 digits (datasets.py, MNIST_5K_HELD_EVERY), never trained on.
TEST_SPLITS = ("mnist", "fashion_mnist", "cifar10", "mnist_5k", "spheres")  # the others: evaluate holds part out

# (image_size, channels) each dataset trains at by default: the native size (the 8x8 digits too:
# at 8x8 a training step costs a fraction of one at an upscaled 16x16, and evaluate's DPM-Solver++
# 20-step samples of a model trained 3x longer at 8x8 beat the 16x16 model's;
# BENCHMARKS.md, "The demo's image size and loss weighting").
DEFAULT_SHAPE = {
    "mnist": (28, 1),
    "fashion_mnist": (28, 1),
    "cifar10": (32, 3),
    "digits": (8, 1),
    "mnist_5k": (28, 1),
    "folder": (32, 3),
    "spheres": (32, 1),
    "voxels": (32, 1),
}


def default_shape(dataset: str) -> tuple[int, int]:
    """(image_size, channels) a dataset trains at unless the flags say otherwise."""
    return DEFAULT_SHAPE[dataset]


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")  # a --dataset folder's images
# The folder under --data_dir where torchvision keeps each dataset's files.
TORCHVISION_FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "cifar-10-batches-py"}


def data_files(dataset: str, data_dir: str | Path) -> tuple[Path, tuple[str, ...] | None] | None:
    """Where a dataset's files lie, as (folder, the suffixes read there; None: every file), or None for data
    drawn in memory (digits, spheres): what the output check protects as a run's input."""
    if dataset == "folder":
        return Path(data_dir), IMAGE_SUFFIXES
    if dataset == "voxels":
        return Path(data_dir), (".npy",)
    if dataset in TORCHVISION_FOLDERS:
        return Path(data_dir) / TORCHVISION_FOLDERS[dataset], None
    return None
