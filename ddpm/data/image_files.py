"""Image outputs: the PNG sample grid and the .npz of samples, written without holding every sample.

Sampling draws ``--n_samples`` in batches; each batch goes to a :class:`SampleWriter`, which keeps
only the grid's tiles (uint8, at most :data:`MAX_GRID_PIXELS` of picture) and streams the pixels
into the ``images`` array of an .npz as they come, so memory does not grow with the count. Both
files appear atomically when the writer closes; a failed or interrupted run leaves neither.

    outputs = SampleOutputs(n_samples, (C, H, W), grid="samples.png", npz="s.npz")
    outputs.check()                       # refuse, before any sampling, what could not be written
    with SampleWriter(outputs) as out:
        for images in batches:  # (B, C, H, W) in [-1, 1]
            out.add(images)
"""

from __future__ import annotations

import contextlib
import math
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ddpm.util.safe_files import atomic_open, atomic_write

GRID_PADDING = 2  # torchvision's default: 2 black pixels between tiles
MAX_GRID_PIXELS = 4096 * 4096  # one PNG; its pixels are held in memory while it is encoded
MIN_TILE = 64  # by default, tiles are enlarged (nearest neighbour) to at least this many pixels a side


def grid_side(n_images: int) -> int:
    """Tiles per row of a square-ish grid."""
    return max(1, math.ceil(math.sqrt(n_images)))


def grid_pixels(n_images: int, *, height: int, width: int, columns: int | None = None) -> int:
    if n_images == 1:
        return height * width
    cols = columns or grid_side(n_images)
    rows = math.ceil(n_images / cols)
    return (rows * (height + GRID_PADDING) + GRID_PADDING) * (cols * (width + GRID_PADDING) + GRID_PADDING)


def choose_grid_scale(
    n_images: int, *, height: int, width: int, requested: int | None = None, columns: int | None = None
) -> int:
    """The integer factor each tile is enlarged by: ``requested``, or by default the smallest that
    makes tiles :data:`MIN_TILE` pixels a side (8x8 digits x8, MNIST x3, CIFAR-10 x2), lowered
    until the grid fits in one PNG."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--grid_scale must be a positive integer, got {requested}")
        return requested
    scale = max(1, math.ceil(MIN_TILE / max(height, width)))
    while scale > 1 and grid_pixels(n_images, height=height, width=width, columns=columns) * scale**2 > MAX_GRID_PIXELS:
        scale -= 1
    return scale


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) in [-1, 1] -> uint8 on the CPU, rounded as torchvision's PNG writer rounds."""
    # sync: the batch comes to the host once.
    x01 = (images.detach().float().cpu().clamp(-1, 1) + 1) / 2
    return x01.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)


