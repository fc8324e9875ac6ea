"""MNIST and Fashion-MNIST from their IDX files, read with numpy and checked like a model file.

The data are the four files torchvision downloads, under ``<data_dir>/MNIST/raw/`` (``FashionMNIST/raw/``):
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``,
unpacked or as the ``.gz`` torchvision downloads them as (a file is gzip by its first bytes, whatever its name).
torchvision's ``processed/*.pt`` caches are never read. Every header is checked against the file before anything
is allocated; whatever is wrong is one ValueError line naming the file.

    images, labels, names = load_idx_split("mnist", Path("./data"), train=True, download=False)
    # uint8 (60000, 1, 28, 28), int64 (60000,), ("0 - zero", ..., "9 - nine")

Missing files are downloaded (where ``download`` and a network allow) into a temporary folder first: a failed
download leaves ``data_dir`` as it was, creating no folder.
"""

from __future__ import annotations

import gzip
import os
import shutil
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from ddpm.data.catalog import TORCHVISION_FOLDERS
from ddpm.util.messages import first_line

# IDX: two zero bytes, the data's type (0x08: unsigned bytes, the only one MNIST uses), the number of dimensions,
# then each dimension's size as a big-endian uint32, then the data, row-major.
UBYTE = 0x08
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801
IDX_TYPES = {
    0x08: "unsigned bytes",
    0x09: "signed bytes",
    0x0B: "shorts",
    0x0C: "ints",
    0x0D: "floats",
    0x0E: "doubles",
}
GZIP_MAGIC = b"\x1f\x8b"
SIDE = 28  # MNIST's and Fashion-MNIST's images are 28x28
N_CLASSES = 10
CHUNK = 1 << 20  # a gzip stream is unpacked this many bytes at a time, never more than its header promised

# (images, labels) of each split, as torchvision names them.
SPLIT_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# The class names torchvision gives (and checkpoints trained on these sets record).
CLASS_NAMES = {
    "mnist": tuple(f"{d} - {w}" for d, w in enumerate("zero one two three four five six seven eight nine".split())),
    "fashion_mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
}


class MissingData(ValueError):
    """A split's file is in neither of its forms (plain, .gz), and was not downloaded: the caller adds what to do
    offline. Damaged files are plain ValueErrors: a download would not mend them."""


def raw_folder(dataset: str, root: Path) -> Path:
    return root / TORCHVISION_FOLDERS[dataset] / "raw"


def find_file(raw: Path, name: str) -> Path:
    """``raw/name``, else ``raw/name.gz``; a symlink is followed (docs/flags.md). Anything there but a regular file
    is refused; neither there is :class:`MissingData`."""
    for path in (raw / name, raw / f"{name}.gz"):
        if path.is_file():
            return path
        if os.path.lexists(path):
            raise ValueError(f"{path} is not a regular file (a dangling link, a folder or a device)")
    raise MissingData(f"{raw / name} is missing")


def read_idx(path: Path, *, magic: int, what: str) -> np.ndarray:
    """The uint8 array an IDX file of ``magic`` holds, shaped as its header says; ``what`` ("images", "labels")
    words the errors. The header is checked against the file's length (or, gzip, against memory) before the data
    are read, so a damaged header never allocates what the file does not hold."""
    try:
        with open(path, "rb") as file:
            packed = file.read(2) == GZIP_MAGIC
            file.seek(0)
            stream = gzip.GzipFile(fileobj=file, mode="rb") if packed else file
            with stream:
                shape = _header(stream, path, magic=magic, what=what)
                header_bytes = 4 + 4 * len(shape)
                need = int(np.prod(shape, dtype=object))  # exact: a damaged header may overflow int64
                if not packed and os.fstat(file.fileno()).st_size != header_bytes + need:
                    size = os.fstat(file.fileno()).st_size
                    raise ValueError(
                        f"{path} is {size:,} bytes; its header ({' x '.join(map(str, shape))} {what}) says "
                        f"{header_bytes + need:,}: it is truncated or not an IDX {what} file"
                    )
                _check_memory(need, path=path, what=what)
                return _read_exactly(stream, need, path=path).reshape(shape)
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, or a damaged gzip stream
        raise ValueError(f"cannot read {path}: {first_line(exc)}") from exc


