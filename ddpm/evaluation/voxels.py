"""Voxel metrics: how good a 3-D model's volumes are (evaluate mode, ``metric: "voxels"``).

Scored by :class:`VoxelJudge`, with the same interface as ``quality.DigitJudge`` and
``inception.InceptionJudge``:

* **IoU**: each volume, thresholded at 0.5, against the sphere fitted to it (:func:`fit_sphere`: the
  occupied voxels' centroid, and the radius of a ball of their count): 1 for a perfect sphere, about
  1/3 for uniform noise (a random half of the voxels against a ball of the same count);
* **PSNR and SSIM** (3-D, scikit-image) against the nearest real volume of the reference (the
  training data, by L2 distance): how close a sample is to something real;
* the fitted radii (mean and spread), and the shares of fitted radii and centres within the
  range the spheres are drawn from.

    judge = VoxelJudge(train_volumes, held_out_volumes, seed=0)
    scores = judge.score(samples, name="ddpm 50")           # samples: (N, 1, S, S, S) in [-1, 1]
    print(voxel_table({"rows": [...], "ceiling": asdict(judge.ceiling(64, seed=0)), "floor": ...}))

Every table carries its ceiling (held-out real volumes, scored like samples) and floor (uniform noise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ddpm.data.volumes import centre_box, check_count, check_volumes, radius_range, to_unit

REFERENCE_CHUNK = 256  # reference volumes compared at once in the nearest-neighbour search
PSNR_CAP = 100.0  # dB: an exact copy (infinite PSNR) scores this
IOU_OK = 0.8  # a sample "is a sphere" at this best-fit IoU
CENTRE_TOLERANCE = 0.5  # voxels: fitted centres this far outside the drawn centres' box still count


@dataclass
class SphereFit:
    """The sphere fitted to one volume, in voxels (z, y, x); NaN centre and zero radius when empty."""

    centre: tuple[float, float, float]
    radius: float
    iou: float  # thresholded volume against the voxelised fitted sphere


def fit_sphere(volume) -> SphereFit:
    """Fit a sphere to one (D, H, W) volume in [0, 1]: threshold at 0.5; centre = the occupied voxels'
    centroid, radius = that of a ball of their count ((3 count / 4 pi)^(1/3)); IoU between the occupied
    voxels and the voxels whose centres lie within the fitted radius."""
    v = volume.detach().cpu().numpy() if isinstance(volume, torch.Tensor) else np.asarray(volume)
    if v.ndim != 3:
        raise ValueError(f"fit_sphere takes one (D, H, W) volume, got shape {v.shape}")
    occupied = v > 0.5  # (D, H, W)
    count = int(occupied.sum())
    if count == 0:
        return SphereFit(centre=(math.nan, math.nan, math.nan), radius=0.0, iou=0.0)
    coords = np.nonzero(occupied)  # three (count,) index arrays
    centre = tuple(float(c.mean()) for c in coords)
    radius = (3 * count / (4 * math.pi)) ** (1 / 3)
    z, y, x = (np.arange(n, dtype=np.float64) for n in v.shape)
    dist2 = (
        ((z - centre[0]) ** 2)[:, None, None]
        + ((y - centre[1]) ** 2)[None, :, None]
        + ((x - centre[2]) ** 2)[None, None, :]
    )  # (D, H, W)
    ball = dist2 <= radius**2  # (D, H, W)
    union = int((occupied | ball).sum())
    iou = int((occupied & ball).sum()) / union
    return SphereFit(centre=centre, radius=float(radius), iou=float(iou))


def ssim_window(size: int) -> int:
    """The SSIM window for ``size``^3 volumes: 7, or the largest odd size that fits (at least 3)."""
    win = min(7, size)
    win -= 1 - win % 2  # odd
    if win < 3:
        raise ValueError(f"3-D SSIM needs volumes of at least 3^3 voxels, got {size}^3")
    return win


def skimage_metrics(purpose: str = "3-D SSIM"):
    """scikit-image's PSNR and SSIM, imported when needed; one line naming ``purpose`` if it is missing."""
    try:
        from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    except ImportError as exc:
        raise ValueError(f"{purpose} needs scikit-image: pip install scikit-image") from exc
    return peak_signal_noise_ratio, structural_similarity


