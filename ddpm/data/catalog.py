"""The datasets this tool trains on, by name: which are 3-D volumes, which have a test split, and the
(image_size, channels) each trains at unless the flags say otherwise.

    default_shape("digits")   # -> (8, 1)

Loading them is datasets.py's; this list is what flags, checkpoints and evaluate check names against.
"""

from __future__ import annotations

DATASETS = ("mnist", "fashion_mnist", "cifar10", "digits", "folder", "spheres", "voxels")
VOLUME_DATASETS = ("spheres", "voxels")  # 3-D: (N, 1, S, S, S)
TEST_SPLITS = ("mnist", "fashion_mnist", "cifar10", "spheres")  # the others: evaluate holds out part of the data

# (image_size, channels) each dataset trains at by default: the native size (the 8x8 digits too:
# at 8x8 a training step costs a third of one at an upscaled 16x16, and evaluate's DPM-Solver++
# 20-step samples of a model trained 3x longer at 8x8 beat the 16x16 model's; BENCHMARKS.md).
DEFAULT_SHAPE = {
    "mnist": (28, 1), "fashion_mnist": (28, 1), "cifar10": (32, 3), "digits": (8, 1), "folder": (32, 3),
    "spheres": (32, 1), "voxels": (32, 1),
}  # fmt: skip


def default_shape(dataset: str) -> tuple[int, int]:
    """(image_size, channels) a dataset trains at unless the flags say otherwise."""
    return DEFAULT_SHAPE[dataset]
