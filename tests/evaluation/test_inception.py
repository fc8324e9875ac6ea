"""FID/KID in evaluate mode (Fashion-MNIST, CIFAR-10, folders), through torch-fidelity.

Specification: the FID torch-fidelity computes from our features is the closed form for Gaussians
and zero for identical sets; real images score near the ceiling and noise far above it; the
reference and ceiling sets never share an image; the Inception weights are found, checked and,
offline, named in one line with the place to put them; the CLI sweeps a folder model end to end.
(The Inception network of these tests has random weights: torch-fidelity's real ones need a download.)
"""

from __future__ import annotations

import importlib.util
import json
import urllib.error

import numpy as np
import pytest
import torch

import main
from ddpm.evaluation import inception

# Found, not imported: importing torch-fidelity takes seconds, which every xdist worker would pay while collecting.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torch_fidelity") is None, reason="needs torch-fidelity"),
    pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
]


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced."""
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


def pixels(images: torch.Tensor) -> torch.Tensor:
    """A stand-in feature extractor: the pixels, area-averaged to 4x4 (no download, fast)."""
    x = torch.nn.functional.adaptive_avg_pool2d(images.double() / 255, 4)
    return x.flatten(1)


@pytest.fixture(scope="module")
def random_inception_weights(tmp_path_factory) -> str:
    """torch-fidelity's InceptionV3 with random weights, saved as its weights file would be."""
    import torch_fidelity.feature_extractor_inceptionv3 as fidelity_inception

    real_load = torch.nn.Module.load_state_dict
    try:
        fidelity_inception.load_state_dict_from_url = lambda *a, **k: {}
        torch.nn.Module.load_state_dict = lambda self, state, *a, **k: None
        torch.manual_seed(0)
        net = fidelity_inception.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    finally:
        torch.nn.Module.load_state_dict = real_load
        fidelity_inception.load_state_dict_from_url = torch.hub.load_state_dict_from_url
    path = tmp_path_factory.mktemp("inception") / inception.WEIGHTS_NAME
    torch.save(net.state_dict(), path)
    return str(path)


def test_fid_is_the_closed_form_for_gaussians_and_kid_separates_distributions(monkeypatch):
    monkeypatch.setattr(inception, "KID_SUBSETS", 10)  # the mean of 10 subsets already separates these (fast)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    b = torch.randn(4000, 3, generator=g, dtype=torch.float64) * 2 + torch.tensor([3.0, 0.0, 0.0], dtype=torch.float64)
    fid, _, _ = inception.fid_kid(a, b)
    # ||mu_a - mu_b||^2 + tr(C_a + C_b - 2 (C_a C_b)^1/2) = 9 + 3 * (1 + 4 - 2 * 2) = 12
    assert fid == pytest.approx(12.0, rel=0.05)
    same, _, _ = inception.fid_kid(a, a)
    assert same == pytest.approx(0.0, abs=1e-6)
    _, kid_near, _ = inception.fid_kid(a[:2000], a[2000:])
    _, kid_far, _ = inception.fid_kid(a, b)
    assert abs(kid_near) < 0.01 < kid_far


def test_real_images_score_near_the_ceiling_and_noise_far_above():
    from ddpm.data.datasets import load_images

    digits = load_images("digits", data_dir=".", image_size=8).images
    reference, held = inception.real_splits(digits, None, n=400, seed=0)
    judge = inception.InceptionJudge(reference, held, extractor=pixels, seed=0)
    ceiling, floor = judge.ceiling(400, seed=0), judge.floor(400, seed=0, image_size=8)
    assert floor.fid > 10 * ceiling.fid and floor.kid > 10 * ceiling.kid
    # Real digits passed as samples ([-1, 1] floats, as a sampler returns them) land on the ceiling.
    as_samples = held.float() / 127.5 - 1
    scores = judge.score(as_samples, name="held-out")
    assert scores.fid == pytest.approx(ceiling.fid, rel=1e-6) and scores.n == 400