def psnr_ssim(volume: np.ndarray, truth: np.ndarray) -> tuple[float, float]:
    """(PSNR in dB, capped at PSNR_CAP; 3-D SSIM) of ``volume`` against ``truth``, both (D, D, D) in [0, 1]."""
    peak_signal_noise_ratio, structural_similarity = skimage_metrics()
    a, b = np.asarray(volume, dtype=np.float64), np.asarray(truth, dtype=np.float64)
    mse = float(np.mean((a - b) ** 2))
    psnr = PSNR_CAP if mse == 0 else min(PSNR_CAP, float(peak_signal_noise_ratio(b, a, data_range=1.0)))
    ssim = float(structural_similarity(a, b, data_range=1.0, win_size=ssim_window(min(a.shape))))
    return psnr, ssim


@dataclass
class VoxelScores:
    """One set of volumes scored: sphere fits, and closeness to the nearest real (reference) volume."""

    name: str
    n: int
    iou: float  # median best-fit-sphere IoU
    iou_ok: float  # share with IoU >= IOU_OK
    psnr: float  # median dB against the nearest reference volume (capped at PSNR_CAP)
    ssim: float  # median 3-D SSIM against the nearest reference volume
    radius_mean: float  # fitted radii, voxels (0 for an empty volume)
    radius_std: float
    radius_in_range: float  # share of fitted radii within the spheres' radius range, +-1 voxel
    centre_in_range: float  # share of fitted centres within the drawn centres' box, +-CENTRE_TOLERANCE
    seconds: float | None = None  # the time to draw them, when drawn


def _check_uint8_volumes(volumes: torch.Tensor, *, what: str) -> torch.Tensor:
    volumes = check_volumes(volumes, what=what)
    if volumes.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8 0..255, got {volumes.dtype}")
    d, h, w = volumes.shape[2:]
    if volumes.shape[1] != 1 or not d == h == w:
        raise ValueError(f"{what} must be (N, 1, S, S, S), got shape {tuple(volumes.shape)}")
    return volumes


