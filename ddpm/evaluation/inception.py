"""FID and KID for models of Fashion-MNIST, CIFAR-10 and image folders (evaluate mode; MNIST's digits have a judge
that needs no download, quality.MnistJudge).

    python main.py --mode evaluate --model_path checkpoints/cifar10.pt --n_samples 1000

The features are torch-fidelity's InceptionV3 (the TensorFlow FID network, ported bit-exact: the
2048-d pool features of images bilinearly resized to 299x299), and the distances are
torch-fidelity's own FID and KID functions, so the numbers are the field's. Samples and real images
take the same path: float images in [-1, 1] rounded to uint8 as a PNG would hold them, grey
images repeated to three channels.

Every table carries its ceiling and floor, scored against the same reference at the same count:

* reference: ``n`` training images (the data the model learned), drawn with the seed;
* ceiling: ``n`` other real images (the dataset's test split, which training never saw; for a
  folder, images outside the reference, which training did see: a folder has no split) - what a
  perfect model would score at this count;
* floor: ``n`` images of uniform noise.

FID depends on the sample count (it is biased upwards at small counts): compare rows of one run
only. KID is unbiased; it is reported as the mean and standard deviation over subsets.

torch-fidelity and its weights are optional: without the package, evaluate says what to install;
without network, it names the weights file and where to place it (``--inception_weights FILE``
points at a copy elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpm.formats.torch_files import load_pt
from ddpm.util.messages import first_line
from ddpm.util.safe_files import read_limited

WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
FEATURE = "2048"
KID_SUBSETS = 100
KID_SUBSET_SIZE = 1000  # torch-fidelity's default; smaller runs use all their samples per subset
BATCH = 50  # Inception images per forward pass (299x299x3 float32: about 1 GB of activations on a CPU)

Extractor = Callable[[torch.Tensor], torch.Tensor]  # uint8 (N, C, H, W) -> float (N, F)


@dataclass
class InceptionScores:
    """One set of images scored against the reference (training) images."""

    name: str
    n: int
    fid: float
    kid: float  # mean over subsets
    kid_std: float
    seconds: float | None = None  # the time to draw them, when drawn


def _fidelity():
    try:
        import torch_fidelity  # noqa: F401
    except ImportError as exc:
        raise ValueError("FID/KID need torch-fidelity: pip install torch-fidelity") from exc
    import torch_fidelity.feature_extractor_inceptionv3 as inception

    return inception


def default_weights_path() -> Path:
    """Where the weights are looked for and downloaded to: torch hub's checkpoint cache."""
    return Path(torch.hub.get_dir()) / "checkpoints" / WEIGHTS_NAME


def weights_file(path: str | Path | None = None, *, download: bool = True) -> Path:
    """The Inception weights: ``path`` if given, else the cached file, downloaded once if missing.

    Checked as a plain state dict (``weights_only=True``) before torch-fidelity reads it. One-line
    ValueError when the file is missing, unreadable or cannot be downloaded."""
    inception = _fidelity()
    url = inception.URL_INCEPTION_V3
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--inception_weights {path} is not a file (torch-fidelity's {WEIGHTS_NAME}, from {url})")
    else:
        path = default_weights_path()
        if not path.is_file():
            if not download:
                raise ValueError(f"the Inception weights are not at {path}; download {url} and place them there")
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                print(f"downloading the Inception weights for FID/KID once, into {path} ...")
                torch.hub.download_url_to_file(url, str(path), progress=True)  # a temporary file, then a rename
            except (OSError, ValueError) as exc:  # URLError is an OSError
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ValueError(
                    f"FID/KID need the Inception weights and the download failed ({reason}); download {url} "
                    f"and place it at {path}, or pass --inception_weights FILE"
                ) from exc
    try:  # within the size limit, its zip checked (no bomb, no flipped bit) before torch or torch-fidelity inflate it
        state = load_pt(read_limited(path, kind="checkpoint"), source="the file", kind="Inception weights")
    except ValueError as exc:
        raise ValueError(
            f"{path} is not a readable weights file ({first_line(exc)}); fetch it again from {url}"
        ) from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} is not a state dict of tensors; fetch it again from {url}")
    return path