def _header(stream, path: Path, *, magic: int, what: str) -> tuple[int, ...]:
    head = stream.read(4)
    dims = magic & 0xFF
    if len(head) < 4 or head[:2] != b"\0\0" or head[3] != dims:
        got = f"0x{head.hex()}" if head else "nothing"
        raise ValueError(f"{path} is not an IDX {what} file: it starts with {got}, not 0x{magic:08x}")
    if head[2] != UBYTE:
        kind = IDX_TYPES.get(head[2], "no IDX type")
        raise ValueError(f"{path} holds IDX data of type 0x{head[2]:02x} ({kind}); MNIST's are unsigned bytes (0x08)")
    sizes = stream.read(4 * dims)
    if len(sizes) < 4 * dims:
        raise ValueError(f"{path} ends inside its IDX header")
    return struct.unpack(f">{dims}I", sizes)


def _check_memory(need: int, *, path: Path, what: str) -> None:
    from ddpm.util.memory import check_held_in_host_memory

    check_held_in_host_memory(
        need, what=f"the {what} {path} holds", advice=lambda _: "its header is damaged, or the data too large here"
    )


def _read_exactly(stream, need: int, *, path: Path) -> np.ndarray:
    """``need`` bytes of ``stream`` and then its end. The buffer grows as data arrive: a gzip header promising more
    than its stream holds costs only what the stream does hold."""
    data = bytearray()
    while len(data) < need:
        chunk = stream.read(min(CHUNK, need - len(data)))
        if not chunk:
            raise ValueError(f"{path} holds {len(data):,} bytes of data; its IDX header says {need:,}: it is truncated")
        data += chunk
    if stream.read(1):
        raise ValueError(f"{path} holds more data than its IDX header says ({need:,} bytes)")
    return np.frombuffer(data, dtype=np.uint8)


def read_split(dataset: str, root: Path, *, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One split's checked images, uint8 (N, 1, 28, 28), and labels, int64 (N,)."""
    raw = raw_folder(dataset, root)
    images_name, labels_name = SPLIT_FILES[train]
    images_path, labels_path = find_file(raw, images_name), find_file(raw, labels_name)
    images = read_idx(images_path, magic=IMAGES_MAGIC, what="images")
    n, height, width = images.shape
    if not n:
        raise ValueError(f"{images_path} holds no images")
    if (height, width) != (SIDE, SIDE):
        raise ValueError(f"{images_path} holds {height}x{width} images; {dataset}'s are {SIDE}x{SIDE}")
    labels = read_idx(labels_path, magic=LABELS_MAGIC, what="labels")
    if len(labels) != n:
        raise ValueError(f"{labels_path} holds {len(labels):,} labels for the {n:,} images of {images_path}")
    if labels.max() >= N_CLASSES:
        raise ValueError(f"{labels_path} holds label {labels.max()}; {dataset}'s are 0-{N_CLASSES - 1}")
    return torch.from_numpy(images)[:, None], torch.from_numpy(labels.astype(np.int64))


def download(dataset: str, root: Path, names: list[str]) -> None:
    """Download the files ``names`` (unpacked) into the dataset's raw folder, from torchvision's mirrors with its
    checksums; each lands whole (a temporary name, then a rename), and a failure leaves ``root`` untouched."""
    from urllib.error import URLError

    from torchvision.datasets import mnist as tv  # its mirrors, checksums and download helper

    source = {"mnist": tv.MNIST, "fashion_mnist": tv.FashionMNIST}[dataset]
    checksums = dict(source.resources)
    raw = raw_folder(dataset, root)
    with tempfile.TemporaryDirectory(prefix="ddpm-download-") as tmp:
        for name in names:
            archive, errors = f"{name}.gz", []
            for mirror in source.mirrors:
                try:
                    tv.download_and_extract_archive(
                        mirror + archive, download_root=tmp, filename=archive, md5=checksums[archive]
                    )
                    break
                except (RuntimeError, URLError, OSError) as exc:  # no network, a mirror down, a bad checksum
                    errors.append(exc)
            else:
                raise MissingData(f"{raw / name} is missing (Error downloading {archive}: {first_line(errors[-1])})")
        raw.mkdir(parents=True, exist_ok=True)
        for name in names:
            part = raw / f".{name}.part"
            shutil.move(os.path.join(tmp, name), part)
            os.replace(part, raw / name)


def load_idx_split(
    dataset: str, root: Path, *, train: bool, download_missing: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]:
    """The split's images (N, 1, 28, 28) uint8, labels (N,) int64 and class names; missing files downloaded first
    where ``download_missing`` (one that stays missing, offline or not, is :class:`MissingData`)."""
    raw = raw_folder(dataset, root)
    missing = []
    for name in SPLIT_FILES[train]:
        try:
            find_file(raw, name)
        except MissingData:
            missing.append(name)
    if missing:
        if not download_missing:
            raise MissingData(f"{raw / missing[0]} is missing")
        download(dataset, root, missing)
    images, labels = read_split(dataset, root, train=train)
    return images, labels, CLASS_NAMES[dataset]
