"""Training the first-stage autoencoder (autoencoder.py): the loop, the latent scale, and its report.

    python main.py --mode train_autoencoder --dataset digits                  # 8x8 -> 4x4x4 latents
    python main.py --mode train_autoencoder --dataset mnist --max_steps 4000  # 28x28 -> 8x8x4 (padded to 32)

AdamW with warm-up and cosine decay, batches from ``data.ImageSet.batch`` (a function of seed and step),
gradient clipping. At the end: the latent scale (1 / std of the posterior means over the whole training
set, so scaled latents have unit variance there, as in the latent diffusion paper), then PSNR and SSIM
of reconstructions of held-out images (the test split, or for digits and folders a fixed 10% that
training never sees) next to two bilinear baselines: the image shrunk to the latent's side and grown
back, and shrunk to as many numbers as the latent holds. A PNG shows held-out originals above their
reconstructions, beside the checkpoint. A run stopped early (Ctrl-C, a diverged loss) writes nothing.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ddpm.choices import AUTOENCODER_DEFAULTS
from ddpm.data.catalog import TEST_SPLITS
from ddpm.data.datasets import ImageSet, load_images
from ddpm.data.image_files import save_grid, to_uint8
from ddpm.evaluation.voxels import skimage_metrics
from ddpm.kernels.ops import use_fused_norms
from ddpm.latent.autoencoder import (
    Autoencoder,
    autoencoder_loss,
    checkpoint_state,
    posterior_means,
    requested_config,
    to_unit_range,
)
from ddpm.requests import AutoencoderTrainRequest
from ddpm.training.timestep_sampling import lr_factor
from ddpm.util import messages
from ddpm.util.memory import keep_freed_memory
from ddpm.util.messages import TrainingDiverged
from ddpm.util.safe_files import atomic_write

DEFAULT_STEPS = AUTOENCODER_DEFAULTS["max_steps"]  # the run's length without --max_steps or --n_epochs
GRAD_CLIP = 1.0
HOLDOUT_SHARE, HOLDOUT_SEED = 0.1, 0  # digits and folders: this share, drawn from this seed, is never trained on
MAX_SCORED = 1000  # held-out images scored (the first ones: a test split's order is fixed)
PNG_IMAGES = 16  # held-out images in the reconstructions PNG
PSNR_CAP = 100.0  # dB: an exact copy (infinite PSNR) scores this


def total_steps(*, n_epochs: int | None, max_steps: int | None, steps_per_epoch: int) -> int:
    """--max_steps alone sets the length; --n_epochs sets it in passes over the data, capped by --max_steps."""
    if n_epochs is None:
        return max_steps or DEFAULT_STEPS
    total = n_epochs * steps_per_epoch
    return min(total, max_steps) if max_steps else total


def split_heldout(images: ImageSet, *, data_dir: str | Path) -> tuple[ImageSet, torch.Tensor, str]:
    """(training images, held-out uint8 images, how they were held out): the dataset's test split, or a
    fixed share of the images (the same whatever --seed) removed from the training set."""
    if images.name in TEST_SPLITS:
        held = load_images(
            images.name, data_dir=data_dir, image_size=images.image_size, channels=images.channels, train=False
        )
        return images, held.images, "its test split"
    n = len(images)
    if n < 2:
        raise ValueError(
            f"the autoencoder needs at least 2 {images.name} images: one to train on, one held out to score"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(HOLDOUT_SEED))
    k = max(1, round(HOLDOUT_SHARE * n))
    held, kept = order[:k].sort().values, order[k:].sort().values
    labels = None if images.labels is None else images.labels[kept]
    train = replace(images, images=images.images[kept], labels=labels)
    return train, images.images[held], f"a fixed {HOLDOUT_SHARE:.0%} held out"


# ----- scores ------------------------------------------------------------------------------------
def psnr_ssim(images: torch.Tensor, truth: torch.Tensor) -> tuple[float, float]:
    """Mean PSNR (dB, each image capped at PSNR_CAP) and mean SSIM of uint8 (N, C, H, W) ``images``
    against ``truth``, on [0, 1] pixels (scikit-image; SSIM's window 7, or the largest odd one that fits)."""
    peak_signal_noise_ratio, structural_similarity = skimage_metrics("the autoencoder's PSNR and SSIM")
    a, b = images.double().div(255).numpy(), truth.double().div(255).numpy()
    window = min(7, a.shape[-1])
    window -= 1 - window % 2  # odd
    psnr, ssim = [], []
    for x, y in zip(a, b):
        exact = bool((x == y).all())
        psnr.append(PSNR_CAP if exact else min(PSNR_CAP, float(peak_signal_noise_ratio(y, x, data_range=1.0))))
        ssim.append(float(structural_similarity(x, y, data_range=1.0, channel_axis=0, win_size=window)))
    return sum(psnr) / len(psnr), sum(ssim) / len(ssim)


@torch.no_grad()
def reconstruct(model: Autoencoder, images: torch.Tensor, *, batch_size: int = 256) -> torch.Tensor:
    """uint8 (N, C, H, W) -> uint8 reconstructions from the posterior means (as latent diffusion decodes)."""
    device = next(model.parameters()).device
    out = [
        to_uint8(model.decode(model.encode(to_unit_range(chunk.to(device)))[0])) for chunk in images.split(batch_size)
    ]
    return torch.cat(out)


def bilinear_roundtrip(images: torch.Tensor, side: int) -> torch.Tensor:
    """uint8 (N, C, H, W) shrunk to side x side (bilinear, antialiased) and grown back: the trivial baseline."""
    x = to_unit_range(images)
    small = F.interpolate(x, size=(side, side), mode="bilinear", antialias=True, align_corners=False)
    return to_uint8(F.interpolate(small, size=x.shape[-2:], mode="bilinear", align_corners=False))


def score_reconstructions(model: Autoencoder, heldout: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """PSNR/SSIM of the autoencoder and the two bilinear baselines on ``heldout``; and the reconstructions."""
    config = model.config
    numbers = math.prod(config.latent_shape)
    same = min(config.image_size, math.isqrt(numbers // config.in_channels))  # a side holding at most as many numbers
    recon = reconstruct(model, heldout)
    scores = {"autoencoder": dict(zip(("psnr", "ssim"), psnr_ssim(recon, heldout)), numbers=numbers)}
    for name, side in (("bilinear_latent_side", config.latent_side), ("bilinear_same_numbers", same)):
        psnr, ssim = psnr_ssim(bilinear_roundtrip(heldout, side), heldout)
        scores[name] = {"psnr": psnr, "ssim": ssim, "numbers": config.in_channels * side * side, "side": side}
    return scores, recon


def format_scores(metrics: dict) -> str:
    c, s = metrics["image_shape"][0], metrics["image_shape"][1]
    lines = [
        f"held-out reconstructions ({metrics['heldout_images']} images, {metrics['heldout']}):",
        f"{'':<34}{'numbers':>8}{'PSNR dB':>9}{'SSIM':>7}",
    ]
    labels = {"autoencoder": "autoencoder (posterior mean)"}
    for name, row in metrics["scores"].items():
        label = labels.get(name) or f"bilinear via {row['side']}x{row['side']}" + (
            " (identity)" if row["side"] == s else ""
        )
        lines.append(f"{label:<34}{row['numbers']:>8}{row['psnr']:>9.2f}{row['ssim']:>7.3f}")
    lines.append(f"(images {c}x{s}x{s}: {c * s * s} numbers)")
    return "\n".join(lines)


# ----- the run -----------------------------------------------------------------------------------
def train_autoencoder(request: AutoencoderTrainRequest, *, progress: bool = True) -> dict:
    """Train, scale, score, and write the PNG and the checkpoint; returns the metrics stored in it."""
    config = requested_config(request)  # validated before any data is read
    skimage_metrics("the autoencoder's PSNR and SSIM")  # a missing package is reported now, not after training
    images = load_images(
        request.dataset, data_dir=request.data_dir, image_size=config.image_size, channels=config.in_channels
    )
    train, heldout, held_how = split_heldout(images, data_dir=request.data_dir)
    per_epoch = train.steps_per_epoch(request.batch_size)
    total = total_steps(n_epochs=request.n_epochs, max_steps=request.max_steps, steps_per_epoch=per_epoch)
    device = request.device
    torch.manual_seed(request.seed)  # the weights
    # On a CPU, as the U-Net's trainer: channels-last activations (oneDNN's convolutions train faster on them), the
    # blocks' GroupNorm and SiLU through the extension's fused op and its backward where it is built, fused AdamW,
    # and freed activations kept for the next step (BENCHMARKS.md, "The training step against its peers").
    cpu = device.type == "cpu"
    layout = torch.channels_last if cpu else torch.contiguous_format
    model = Autoencoder(config).to(device, memory_format=layout)
    fused = cpu and use_fused_norms(model) > 0
    if cpu:
        keep_freed_memory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=request.lr, weight_decay=0.0, fused=cpu or None)
    generator = torch.Generator(device).manual_seed(request.seed)  # the posterior samples
    warmup = min(100, total // 20)
    n_params = sum(p.numel() for p in model.parameters())
    shape, latent = ("x".join(map(str, s)) for s in (config.image_shape, config.latent_shape))
    print(
        f"training a {n_params / 1e3:.0f}k-parameter autoencoder on {len(train)} {request.dataset} images "
        f"({shape} -> latent {latent}, kl_weight {config.kl_weight:g}) for {total} steps on {device.type}"
        + (" (fused norms)" if fused else "")
    )
    start = window = time.perf_counter()
    stop, done = None, 0  # Ctrl-C / SIGTERM take effect between steps; the model so far is then saved
    try:
        with (
            messages.deferred(),
            tqdm(total=total, desc="training", unit="step", disable=not progress, dynamic_ncols=True) as bar,
        ):
            for step in range(total):
                messages.raise_if_pending()
                lr = request.lr * lr_factor(step, warmup_steps=warmup, total_steps=total)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                x = train.batch(step, batch_size=request.batch_size, seed=request.seed, device=device)  # (B, C, H, W)
                x = x.contiguous(memory_format=layout)
                x_hat, mean, logvar = model(x, generator=generator)
                loss, l1, kl = autoencoder_loss(x, x_hat, mean, logvar, kl_weight=config.kl_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
                value = loss.item()  # sync: a non-finite loss stops the run before it reaches the weights
                if not math.isfinite(value):
                    raise TrainingDiverged(
                        f"the autoencoder's loss was non-finite at step {step}; try a lower --lr (nothing was written)"
                    )
                optimizer.step()
                done = step + 1
                bar.update(1)
                if time.perf_counter() - window > 1.0 or step == total - 1:
                    bar.set_postfix(loss=f"{value:.4f}", l1=f"{l1.item():.4f}", kl=f"{kl.item():.1f}", lr=f"{lr:.1e}")
                    window = time.perf_counter()
    except KeyboardInterrupt as exc:  # the save below runs, then the run ends with the signal
        stop = exc if isinstance(exc, messages.Interrupted) else messages.Interrupted()
    if stop is not None and done == 0:
        print(f"\n{stop.name}: stopped before the first step; nothing was saved", file=sys.stderr)
        raise stop
    with messages.deferred(reraise=False):  # a signal now does not cut the save of what was trained
        metrics = _finish(
            model,
            request,
            config=config,
            train=train,
            heldout=heldout,
            held_how=held_how,
            steps=done,
            seconds=time.perf_counter() - start,
        )
    if stop is not None:
        print(f"\n{stop.name}: stopped at step {done} of {total}; saved {request.checkpoint}", file=sys.stderr)
        raise stop
    return metrics


def _finish(
    model: Autoencoder,
    request: AutoencoderTrainRequest,
    *,
    config,
    train,
    heldout,
    held_how: str,
    steps: int,
    seconds: float,
) -> dict:
    """The latent scale, the held-out scores, the PNG and the checkpoint of a model trained ``steps`` steps."""
    model.eval()

    # The latent scale: unit variance of the posterior means over the whole training set.
    means = posterior_means(model, train.images).double()
    std = float(means.std())
    if not (math.isfinite(std) and std > 0):
        raise TrainingDiverged(f"the latents' standard deviation is {std}; the autoencoder learned nothing usable")
    heldout = heldout[:MAX_SCORED]
    scores, recon = score_reconstructions(model, heldout)
    metrics = {
        "scores": scores,
        "heldout": held_how,
        "heldout_images": len(heldout),
        "train_images": len(train),
        "image_shape": list(config.image_shape),
        "latent_shape": list(config.latent_shape),
        "latent_mean": float(means.mean()),
        "latent_std": std,
        "train_seconds": seconds,
        "device": request.device.type,
        "batch_size": request.batch_size,
        "lr": request.lr,
        "seed": request.seed,
    }
    mean = metrics["latent_mean"]
    print(
        f"latent scale {1 / std:.4f} (posterior means over {len(train)} training images: mean {mean:.3f}, std "
        f"{std:.4f})"
    )
    print(format_scores(metrics))

    # The PNG, then the checkpoint: held-out originals above their reconstructions.
    n = min(PNG_IMAGES, len(heldout))
    save_grid(to_unit_range(torch.cat([heldout[:n], recon[:n]])), request.reconstructions, columns=n)
    state = checkpoint_state(model, latent_scale=1.0 / std, dataset=request.dataset, metrics=metrics, step=steps)
    atomic_write(request.checkpoint, lambda f: torch.save(state, f))
    print(f"wrote {request.reconstructions} and {request.checkpoint} ({steps} steps in {seconds:.0f} s)")
    return metrics
