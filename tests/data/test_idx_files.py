"""MNIST's IDX files checked like a model file (issue 67): --dataset mnist and fashion_mnist read
``<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (or their .gz) with our own reader.

Specification: the raw files are the data, read exactly (compared against the digits written); torchvision's
processed/*.pt caches are never loaded, stale or crafted; a header is checked against the file before anything is
allocated; every malformed file (magic, type, dimensions, length, labels) is one line naming it through train,
evaluate and distill's --adv_real data; --data_dir given to a dataset that never reads it is refused; a failed load
names the file that is missing and creates no folder, and a download fetches only what is missing.
"""

from __future__ import annotations

import gzip
import shutil
import struct
import tracemalloc
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_user_error, distill_here, run_here

from ddpm.data import idx_files
from ddpm.data.datasets import load_images

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY_28 = ["--device", "cpu", "--model_channels", "8", "--num_res_blocks", "1", "--timesteps", "5"]
TRAIN_28 = ["--mode", "train", *TINY_28, "--max_steps", "1", "--batch_size", "8", "--sample_every", "0"]
IMAGES, LABELS = "train-images-idx3-ubyte", "train-labels-idx1-ubyte"


def idx_bytes(array: np.ndarray, *, magic: int | None = None, type_byte: int = 0x08) -> bytes:
    """An IDX file written by hand: zero, zero, the type byte, the dimension count, big-endian sizes, the data."""
    head = struct.pack(">BBBB", 0, 0, type_byte, array.ndim) if magic is None else struct.pack(">I", magic)
    return head + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


@pytest.fixture
def data(mnist_idx, tmp_path):
    """A copy of the real digits' --data_dir (conftest's mnist_idx) to damage, and the digits written there."""
    folder, written = mnist_idx
    copy = tmp_path / "data"
    shutil.copytree(folder, copy)
    return copy, written


def raw(folder: Path) -> Path:
    return folder / "MNIST" / "raw"


def assert_loads_the_written_digits(folder: Path, written, **kwargs) -> None:
    for split, train in (("train", True), ("t10k", False)):
        loaded = load_images("mnist", data_dir=folder, image_size=28, train=train, **kwargs)
        images, labels = written[split]
        assert torch.equal(loaded.images[:, 0], images) and torch.equal(loaded.labels, labels), split
        assert loaded.class_names[3] == "3 - three"  # torchvision's names, as checkpoints recorded them


# ----- 1. memory: nothing is allocated that the files do not hold -----------------------------------------------
def test_processed_pt_files_are_never_torch_loaded_even_a_crafted_zip(data, monkeypatch):
    folder, written = data
    processed = folder / "MNIST" / "processed"
    processed.mkdir()
    bomb = processed / "training.pt"  # a zip whose one member inflates far past its size
    import zipfile

    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * (16 << 20))
    shutil.copy(bomb, processed / "test.pt")

    def no_torch_load(*args, **kwargs):
        raise AssertionError("torch.load read a processed file")

    monkeypatch.setattr(torch, "load", no_torch_load)
    assert_loads_the_written_digits(folder, written)