def test_reference_and_ceiling_images_are_disjoint_and_counts_are_checked():
    images = torch.arange(20, dtype=torch.uint8).view(20, 1, 1, 1)
    reference, held = inception.real_splits(images, None, n=10, seed=3)
    assert set(reference.flatten().tolist()).isdisjoint(held.flatten().tolist())
    with pytest.raises(ValueError, match="--n_samples 10 or fewer"):
        inception.real_splits(images, None, n=11, seed=3)
    test = torch.full((5, 1, 1, 1), 99, dtype=torch.uint8)
    reference, held = inception.real_splits(images, test, n=5, seed=3)
    assert (held == 99).all() and (reference < 20).all()
    with pytest.raises(ValueError, match="more than the data hold"):
        inception.real_splits(images, test, n=6, seed=3)


def test_missing_or_broken_weights_and_a_failed_download_are_one_line_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is not a file"):
        inception.weights_file(tmp_path / "absent.pth")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable weights file"):
        inception.weights_file(junk)
    torch.save({"a": 1}, tmp_path / "odd.pth")
    with pytest.raises(ValueError, match="not a state dict of tensors"):
        inception.weights_file(tmp_path / "odd.pth")
    # Offline: the download fails and the message names the URL and where to put the file.
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(url, dst, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(ValueError) as info:
        inception.weights_file(None)
    message = str(info.value)
    assert "\n" not in message and "github.com" in message
    assert str(tmp_path / "hub" / "checkpoints" / inception.WEIGHTS_NAME) in message


def test_the_inception_extractor_gives_2048_features_for_grey_and_rgb(random_inception_weights):
    extract = inception.inception_extractor(
        inception.weights_file(random_inception_weights), device=torch.device("cpu")
    )
    grey = torch.randint(0, 256, (2, 1, 8, 8), dtype=torch.uint8)
    assert extract(grey).shape == (2, 2048)
    # A grey image is the RGB image with three equal channels.
    assert torch.allclose(extract(grey), extract(grey.expand(-1, 3, -1, -1)))
    assert np.isfinite(extract(torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)).numpy()).all()


@pytest.mark.slow  # 31 s on 2 cores; FID/KID against closed forms and the extractor stay in the default run
def test_evaluate_sweeps_a_folder_model_by_fid_and_kid(tmp_path, capsys, random_inception_weights):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):  # 8 small RGB images: 4 reference, 4 held out (each one Inception forward per set)
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    ckpt = tmp_path / "folder.pt"
    train = [
        "--device",
        "cpu",
        "--mode",
        "train",
        "--dataset",
        "folder",
        "--data_dir",
        str(folder),
        "--img_size",
        "8",
        "--channels",
        "3",
        "--model_channels",
        "16",
        "--num_res_blocks",
        "1",
        "--max_steps",
        "2",
        "--batch_size",
        "4",
        "--sample_every",
        "0",
        "--save_every",
        "0",
        "--model_path",
        str(ckpt),
        "--timesteps",
        "20",
    ]
    assert main.main(train) == 0, capsys.readouterr().err
    out_json = tmp_path / "fid.json"
    args = [
        "--device",
        "cpu",
        "--mode",
        "evaluate",
        "--model_path",
        str(ckpt),
        "--data_dir",
        str(folder),
        "--sampler",
        "ddim",
        "--sampling_steps",
        "2,3",
        "--n_samples",
        "4",
        "--inception_weights",
        random_inception_weights,
        "--json",
        str(out_json),
        "--chart",
        str(tmp_path / "fid.png"),
    ]
    assert main.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "FID" in out and "(ceiling: held-out real images)" in out
    result = json.loads(out_json.read_text())
    assert result["metric"] == "inception" and [r["steps"] for r in result["rows"]] == [2, 3]
    assert all(
        r["n"] == 4 and r["fid"] >= 0 and "kid" in r for r in result["rows"] + [result["ceiling"], result["floor"]]
    )
    assert (tmp_path / "fid.png").read_bytes()[:4] == b"\x89PNG"
    # More samples than the folder can give both sets of: refused in one line before any sampling.
    assert main.main(with_flag(args, "--n_samples", "5")) == 2
    assert "--n_samples 4 or fewer" in capsys.readouterr().err
    # A weights file that is not there: one line.
    assert main.main(with_flag(args, "--inception_weights", str(tmp_path / "absent.pth"))) == 2
    assert "--inception_weights" in capsys.readouterr().err