def grid_image(tiles: torch.Tensor, *, scale: int = 1, columns: int | None = None) -> Image.Image:
    """(B, C, H, W) uint8 tiles -> one RGB PIL image in torchvision's ``make_grid`` layout: rows of
    ``columns`` (default :func:`grid_side`) tiles, :data:`GRID_PADDING` black pixels around each, then enlarged
    ``scale`` times, each pixel becoming a ``scale`` x ``scale`` block (nearest neighbour)."""
    n, c, h, w = tiles.shape
    if n == 1:  # make_grid returns a single image as it is, unpadded
        grid = tiles[0].permute(1, 2, 0).expand(h, w, 3).numpy()
    else:
        cols = columns or grid_side(n)
        rows = math.ceil(n / cols)
        step_h, step_w = h + GRID_PADDING, w + GRID_PADDING
        grid = np.zeros((rows * step_h + GRID_PADDING, cols * step_w + GRID_PADDING, 3), dtype=np.uint8)
        pixels = tiles.permute(0, 2, 3, 1).expand(n, h, w, 3).numpy()  # grey -> RGB, as make_grid does
        for i, tile in enumerate(pixels):
            top, left = (i // cols) * step_h + GRID_PADDING, (i % cols) * step_w + GRID_PADDING
            grid[top : top + h, left : left + w] = tile
    if scale > 1:
        grid = grid.repeat(scale, axis=0).repeat(scale, axis=1)
    return Image.fromarray(np.ascontiguousarray(grid))


VOLUMES_SHOWN = 16  # a volume PNG shows the first 16 volumes, one row of slices and a projection each


def save_grid(images: torch.Tensor, path: str | Path, *, scale: int | None = None, columns: int | None = None) -> Path:
    """Save (B, C, H, W) images in [-1, 1] as a PNG grid (square-ish, or ``columns`` wide), atomically
    (``scale``: see :func:`choose_grid_scale`). Volumes (B, C, D, H, W): their mid-slices and projections."""
    if images.ndim == 5:
        from ddpm.data import volumes

        volumes.save_volume_png(images[:VOLUMES_SHOWN], path)
        return Path(path)
    n, _, h, w = images.shape
    scale = choose_grid_scale(n, height=h, width=w, requested=scale, columns=columns)
    picture = grid_image(to_uint8(images), scale=scale, columns=columns)
    return atomic_write(path, lambda f: picture.save(f, format="png"))


@dataclass(frozen=True)
class SampleOutputs:
    """The files one sampling run writes: a PNG grid and/or an .npz of ``n_samples`` images of ``image_shape``."""

    n_samples: int
    image_shape: tuple[int, ...]  # (C, H, W), or (C, D, H, W) for volumes
    grid: str | Path | None = None
    npz: str | Path | None = None
    grid_scale: int | None = None  # None: chosen so tiles are at least MIN_TILE pixels
    grid_columns: int | None = None  # None: a square-ish grid (class-conditional runs: one row per class)

    def check(self) -> None:
        """Refuse, before any sampling, outputs that cannot be written: a grid too large (at ``grid_scale``,
        or unscaled when that is left to the default), an .npz beyond free disk."""
        n, (_, *spatial) = self.n_samples, self.image_shape
        h, w = spatial[-2:]
        if self.grid is not None and len(spatial) == 3 and self.grid_scale is not None:
            raise ValueError(
                "--grid_scale enlarges image grids; a volume PNG (slices and projections) has its own size"
            )
        if self.grid is not None and len(spatial) == 2:  # a volume PNG shows VOLUMES_SHOWN volumes whatever n is
            scale = self.grid_scale or 1
            pixels = grid_pixels(n, height=h, width=w, columns=self.grid_columns) * scale**2
            if pixels > MAX_GRID_PIXELS:
                fits = _largest_grid(height=h, width=w, scale=scale)
                lower = "lower --grid_scale or --n_samples" if scale > 1 else "lower --n_samples"
                raise ValueError(
                    f"a grid of {n} samples of {h}x{w} would have {pixels / 1e6:.0f} million pixels; one PNG holds at "
                    f"most {fits} of them: {lower}, or pass --no_grid with --save_npz to keep only the arrays"
                )
        if self.npz is not None:
            each = math.prod(self.image_shape)
            need = n * each + (1 << 20)  # stored pixels (compression only shrinks them) + headers
            folder = next(p for p in Path(self.npz).parents if p.exists())  # as typed ("." exists)
            free = shutil.disk_usage(folder).free
            if need > free:
                raise ValueError(
                    f"--save_npz {self.npz} may need {need / 2**30:.2f} GiB and {folder} has {free / 2**30:.2f} GiB "
                    f"free; at most about {max(0, free - (1 << 20)) // each} samples of "
                    f"{'x'.join(map(str, self.image_shape))} fit"
                )


def _largest_grid(*, height: int, width: int, scale: int = 1) -> int:
    n = 1
    while grid_pixels(n + 1, height=height, width=width) * scale**2 <= MAX_GRID_PIXELS:
        n += 1
    return n


class SampleWriter:
    """Receives batches of samples; writes the grid PNG and the .npz (uint8, NHWC) on close."""

    def __init__(self, outputs: SampleOutputs) -> None:
        n_samples, image_shape = outputs.n_samples, outputs.image_shape
        self.n_samples, self.image_shape = n_samples, image_shape
        self.grid, self.npz = outputs.grid, outputs.npz
        self.volumes = len(image_shape) == 4  # (C, D, H, W)
        h, w = image_shape[-2:]
        self.grid_columns = outputs.grid_columns
        self.grid_scale = choose_grid_scale(
            n_samples, height=h, width=w, requested=outputs.grid_scale, columns=self.grid_columns
        )
        self.tiles: list[torch.Tensor] = []
        self.written = 0
        self._stack = contextlib.ExitStack()
        self._array = None
        if self.npz is not None:
            c, *spatial = image_shape
            f = self._stack.enter_context(atomic_open(self.npz))
            archive = self._stack.enter_context(zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED))
            self._array = self._stack.enter_context(archive.open("images.npy", "w", force_zip64=True))
            header = {
                "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                "fortran_order": False,
                "shape": (n_samples, *spatial, c),
            }
            np.lib.format.write_array_header_1_0(self._array, header)

    def add(self, images: torch.Tensor) -> None:
        """One batch, (B, C, H, W) or (B, C, D, H, W) in [-1, 1]."""
        pixels = to_uint8(images)
        if self.written + pixels.shape[0] > self.n_samples:
            raise ValueError(f"more samples than the {self.n_samples} announced")
        if self.grid is not None and not (self.volumes and self.written >= VOLUMES_SHOWN):
            self.tiles.append(pixels[: VOLUMES_SHOWN - self.written] if self.volumes else pixels)
        self.written += pixels.shape[0]
        if self._array is not None:
            channels_last = pixels.permute(0, *range(2, pixels.ndim), 1)  # NHWC, or NDHWC for volumes
            self._array.write(channels_last.contiguous().numpy().tobytes())

    def close(self) -> list[Path]:
        """Write the files (only if every announced sample arrived); returns their paths."""
        if self.written != self.n_samples:
            raise ValueError(f"{self.written} of {self.n_samples} samples arrived; nothing written")
        written = []
        if self.grid is not None and self.volumes:
            written.append(save_grid(torch.cat(self.tiles).float() / 127.5 - 1, self.grid))
        elif self.grid is not None:
            picture = grid_image(torch.cat(self.tiles), scale=self.grid_scale, columns=self.grid_columns)
            written.append(atomic_write(self.grid, lambda f: picture.save(f, format="png")))
        self._stack.close()  # finishes the .npz and moves it into place
        if self.npz is not None:
            written.append(Path(self.npz))
        return written

    def __enter__(self) -> SampleWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            # Drop the partial .npz: close the stack with the exception, so atomic_open discards it.
            self._stack.__exit__(exc_type, exc, tb)
