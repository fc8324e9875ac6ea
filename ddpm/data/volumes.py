"""3-D voxel diffusion: the volumes a 3-D model trains on and their pictures.

Data (uint8 (N, 1, S, S, S), as ``data.load_images`` holds every dataset):

* ``--dataset spheres``: :func:`sphere_volumes`, soft-edged solid spheres drawn from a seed (radius
  15% to 35% of the grid, wholly inside it with one empty voxel to spare);
* ``--dataset voxels``: :func:`load_voxel_folder`, the user's own ``.npy`` volumes under ``--data_dir``
  (floats or bools in [0, 1], or integers 0..255), resized to the training size.

Pictures: :func:`save_volume_png` draws each volume's three orthogonal mid-slices and its
maximum-intensity projection, one row per volume (``sample`` mode's ``--output`` for a 3-D model).
(``--save_npz`` holds the volumes as uint8 (N, D, H, W, C): ``image_files.SampleWriter``.)

Metrics (IoU against a fitted sphere, PSNR/SSIM against the nearest real volume): evaluation/voxels.py.

"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

RADIUS_RANGE = (0.15, 0.35)  # sphere radius, as a fraction of the grid size
SPHERE_SIZES = (8, 128)  # the grid sizes spheres are drawn at (inclusive)
MAX_FILE_SIZE = 256  # the largest volume a .npy file may hold, per side
CHUNK_VOXELS = 2**23  # voxels computed at once when drawing spheres or resizing (64 MiB of float64)


# ---------------------------------------------------------------------------------------------------
# Data


def check_count(value, *, what: str, low: int, high: int | None = None) -> int:
    """An integer in [low, high]; one-line ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"{low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{what} must be {bounds}, got {value}")
    return int(value)


