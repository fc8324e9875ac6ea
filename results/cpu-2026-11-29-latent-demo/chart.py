"""Quality against training minutes: the latent recipe (this search) against the pixel recipe it replaces, the minutes
measured on the AVX2-only AMD EPYC (the latent phases on 2026-11-30, results/cpu-2026-11-30-epyc-avx2; the pixel step
on 2026-11-29), the scores from search.json.

    python results/cpu-2026-11-29-latent-demo/chart.py docs/mnist_recipe.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

out = sys.argv[1]
AE_S, STEP_S = 70.0, 0.148  # make demo on the EPYC: the autoencoder's 800 steps, one U-Net step of 128 (1,000 in 148 s)
PIXEL_STEP_S = 1.892  # the pixel recipe's step there (--bench training)
SCORES = {r["run"]: r["scores"] for r in json.load(open("results/cpu-2026-11-29-latent-demo/search.json"))}


def latent_minutes(steps):
    return (AE_S + STEP_S * steps) / 60


def mean(key):
    vals = [SCORES[key][seed] for seed in ("1", "2")]  # (confident share, Frechet, classes, near-copies)
    return sum(v[0] for v in vals) / 2 * 100, sum(v[1] for v in vals) / 2


latent = [(latent_minutes(n), *mean(k)) for n, k in ((600, "lat_N600"), (1000, "lat_N"), (1500, "lat_N1500"))]
runner_up = [(latent_minutes(n), *mean(k)) for n, k in ((600, "lat_K600"), (1000, "lat_J0"), (1500, "lat_K1500"))]
pixel = [(600 * PIXEL_STEP_S / 60, 73.6, 2.697), (1800 * PIXEL_STEP_S / 60, 83.6, 1.653)]  # BENCHMARKS: seed 1 only
fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
for ax, col, label in ((axes[0], 1, "confidently one digit (%)"), (axes[1], 2, "Fréchet distance (lower is better)")):
    ax.plot(
        [p[0] for p in latent],
        [p[col] for p in latent],
        "o-",
        label="latent, make demo's recipe (600, 1,000, 1,500 steps)",
    )
    ax.plot([p[0] for p in runner_up], [p[col] for p in runner_up], "^:", label="latent, without Min-SNR")
    ax.plot(
        [p[0] for p in pixel], [p[col] for p in pixel], "s--", label="pixel (the former demo-mnist: 600, 1,800 steps)"
    )
    ax.set_xlabel("training minutes on a 2-core AVX2-only CPU (AMD EPYC)")
    ax.set_ylabel(label)
    ax.set_xscale("log")
    ax.set_xticks([2, 3, 5, 10, 20, 40, 60])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.grid(alpha=0.3)
axes[0].axhline(93.2, color="grey", lw=0.8, ls=":")
axes[0].text(2.1, 92, "real held-out digits", fontsize=8, color="grey", va="top")
axes[1].axhline(1.127, color="grey", lw=0.8, ls=":")
axes[1].text(2.1, 1.16, "real held-out digits", fontsize=8, color="grey")
axes[0].set_ylim(60, 95)
axes[0].legend(fontsize=8, loc="lower right")
fig.suptitle("28×28 MNIST digits: quality against training time (512 samples, SDE-DPM-Solver++ 20)", fontsize=10)
fig.tight_layout()
fig.savefig(out, dpi=110)
print(latent, runner_up, pixel)