def test_a_header_claiming_more_than_a_plain_file_holds_is_refused_before_any_data_are_read(data, monkeypatch):
    folder, _ = data
    path = raw(folder) / IMAGES
    path.write_bytes(struct.pack(">IIII", 0x803, 100_000, 28, 28) + bytes(784))  # 78 MB claimed, one image held
    monkeypatch.setattr(idx_files, "_read_exactly", lambda *a, **k: pytest.fail("read before the length check"))
    with pytest.raises(ValueError, match="its header") as caught:
        load_images("mnist", data_dir=folder, image_size=28, download=False)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_gzip_whose_header_promises_more_than_it_holds_costs_only_what_it_holds(data):
    folder, _ = data
    path = raw(folder) / IMAGES
    path.unlink()
    claimed = 100_000  # 78 MB of pixels, within any machine's memory: only the stream's end can tell
    gz = raw(folder) / f"{IMAGES}.gz"
    gz.write_bytes(gzip.compress(struct.pack(">IIII", 0x803, claimed, 28, 28) + bytes(784 * 10)))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="truncated") as caught:
            load_images("mnist", data_dir=folder, image_size=28, download=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(gz) in str(caught.value) and peak < 8 << 20, peak
    gz.write_bytes(gzip.compress(struct.pack(">IIII", 0x803, 2**32 - 1, 2**16, 2**16)))  # past any memory
    with pytest.raises(ValueError, match="in memory") as caught:
        load_images("mnist", data_dir=folder, image_size=28, download=False)
    assert str(gz) in str(caught.value)


# ----- 2. silently wrong: the raw files are the data, and must agree --------------------------------------------
def test_stale_processed_files_of_other_data_never_replace_the_raw_files(data):
    folder, written = data
    processed = folder / "MNIST" / "processed"
    processed.mkdir()
    for name, n in (("training.pt", 7), ("test.pt", 3)):  # torchvision's cache layout, float pixels and other digits
        torch.save((torch.rand(n, 28, 28), torch.zeros(n, dtype=torch.long)), processed / name)
    assert_loads_the_written_digits(folder, written)


@pytest.mark.parametrize("extra", [1, -1], ids=["more-labels", "fewer-labels"])
def test_labels_that_do_not_match_the_images_one_for_one_are_refused_naming_the_file(data, extra):
    folder, written = data
    labels = written["train"][1].numpy().astype(np.uint8)
    labels = np.concatenate([labels, labels[:1]]) if extra > 0 else labels[:-1]
    (raw(folder) / LABELS).write_bytes(idx_bytes(labels))
    with pytest.raises(ValueError, match=f"holds {len(labels)} labels for the 300 images") as caught:
        load_images("mnist", data_dir=folder, image_size=28, download=False)
    assert str(raw(folder) / LABELS) in str(caught.value)


# ----- 3. malformed files: one line naming the file, in every mode that reads them ------------------------------
def junk(written, case: str) -> tuple[str, bytes, str]:
    """(the file damaged, its bytes, what the one line says) for each malformed file the adversarial pass tried."""
    images = written["train"][0].numpy()
    labels = written["train"][1].numpy().astype(np.uint8)
    return {
        "wrong-magic": (IMAGES, idx_bytes(images, magic=0x0801), "is not an IDX images file"),
        "type-byte-10": (IMAGES, idx_bytes(images, type_byte=0x0A), "type 0x0a (no IDX type)"),
        "float-data": (IMAGES, idx_bytes(images.astype(">f4"), type_byte=0x0D), "type 0x0d (floats)"),
        "truncated": (IMAGES, idx_bytes(images)[:-100], "its header"),
        "empty": (IMAGES, b"", "starts with nothing"),
        "text": (LABELS, b"not an idx file at all\n", "is not an IDX labels file"),
        "32x32": (IMAGES, idx_bytes(np.zeros((300, 32, 32), np.uint8)), "holds 32x32 images"),
        "no-images": (IMAGES, idx_bytes(np.zeros((0, 28, 28), np.uint8)), "holds no images"),
        "label-10": (LABELS, idx_bytes(np.where(labels == 9, 10, labels).astype(np.uint8)), "holds label 10"),
        "broken-gzip": (IMAGES, gzip.compress(idx_bytes(images))[:500], "cannot read"),
    }[case]


CASES = [
    "wrong-magic",
    "type-byte-10",
    "float-data",
    "truncated",
    "empty",
    "text",
    "32x32",
    "no-images",
    "label-10",
    "broken-gzip",
]


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_idx_file_is_one_line_naming_it_through_train(data, tmp_path, case):
    folder, written = data
    name, content, says = junk(written, case)
    (raw(folder) / name).write_bytes(content)
    result = run_here(*TRAIN_28, "--dataset", "mnist", "--data_dir", str(folder), "--class_cond", cwd=tmp_path)
    assert_user_error(result, says)
    assert str(raw(folder) / name) in result.stderr
    assert not list(tmp_path.rglob("*.pt"))


def test_a_gzip_under_the_plain_name_is_read_as_gzip(data):
    folder, written = data
    for name in (IMAGES, LABELS, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        path = raw(folder) / name
        path.write_bytes(gzip.compress(path.read_bytes()))
    assert_loads_the_written_digits(folder, written, download=False)


@pytest.fixture(scope="module")
def mnist_model(mnist_idx, tmp_path_factory):
    """A tiny 28x28 model trained on the real digits (--dataset mnist), for evaluate and distill to read data for."""
    folder = tmp_path_factory.mktemp("mnist_model")
    result = run_here(
        *TRAIN_28, "--dataset", "mnist", "--data_dir", str(mnist_idx[0]), "--model_path", "m.pt", cwd=folder
    )
    assert result.returncode == 0, result.stderr
    return folder / "m.pt"


@pytest.mark.parametrize("case", ["wrong-magic", "float-data", "label-10"])
def test_a_malformed_idx_file_is_one_line_naming_it_through_evaluate_and_distill(data, tmp_path, mnist_model, case):
    folder, written = data
    name, content, says = junk(written, case)
    target = raw(folder) / name
    target.write_bytes(content)
    evaluate = ["--mode", "evaluate", "--device", "cpu", "--model_path", str(mnist_model), "--data_dir", str(folder)]
    result = run_here(*evaluate, "--n_samples", "4", "--sampler", "ddim", "--sampling_steps", "2", cwd=tmp_path)
    assert_user_error(result, says)
    assert str(target) in result.stderr
    distill = ["--max_steps", "1", "--sampling_steps", "1", "--adv_real", "data", "--data_dir", str(folder)]
    result = distill_here(tmp_path, mnist_model, *distill)
    assert_user_error(result, says)
    assert str(target) in result.stderr and not (tmp_path / "student.pt").exists()


# ----- 4. a --data_dir that would be ignored ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["train", "train_autoencoder"])
@pytest.mark.parametrize("dataset", ["mnist_5k", "digits", "spheres"])
def test_data_dir_with_a_dataset_that_never_reads_it_is_refused(tmp_path, mode, dataset):
    short = ["--max_steps", "1", "--batch_size", "2"]  # were it not refused: a short run, not a CPU recipe
    short += ["--model_channels", "8", "--num_res_blocks", "1", "--timesteps", "5"] if mode == "train" else []
    result = run_here(
        "--mode", mode, "--device", "cpu", "--dataset", dataset, "--data_dir", "mine", *short, cwd=tmp_path
    )
    assert_user_error(result, f"--data_dir is read by --mode {mode} with --dataset mnist or fashion_mnist")
    assert f"not --dataset {dataset}" in result.stderr and not list(tmp_path.iterdir())


# ----- 5. what a failed load says, and what it leaves ----------------------------------------------------------
@pytest.fixture
def offline(monkeypatch):
    """torchvision's downloads fail as they fail without network, and never reach one."""

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr("torchvision.datasets.mnist.download_and_extract_archive", no_network)


@pytest.mark.parametrize("data_dir", ["data", "deep/er/data"])
def test_a_failed_offline_load_names_the_missing_file_and_creates_no_folder(tmp_path, offline, data_dir):
    result = run_here(*TRAIN_28, "--dataset", "mnist", "--data_dir", data_dir, cwd=tmp_path)
    assert_user_error(result, f"{Path(data_dir) / 'MNIST/raw/train-images-idx3-ubyte'} is missing (Error downloading")
    assert not (tmp_path / data_dir.split("/")[0]).exists()


def test_only_the_missing_files_are_named_and_downloaded(data, tmp_path, monkeypatch):
    folder, written = data
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        moved = tmp_path / "mirror" / name
        moved.parent.mkdir(exist_ok=True)
        shutil.move(raw(folder) / name, moved)
    before = (raw(folder) / IMAGES).stat().st_mtime_ns
    with pytest.raises(ValueError, match="t10k-images-idx3-ubyte is missing; with network access") as caught:
        load_images("mnist", data_dir=folder, image_size=28, train=False, download=False)
    reason = str(caught.value).split("; with network access")[0]  # the advice after it names every file
    assert "\n" not in str(caught.value) and f"could not load mnist into {folder}: {raw(folder)}/t10k-images" in reason
    assert IMAGES not in reason
    fetched = []

    def mirror(url, download_root, filename, md5):  # torchvision's helper: the .gz, then it unpacked beside it
        fetched.append(filename)
        plain = (tmp_path / "mirror" / filename.removesuffix(".gz")).read_bytes()
        Path(download_root, filename).write_bytes(gzip.compress(plain))
        Path(download_root, filename.removesuffix(".gz")).write_bytes(plain)

    monkeypatch.setattr("torchvision.datasets.mnist.download_and_extract_archive", mirror)
    assert_loads_the_written_digits(folder, written)
    assert fetched == ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
    assert (raw(folder) / IMAGES).stat().st_mtime_ns == before
    assert sorted(p.name for p in raw(folder).iterdir()) == sorted(
        idx_files.SPLIT_FILES[True] + idx_files.SPLIT_FILES[False]
    )


def test_a_symlinked_idx_file_is_followed(data, tmp_path):
    folder, written = data
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(raw(folder) / IMAGES, elsewhere / IMAGES)
    (raw(folder) / IMAGES).symlink_to(elsewhere / IMAGES)
    assert_loads_the_written_digits(folder, written, download=False)
    (elsewhere / IMAGES).unlink()  # now dangling: refused, never downloaded over
    with pytest.raises(ValueError, match="is not a regular file") as caught:
        load_images("mnist", data_dir=folder, image_size=28)
    assert str(raw(folder) / IMAGES) in str(caught.value)