def sphere_parameters(n: int, *, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(centres (n, 3) float64, radii (n,) float64) of ``n`` spheres in a ``size``^3 grid, in voxels
    (voxel i's centre is at coordinate i; the grid spans [-0.5, size - 0.5] per axis).

    Radii are uniform in ``RADIUS_RANGE * size``; each centre is uniform where the sphere lies inside
    the grid with a margin of one voxel (centre in [r + 0.5, size - 1.5 - r] per axis), so even its
    soft edge leaves the outermost voxels empty. The first k of ``n`` spheres are the k spheres of
    ``n=k`` (one row of four uniform draws per sphere)."""
    n = check_count(n, what="the number of spheres", low=1)
    size = check_count(size, what="the sphere grid size", low=SPHERE_SIZES[0], high=SPHERE_SIZES[1])
    u = np.random.default_rng(seed).random((n, 4))  # (n, 4) row by row: sphere i never depends on n
    radii = RADIUS_RANGE[0] * size + u[:, 0] * (RADIUS_RANGE[1] - RADIUS_RANGE[0]) * size  # (n,)
    low, high = radii + 0.5, size - 1.5 - radii  # (n,) each: high >= low for every size >= 7
    centres = low[:, None] + u[:, 1:] * (high - low)[:, None]  # (n, 3) as (z, y, x)
    return centres, radii


def centre_box(size: int) -> tuple[float, float]:
    """(low, high): the range every coordinate of a drawn sphere's centre lies in, for any radius."""
    r_min = RADIUS_RANGE[0] * size
    return r_min + 0.5, size - 1.5 - r_min


def radius_range(size: int) -> tuple[float, float]:
    """The radii spheres are drawn with at ``size``, one voxel wider each way (a fit's tolerance)."""
    return RADIUS_RANGE[0] * size - 1, RADIUS_RANGE[1] * size + 1


def sphere_volumes(n: int, *, size: int, seed: int) -> torch.Tensor:
    """``n`` soft-edged solid spheres as uint8 (n, 1, size, size, size), 0..255.

    The spheres of :func:`sphere_parameters`; a voxel's occupancy is clip(r - d + 0.5, 0, 1), with d the
    distance of its centre to the sphere's centre (so the occupancies sum to about 4/3 pi r^3)."""
    centres, radii = sphere_parameters(n, size=size, seed=seed)
    axis = np.arange(size, dtype=np.float64)  # voxel centres along one axis
    out = np.empty((len(radii), 1, size, size, size), dtype=np.uint8)
    chunk = max(1, min(64, CHUNK_VOXELS // size**3))
    for start in range(0, len(radii), chunk):
        c, r = centres[start : start + chunk], radii[start : start + chunk]  # (B, 3), (B,)
        d2 = (axis[None, :] - c[:, 0:1]) ** 2  # (B, D)
        h2 = (axis[None, :] - c[:, 1:2]) ** 2  # (B, H)
        w2 = (axis[None, :] - c[:, 2:3]) ** 2  # (B, W)
        dist = np.sqrt(d2[:, :, None, None] + h2[:, None, :, None] + w2[:, None, None, :])  # (B, D, H, W)
        occupancy = np.clip(r[:, None, None, None] - dist + 0.5, 0.0, 1.0)
        out[start : start + chunk, 0] = np.rint(occupancy * 255.0).astype(np.uint8)
    return torch.from_numpy(out)


def _read_npy(path: Path) -> np.ndarray:
    """One .npy file as an array (memory-mapped: its shape is checked before its data are read)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as exc:
        raise ValueError(f"cannot read volume file {path}: {exc.strerror or exc}") from exc
    if magic != b"\x93NUMPY":
        raise ValueError(f"volume file {path} is not a NumPy .npy array (save volumes with numpy.save)")
    try:
        array = np.load(path, allow_pickle=False, mmap_mode="r")
    except ValueError as exc:
        if "object" in str(exc).lower():
            raise ValueError(
                f"volume file {path} holds a pickled object array; volumes must be plain numeric arrays"
            ) from exc
        raise ValueError(f"cannot read volume file {path}: {str(exc).splitlines()[0]}") from exc
    except Exception as exc:  # noqa: BLE001 -- a damaged header makes numpy's parser raise anything (SyntaxError, TokenError, ...)
        raise ValueError(f"volume file {path} is corrupt or not a NumPy .npy array ({type(exc).__name__})") from exc
    if not isinstance(array, np.ndarray):
        raise ValueError(f"volume file {path} is not a single .npy array")
    return array


def _check_volume_array(array: np.ndarray, path: Path) -> np.ndarray:
    """The file's volumes as (N, D, D, D), validated; one-line ValueError naming ``path``."""
    shape = tuple(array.shape)
    if array.ndim == 5 and shape[1] == 1:
        array = array[:, 0]
    elif array.ndim == 3:
        array = array[None]
    elif array.ndim != 4:
        raise ValueError(
            f"volume file {path} holds an array of shape {shape}; give (D, H, W), (N, D, H, W) or (N, 1, D, H, W)"
        )
    n, d, h, w = array.shape
    if not d == h == w:
        raise ValueError(
            f"volume file {path} holds a non-cubic volume ({d}x{h}x{w}); volumes must be cubes (D == H == W)"
        )
    if n == 0 or d == 0:
        raise ValueError(f"volume file {path} holds no voxels (shape {shape})")
    if d > MAX_FILE_SIZE:
        raise ValueError(f"volume file {path} holds {d}^3 volumes; the largest accepted is {MAX_FILE_SIZE}^3")
    if array.dtype.kind not in "buif":
        raise ValueError(
            f"volume file {path} holds {array.dtype} values; volumes must be numbers (bool, integers or floats)"
        )
    return array


def _volumes_to_unit_range(array: np.ndarray, path: Path) -> np.ndarray:
    """(N, D, D, D) of any accepted dtype -> float32 0..255, after the value checks."""
    kind = array.dtype.kind
    if kind == "b":
        return array.astype(np.float32) * 255.0
    if kind == "f":
        values = np.asarray(array, dtype=np.float64 if array.dtype.itemsize > 4 else np.float32)
        if not np.isfinite(values).all():
            raise ValueError(f"volume file {path} holds NaN or infinite values")
        low, high = float(values.min()), float(values.max())
        if low < 0 or high > 1:
            raise ValueError(
                f"volume file {path} holds float values in [{low:g}, {high:g}]; float volumes must lie in [0, 1] "
                "(integer volumes in 0..255)"
            )
        return (values * 255.0).astype(np.float32)
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > 255:
        raise ValueError(
            f"volume file {path} holds {array.dtype} values in [{low}, {high}]; integer volumes must lie in 0..255"
        )
    return array.astype(np.float32)


def _resize(volumes: torch.Tensor, size: int) -> torch.Tensor:
    """float (N, 1, D, D, D) in 0..255 -> uint8 (N, 1, size, size, size): trilinear when enlarging,
    area averaging when shrinking (trilinear would skip voxels beyond a 2x shrink)."""
    d = volumes.shape[-1]
    out = []
    chunk = max(1, CHUNK_VOXELS // max(d, size) ** 3)
    for part in volumes.split(chunk):
        if d < size:
            part = F.interpolate(part, size=(size,) * 3, mode="trilinear", align_corners=False)
        elif d > size:
            part = F.interpolate(part, size=(size,) * 3, mode="area")
        out.append(part.round().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out)


def _voxel_files(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"voxel folder {root} does not exist (give it with --data_dir)")
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() == ".npy" and p.is_file())
    if not paths:
        raise ValueError(f"voxel folder {root} holds no .npy volumes")
    return paths


def count_voxel_volumes(root: str | Path) -> int:
    """How many volumes the ``.npy`` files under ``root`` hold, from their headers (memory-mapped, no
    data read; shapes and dtypes validated): for a memory check before :func:`load_voxel_folder`."""
    return sum(len(_check_volume_array(_read_npy(path), path)) for path in _voxel_files(root))


def load_voxel_folder(root: str | Path, *, size: int) -> torch.Tensor:
    """The ``.npy`` volumes under ``root`` (sorted, recursive) as uint8 (N, 1, size, size, size), 0..255.

    A file holds one volume (D, H, W) or a stack (N, D, H, W) or (N, 1, D, H, W), cubic, at most
    256^3; floats and bools in [0, 1], integers in 0..255 (no pickled objects). One-line ValueError
    naming the folder or file otherwise."""
    size = check_count(size, what="the volume size", low=1)
    paths = _voxel_files(root)
    out = []
    for path in paths:
        array = _check_volume_array(_read_npy(path), path)  # (N, D, D, D), still on disk
        step = max(1, CHUNK_VOXELS // array.shape[-1] ** 3)  # bounded float32 memory, whatever the stack
        for start in range(0, len(array), step):
            values = _volumes_to_unit_range(array[start : start + step], path)  # float32 0..255
            out.append(_resize(torch.from_numpy(values)[:, None], size))  # (n, 1, size, size, size)
        del array  # closes the memory map
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------------
# Pictures and files


def check_volumes(volumes: torch.Tensor, *, what: str = "volumes") -> torch.Tensor:
    if not isinstance(volumes, torch.Tensor):
        volumes = torch.as_tensor(np.asarray(volumes))
    if volumes.ndim != 5:
        raise ValueError(f"{what} must be (N, C, D, H, W), got shape {tuple(volumes.shape)}")
    if volumes.shape[0] == 0:
        raise ValueError(f"{what}: no volumes given")
    return volumes


def to_unit(volumes: torch.Tensor) -> torch.Tensor:
    """Float volumes in [-1, 1] -> float32 in [0, 1] on the CPU (clamped)."""
    return (volumes.detach().float().cpu().clamp(-1, 1) + 1) / 2


PANELS = ("axial (mid z)", "coronal (mid y)", "sagittal (mid x)", "max projection (z)")


def save_volume_png(volumes: torch.Tensor, path: str | Path, *, max_samples: int = 16) -> Path:
    """A PNG of float (N, 1, D, H, W) volumes in [-1, 1]: one row per volume (the first ``max_samples``),
    its three orthogonal mid-slices and its maximum-intensity projection along depth, grey 0..1.
    Drawn in memory, then written atomically."""
    volumes = check_volumes(volumes)
    if volumes.shape[1] != 1:
        raise ValueError(f"volume pictures take one channel, got {volumes.shape[1]} (shape {tuple(volumes.shape)})")
    max_samples = check_count(max_samples, what="max_samples", low=1)
    from matplotlib.figure import Figure  # Agg-rendered, without pyplot's global state

    from ddpm.util.safe_files import atomic_write

    x = to_unit(volumes[:max_samples])[:, 0].numpy()  # (R, D, H, W) in [0, 1]
    rows = len(x)
    fig = Figure(figsize=(4 * 1.7, rows * 1.7 + 0.3), dpi=100)
    axes = fig.subplots(rows, 4, squeeze=False)
    for i, vol in enumerate(x):
        d, h, w = vol.shape
        panels = (vol[d // 2], vol[:, h // 2, :], vol[:, :, w // 2], vol.max(axis=0))  # (H, W), (D, W), (D, H), (H, W)
        for j, (ax, panel) in enumerate(zip(axes[i], panels)):
            ax.imshow(panel, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(PANELS[j], fontsize=8)
        axes[i][0].set_ylabel(f"#{i}", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    return atomic_write(path, lambda f: f.write(data))
