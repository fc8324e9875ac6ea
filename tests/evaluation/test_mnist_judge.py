"""The 28x28 digit judge (evaluation/quality.py, MnistJudge) on inputs whose answer is known.

Specification: real digits it never saw read as confident digits of all ten classes, near its ceiling; uniform noise
and bright blobs (the failure seen on real digits at 28x28, issue 56: samples brighter than any real digit) do not;
blurred real digits land in between, farther in Frechet distance as the blur grows; exact copies of the model's
training images are near-copies and blends of two are not, among mnist_5k's training split or the MNIST files a
--dataset mnist model trained on; the blocked nearest-neighbour search is the brute-force one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF

from ddpm.data.datasets import load_images
from ddpm.evaluation import quality
from ddpm.evaluation.quality import MnistJudge, to_signed

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

N = 256  # samples a row: evaluate's usual count


@pytest.fixture(scope="module")
def judge() -> MnistJudge:
    return MnistJudge(image_size=28, seed=0)


@pytest.fixture(scope="module")
def held() -> torch.Tensor:
    """N held-out real digits (never seen by the classifier), in [-1, 1], all ten classes."""
    images = load_images("mnist_5k", data_dir="unused", image_size=28, train=False).images
    return to_signed(images[torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:N]])


def blurred(images: torch.Tensor, sigma: float) -> torch.Tensor:
    return TF.gaussian_blur(images, kernel_size=2 * round(3 * sigma) + 1, sigma=sigma)


def test_held_out_digits_score_near_the_ceiling_noise_at_the_floor_and_blurred_digits_between(judge, held):
    ceiling, floor = judge.ceiling(N, seed=0), judge.floor(N, seed=0, image_size=28)
    real = judge.score(held, name="held-out")
    assert ceiling.confident > 0.85 and ceiling.classes == 10  # measured: 92%
    assert real.confident > 0.85 and real.classes == 10 and abs(real.confident - ceiling.confident) < 0.06
    assert floor.confident == 0.0 and floor.classes == 0 and floor.frechet > 10 * ceiling.frechet
    soft, softer = (judge.score(blurred(held, sigma), name=f"blur {sigma}") for sigma in (1.0, 2.0))
    # measured (Frechet): real 1.4, blurred sigma 1 5.7, sigma 2 21, noise 53; confident 94%, 86%, 83%, 0%
    assert 2 * real.frechet < soft.frechet < softer.frechet < floor.frechet / 2
    assert floor.confident < softer.confident <= soft.confident < real.confident


def test_bright_blobs_are_not_read_as_confident_digits(judge):
    """Blobs brighter on average than any real digit (mean grey above 0.35: the brightest real digit is ~0.3), at
    random places and sizes: the classifier alone reads them as digits at p >= 0.9."""
    g = torch.Generator().manual_seed(0)
    centre = 14 + 3 * (torch.rand(N, 2, generator=g) * 2 - 1)  # (N, 2) pixels
    sigma = 8 + 4 * torch.rand(N, generator=g)  # (N,)
    yy, xx = torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")
    squared = (yy - centre[:, :1, None]) ** 2 + (xx - centre[:, 1:, None]) ** 2  # (N, 28, 28)
    blobs = (torch.exp(-squared / (2 * sigma[:, None, None] ** 2)) * 2 - 1)[:, None]  # (N, 1, 28, 28) in [-1, 1]
    assert ((blobs + 1) / 2).mean((1, 2, 3)).min() > 0.35
    assert (judge.classifier.predict_proba(judge.features(blobs)).max(1) >= 0.9).mean() > 0.5
    assert judge.score(blobs, name="blobs").confident == 0.0


def test_exact_training_copies_are_near_copies_and_blends_are_not(judge):
    copies = judge.real_images[:N]
    assert judge.score(copies, name="copies").memorised == 1.0
    blends = 0.5 * (judge.real_images[:N] + judge.real_images[N : 2 * N])  # two digits averaged: a new image
    assert judge.score(blends, name="blends").memorised == 0.0


def test_an_mnist_models_copies_are_looked_for_among_its_own_training_files(mnist_idx, judge):
    folder, written = mnist_idx
    of_mnist = quality.mnist_judge("mnist", data_dir=str(folder), image_size=28, seed=0)
    trained_on = to_signed(written["train"][0][:, None])  # (300, 1, 28, 28): the files the model read
    assert of_mnist.score(trained_on, name="copies").memorised == 1.0
    # mnist_5k's last training digits (none among the 300 files): copies for a model of mnist_5k, new to this one.
    others = judge.real_images[-N:]
    assert judge.score(others, name="others").memorised == 1.0
    assert of_mnist.score(others, name="others").memorised < 0.03


def test_the_blocked_nearest_neighbour_search_is_the_brute_force_one():
    rng = np.random.default_rng(0)
    # More queries than one block holds (MNIST_CHUNK), few dimensions: the brute force stays small.
    queries, references = rng.random((600, 16), dtype=np.float32), rng.random((300, 16), dtype=np.float32)
    brute = np.sqrt(((queries[:, None].astype(np.float64) - references[None]) ** 2).sum(-1))  # (600, 300)
    assert np.allclose(quality.nearest_distance(queries, references), brute.min(1), atol=1e-4)
    own = np.arange(300)  # the references themselves, each leaving out its own row (more than a block too)
    brute_self = np.sqrt(((references[:, None].astype(np.float64) - references[None]) ** 2).sum(-1))
    np.fill_diagonal(brute_self, np.inf)
    assert np.allclose(quality.nearest_distance(references, references, skip=own), brute_self.min(1), atol=1e-4)


def test_a_model_at_another_size_is_judged_through_the_same_resizing(held):
    """A --img_size 16 model: the real digits resized to 16 as in training, then back to 28 like its samples."""
    small = MnistJudge(image_size=16, seed=0)
    ceiling = small.ceiling(N, seed=0)
    assert small.real_images.shape[-1] == 16 and small.train_features.shape[1] == 28 * 28  # read at 28x28
    assert ceiling.confident > 0.8 and ceiling.classes == 10
    assert small.floor(N, seed=0, image_size=16).confident == 0.0