class VoxelJudge:
    """Scores volumes by their best-fit spheres and by PSNR/SSIM against the nearest ``reference`` volume
    (uint8 (N, 1, S, S, S): the data the model trained on); its ceiling is ``held`` (other real volumes:
    held-out spheres, or for a folder of volumes those outside the reference), its floor uniform noise."""

    kind = "voxels"

    def __init__(self, reference: torch.Tensor, held: torch.Tensor, *, seed: int = 0) -> None:
        self.reference = _check_uint8_volumes(reference, what="reference volumes").cpu()
        self.held = _check_uint8_volumes(held, what="held-out volumes").cpu()
        self.size = self.reference.shape[-1]
        if self.held.shape[-1] != self.size:
            raise ValueError(f"held-out volumes are {self.held.shape[-1]}^3 and reference volumes {self.size}^3")
        ssim_window(self.size)  # refuses volumes too small for SSIM now, not after sampling
        skimage_metrics()  # ... and a missing scikit-image
        self.seed = seed
        flat = self.reference.flatten(1)  # (N, V) uint8
        self.reference_norms = torch.cat(
            [(part.float() / 255).square().sum(1) for part in flat.split(REFERENCE_CHUNK)]
        )  # (N,) squared L2 norms in [0, 1] space

    def nearest(self, unit: torch.Tensor) -> torch.Tensor:
        """The index of the nearest reference volume (L2 in [0, 1] space) for float (n, 1, S, S, S) in [0, 1]."""
        x = unit.flatten(1).float()  # (n, V)
        x_norms = x.square().sum(1, keepdim=True)  # (n, 1)
        best = torch.full((len(x),), math.inf)
        index = torch.zeros(len(x), dtype=torch.long)
        flat = self.reference.flatten(1)
        for start in range(0, len(flat), REFERENCE_CHUNK):
            ref = flat[start : start + REFERENCE_CHUNK].float() / 255  # (m, V)
            d2 = x_norms - 2 * x @ ref.T + self.reference_norms[start : start + len(ref)][None]  # (n, m)
            value, arg = d2.min(1)
            better = value < best
            best = torch.where(better, value, best)
            index = torch.where(better, arg + start, index)
        return index

    def score(self, images: torch.Tensor, *, name: str, requested: torch.Tensor | None = None) -> VoxelScores:
        """Score float (N, 1, S, S, S) volumes in [-1, 1]. (``requested`` labels are for the digits judge; ignored.)"""
        images = check_volumes(images, what="volumes to score")
        if tuple(images.shape[1:]) != (1, self.size, self.size, self.size):
            raise ValueError(
                f"volumes to score must be (N, 1, {self.size}, {self.size}, {self.size}) like the reference, "
                f"got {tuple(images.shape)}"
            )
        unit = to_unit(images)  # (N, 1, S, S, S) in [0, 1]
        nearest = self.nearest(unit)  # (N,)
        volumes = unit[:, 0].double().numpy()  # (N, S, S, S)
        fits = [fit_sphere(v) for v in volumes]
        pairs = [psnr_ssim(v, self.reference[int(j), 0].double().numpy() / 255) for v, j in zip(volumes, nearest)]
        iou = np.array([f.iou for f in fits])
        radii = np.array([f.radius for f in fits])
        centres = np.array([f.centre for f in fits])  # (N, 3), NaN for empty volumes
        r_low, r_high = radius_range(self.size)
        c_low, c_high = centre_box(self.size)
        with np.errstate(invalid="ignore"):  # NaN centres are out of range
            centre_ok = ((centres >= c_low - CENTRE_TOLERANCE) & (centres <= c_high + CENTRE_TOLERANCE)).all(1)
        return VoxelScores(
            name=name,
            n=len(fits),
            iou=float(np.median(iou)),
            iou_ok=float((iou >= IOU_OK).mean()),
            psnr=float(np.median([p for p, _ in pairs])),
            ssim=float(np.median([s for _, s in pairs])),
            radius_mean=float(radii.mean()),
            radius_std=float(radii.std()),
            radius_in_range=float(((radii >= r_low) & (radii <= r_high)).mean()),
            centre_in_range=float(centre_ok.mean()),
        )

    def ceiling(self, n: int, *, seed: int) -> VoxelScores:
        """The first ``n`` held-out real volumes, scored like samples."""
        n = check_count(n, what="the ceiling's volume count", low=1)
        if n > len(self.held):
            raise ValueError(f"the ceiling takes {n} held-out real volumes and there are {len(self.held)}")
        return self.score(self.held[:n].float() / 127.5 - 1, name="real volumes (ceiling)")

    def floor(self, n: int, *, seed: int, image_size: int) -> VoxelScores:
        """``n`` volumes of uniform noise in [-1, 1], drawn from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        noise = torch.rand(n, 1, image_size, image_size, image_size, generator=g) * 2 - 1
        return self.score(noise, name="uniform noise (floor)")


def voxel_table(result: dict, *, labels: list[str] | None = None) -> str:
    """evaluate's table for volumes: one line per (sampler, steps), then the ceiling and the floor; ``labels`` name
    the rows (quality.row_label: a student's file too; default: their samplers)."""
    labels = labels or [str(row["sampler"]) for row in result["rows"]]
    w = max([16, *(len(label) + 2 for label in labels)])
    head = (
        f"{'sampler':<{w}}{'steps':>6}{'IoU (median)':>14}{'IoU>=0.8':>10}{'PSNR':>8}{'SSIM':>8}"
        f"{'radius mean±std':>18}{'seconds':>9}"
    )
    lines = [head]

    def number(value, spec: str, scale: float = 1.0) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(scale * value, spec)

    def line(label: str, steps: str, s: dict) -> str:
        share = number(s.get("iou_ok"), ".1f", 100)
        radius = number(s.get("radius_mean"), ".2f")
        if radius != "-":
            radius += f" ± {number(s.get('radius_std'), '.2f')}"
        return (
            f"{label:<{w}}{steps:>6}{number(s.get('iou'), '.3f'):>14}{share + ('%' if share != '-' else ''):>10}"
            f"{number(s.get('psnr'), '.2f'):>8}{number(s.get('ssim'), '.3f'):>8}{radius:>18}"
            f"{number(s.get('seconds'), '.1f'):>9}"
        )

    for label, row in zip(labels, result["rows"]):
        lines.append(line(label, str(row["steps"]), row))
    lines.append(line("real volumes", "-", result["ceiling"]) + "   (ceiling: held-out real volumes)")
    lines.append(line("noise", "-", result["floor"]) + "   (floor: uniform noise)")
    return "\n".join(lines)