def inception_extractor(weights: Path, *, device: torch.device) -> Extractor:
    """torch-fidelity's InceptionV3 (2048-d pool features), as a function of uint8 images."""
    inception = _fidelity()
    try:
        net = inception.FeatureExtractorInceptionV3(
            "inception-v3-compat", [FEATURE], feature_extractor_weights_path=str(weights)
        )
    except RuntimeError as exc:  # a state dict of other keys or shapes
        raise ValueError(
            f"{weights} does not hold torch-fidelity's InceptionV3 weights ({str(exc).splitlines()[0]})"
        ) from exc
    net = net.to(device)

    @torch.no_grad()
    def extract(images: torch.Tensor) -> torch.Tensor:
        out = []
        for start in range(0, len(images), BATCH):
            x = images[start : start + BATCH].to(device)
            if x.shape[1] == 1:
                x = x.expand(-1, 3, -1, -1)  # grey -> RGB, as the images would be viewed
            out.append(net(x)[0].double().cpu())  # sync: features leave the device
        return torch.cat(out)

    return extract


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """Float images in [-1, 1] -> uint8 as written to a PNG (the path real images take too)."""
    return ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def fid_kid(features_a: torch.Tensor, features_b: torch.Tensor) -> tuple[float, float, float]:
    """(FID, KID mean, KID std) between two sets of features, by torch-fidelity's functions."""
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
    from torch_fidelity.metric_kid import kid_features_to_metric

    fid = fid_statistics_to_metric(
        fid_features_to_statistics(features_a), fid_features_to_statistics(features_b), verbose=False
    )["frechet_inception_distance"]
    size = min(KID_SUBSET_SIZE, len(features_a), len(features_b))
    kid = kid_features_to_metric(features_a, features_b, kid_subsets=KID_SUBSETS, kid_subset_size=size, verbose=False)
    return float(fid), float(kid["kernel_inception_distance_mean"]), float(kid["kernel_inception_distance_std"])


def real_splits(
    train: torch.Tensor, held_out: torch.Tensor | None, *, n: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, ceiling) uint8 images: ``n`` of the training images, and ``n`` real images not among
    them (from ``held_out``, or else the rest of ``train``). Refuses counts the data cannot give."""
    g = torch.Generator().manual_seed(seed)
    if held_out is None:
        if 2 * n > len(train):
            raise ValueError(
                f"FID/KID take {n} reference and {n} held-out real images, and the data hold {len(train)}; "
                f"use --n_samples {len(train) // 2} or fewer"
            )
        order = torch.randperm(len(train), generator=g)
        return train[order[:n]], train[order[n : 2 * n]]
    if n > min(len(train), len(held_out)):
        raise ValueError(
            f"--n_samples {n} is more than the data hold ({len(train)} training, {len(held_out)} test images)"
        )
    return train[torch.randperm(len(train), generator=g)[:n]], held_out[torch.randperm(len(held_out), generator=g)[:n]]


class InceptionJudge:
    """Scores images by FID and KID against ``reference`` real images (uint8), with its ceiling (``held``,
    other real images) and floor (uniform noise) at the same count."""

    kind = "inception"

    def __init__(self, reference: torch.Tensor, held: torch.Tensor, *, extractor: Extractor, seed: int = 0) -> None:
        if len(reference) < 2 or len(held) < 2:
            raise ValueError("FID/KID need at least 2 images in each set")
        self.extract = extractor
        self.seed = seed
        self.held = held
        self.reference_features = extractor(reference)

    def _score(self, images_uint8: torch.Tensor, name: str) -> InceptionScores:
        fid, kid, kid_std = fid_kid(self.extract(images_uint8), self.reference_features)
        return InceptionScores(name=name, n=len(images_uint8), fid=fid, kid=kid, kid_std=kid_std)

    def score(self, images: torch.Tensor, *, name: str, requested: torch.Tensor | None = None) -> InceptionScores:
        """Score (N, C, H, W) samples in [-1, 1]. (``requested`` labels are for the digits judge; ignored.)"""
        return self._score(to_uint8(images), name)

    def ceiling(self, n: int, *, seed: int) -> InceptionScores:
        return self._score(self.held[:n], "real images (ceiling)")

    def floor(self, n: int, *, seed: int, image_size: int) -> InceptionScores:
        c = self.held.shape[1]
        g = torch.Generator().manual_seed(seed)
        noise = torch.randint(0, 256, (n, c, image_size, image_size), generator=g, dtype=torch.uint8)
        return self._score(noise, "uniform noise (floor)")
