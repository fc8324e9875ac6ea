"""volumes.py: the sphere data, the user's .npy volumes, volume pictures and the voxel metrics.

Specification: drawn spheres hold 4/3 pi r^3 of occupancy, lie inside the grid and repeat with their
seed; a sphere fit recovers a sphere's centre and radius, and tells spheres (IoU ~1) from noise (~1/3);
the judge puts held-out real spheres at the ceiling and noise at the floor, and caps an exact copy's
PSNR; a folder of .npy volumes loads (single and stacked, resized) or is refused in one line naming
the file; volume PNGs are written whole or not at all.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict

import numpy as np
import pytest
import torch

from ddpm.data import volumes
from ddpm.data.volumes import load_voxel_folder, sphere_parameters, sphere_volumes
from ddpm.evaluation import voxels
from ddpm.evaluation.voxels import VoxelJudge, fit_sphere

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --- the spheres --------------------------------------------------------------------------------


def test_a_drawn_sphere_holds_the_volume_of_its_ball_and_lies_inside_the_grid():
    size = 32
    v = sphere_volumes(48, size=size, seed=3)
    centres, radii = sphere_parameters(48, size=size, seed=3)
    assert v.shape == (48, 1, size, size, size) and v.dtype == torch.uint8
    lo, hi = volumes.RADIUS_RANGE
    assert ((radii >= lo * size) & (radii <= hi * size)).all()
    assert ((centres - radii[:, None] >= 0.5) & (centres + radii[:, None] <= size - 1.5)).all()
    occupied = v.double().sum((1, 2, 3, 4)).numpy() / 255
    ball = 4 / 3 * math.pi * radii**3
    big = radii >= 5
    assert big.sum() > 20
    np.testing.assert_array_less(np.abs(occupied[big] / ball[big] - 1), 0.05)
    # one empty voxel to spare on every face
    for face in (v[:, :, 0], v[:, :, -1], v[:, :, :, 0], v[:, :, :, -1], v[..., 0], v[..., -1]):
        assert face.max() == 0
    assert v.max() == 255  # solid inside


def test_the_same_seed_draws_the_same_spheres():
    a, b = sphere_volumes(5, size=16, seed=7), sphere_volumes(5, size=16, seed=7)
    assert torch.equal(a, b)
    assert not torch.equal(a, sphere_volumes(5, size=16, seed=8))
    # sphere i does not depend on how many are drawn (nor on the chunks they are drawn in)
    assert torch.equal(sphere_volumes(70, size=8, seed=1)[:5], sphere_volumes(5, size=8, seed=1))


@pytest.mark.parametrize(
    ("n", "size", "message"),
    [
        (4, 7, "8 to 128, got 7"),
        (4, 129, "8 to 128, got 129"),
        (0, 16, "number of spheres must be at least 1"),
        (2, 16.0, "must be an integer"),
    ],
)
def test_sphere_sizes_and_counts_out_of_range_are_refused(n, size, message):
    with pytest.raises(ValueError, match=message):
        sphere_volumes(n, size=size, seed=0)


# --- fitting spheres ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [16, 32])
def test_fit_sphere_recovers_the_centre_and_radius_of_drawn_spheres(size):
    v = sphere_volumes(16, size=size, seed=5)
    centres, radii = sphere_parameters(16, size=size, seed=5)
    for volume, centre, radius in zip(v, centres, radii):
        fit = fit_sphere(volume[0].double() / 255)
        np.testing.assert_array_less(np.abs(np.array(fit.centre) - centre), 0.5)
        assert abs(fit.radius - radius) < 0.5
        assert fit.iou > 0.9


def test_fit_sphere_gives_noise_a_low_iou_and_an_empty_volume_nothing():
    noise = torch.rand(4, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    for volume in noise:
        # a random half of the voxels against a ball of the same count: IoU (1/4) / (3/4) = 1/3
        assert fit_sphere(volume).iou < 0.4
    empty = fit_sphere(np.zeros((8, 8, 8)))
    assert empty.radius == 0 and empty.iou == 0 and all(math.isnan(c) for c in empty.centre)
    with pytest.raises(ValueError, match="one \\(D, H, W\\) volume"):
        fit_sphere(np.zeros((1, 8, 8, 8)))


# --- the judge ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judge():
    pytest.importorskip("skimage")
    return VoxelJudge(sphere_volumes(256, size=16, seed=0), sphere_volumes(32, size=16, seed=1), seed=0)


def test_held_out_spheres_score_at_the_ceiling_and_noise_at_the_floor(judge):
    ceiling = judge.ceiling(32, seed=0)
    floor = judge.floor(32, seed=0, image_size=16)
    assert ceiling.name == "real volumes (ceiling)" and floor.name == "uniform noise (floor)"
    assert ceiling.n == floor.n == 32 and ceiling.seconds is None
    assert ceiling.iou > 0.9 and ceiling.iou_ok == 1.0
    assert ceiling.radius_in_range == 1.0 and ceiling.centre_in_range == 1.0
    assert 10 < ceiling.psnr < voxels.PSNR_CAP  # a held-out sphere is not in the reference
    assert floor.iou < 0.4 and floor.iou_ok == 0.0 and floor.radius_in_range == 0.0
    assert ceiling.ssim > floor.ssim + 0.5 and ceiling.psnr > floor.psnr + 10
    fields = {"name", "n", "seconds", "iou", "iou_ok", "psnr", "ssim", "radius_mean", "radius_std", "radius_in_range"}
    assert fields <= set(asdict(ceiling))


def test_a_copied_reference_volume_has_capped_psnr_and_ssim_one(judge):
    copies = judge.reference[[3, 100]].float() / 127.5 - 1
    assert judge.nearest((copies + 1) / 2).tolist() == [3, 100]
    scores = judge.score(copies, name="copies")
    assert scores.psnr == voxels.PSNR_CAP
    assert scores.ssim == pytest.approx(1.0, abs=1e-9)


def test_the_judge_refuses_volumes_of_another_shape(judge):
    with pytest.raises(ValueError, match=r"must be \(N, 1, 16, 16, 16\) like the reference, got \(2, 1, 8, 8, 8\)"):
        judge.score(torch.zeros(2, 1, 8, 8, 8), name="x")
    with pytest.raises(ValueError, match="ceiling takes 33 held-out real volumes and there are 32"):
        judge.ceiling(33, seed=0)
    with pytest.raises(ValueError, match="reference volumes must be uint8"):
        VoxelJudge(torch.zeros(2, 1, 8, 8, 8), sphere_volumes(2, size=8, seed=0))


def test_without_scikit_image_the_judge_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "skimage.metrics", None)  # import fails
    with pytest.raises(ValueError, match="3-D SSIM needs scikit-image: pip install scikit-image"):
        VoxelJudge(sphere_volumes(2, size=8, seed=0), sphere_volumes(2, size=8, seed=1))


def test_voxel_table_shows_the_rows_the_ceiling_and_the_floor(judge):
    ceiling, floor = asdict(judge.ceiling(4, seed=0)), asdict(judge.floor(4, seed=0, image_size=16))
    row = {"sampler": "dpm_solver", "steps": 20, **ceiling, "name": "dpm_solver 20", "seconds": 1.5}
    lines = voxels.voxel_table({"rows": [row], "ceiling": ceiling, "floor": floor}).splitlines()
    assert len(lines) == 4 and "IoU (median)" in lines[0] and "SSIM" in lines[0]
    assert lines[1].startswith("dpm_solver") and lines[1].endswith("1.5")
    assert lines[2].endswith("   (ceiling: held-out real volumes)")
    assert lines[3].endswith("   (floor: uniform noise)")


# --- the user's .npy volumes ---------------------------------------------------------------------------


def test_a_folder_of_single_and_stacked_volumes_loads_sorted_and_resized(tmp_path):
    single = np.zeros((8, 8, 8), dtype=np.float32)
    single[2:6, 2:6, 2:6] = 1.0
    stack = np.full((2, 8, 8, 8), 40, dtype=np.uint8)
    (tmp_path / "sub").mkdir()
    np.save(tmp_path / "a.npy", single)
    np.save(tmp_path / "b.npy", stack)
    np.save(tmp_path / "sub" / "c.npy", np.ones((1, 1, 8, 8, 8), dtype=bool))
    (tmp_path / "notes.txt").write_text("not a volume")
    same = load_voxel_folder(tmp_path, size=8)
    assert same.shape == (4, 1, 8, 8, 8) and same.dtype == torch.uint8
    assert torch.equal(same[0, 0], torch.from_numpy(single * 255).to(torch.uint8))
    assert (same[1:3] == 40).all() and (same[3] == 255).all()
    bigger, smaller = load_voxel_folder(tmp_path, size=16), load_voxel_folder(str(tmp_path), size=4)
    assert bigger.shape == (4, 1, 16, 16, 16) and smaller.shape == (4, 1, 4, 4, 4)
    assert (bigger[1:3] == 40).all() and (smaller[3] == 255).all()
    assert smaller[0, 0, 1:3, 1:3, 1:3].min() == 255 and smaller[0, 0, 0, 0, 0] == 0  # 2x shrink averages


def _object_array(path):
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: np.save(p, np.zeros((8, 8, 6))), r"v\.npy holds a non-cubic volume \(8x8x6\)"),
        (lambda p: np.save(p, np.full((8, 8, 8), np.nan)), r"v\.npy holds NaN or infinite values"),
        (
            lambda p: np.save(p, np.full((8, 8, 8), 2.0)),
            r"v\.npy holds float values in \[2, 2\]; float volumes must lie in",
        ),
        (lambda p: np.save(p, np.full((8, 8, 8), 300, dtype=np.int16)), r"v\.npy holds int16 values in \[300, 300\]"),
        (_object_array, r"v\.npy holds a pickled object array"),
        (lambda p: p.write_bytes(b"hello"), r"v\.npy is not a NumPy \.npy array"),
        (lambda p: np.save(p, np.zeros((8, 8, 8), dtype=np.complex64)), r"v\.npy holds complex64 values"),
        (lambda p: np.save(p, np.zeros((2, 2, 8, 8, 8))), r"v\.npy holds an array of shape \(2, 2, 8, 8, 8\)"),
        (lambda p: np.save(p, np.zeros((257, 257, 257), dtype=np.uint8)), r"v\.npy holds 257\^3 volumes"),
    ],
    ids=["non-cubic", "nan", "float-range", "int-range", "pickled", "not-npy", "complex", "5-d", "too-large"],
)
def test_bad_volume_files_are_refused_in_one_line_naming_the_file(tmp_path, write, message):
    write(tmp_path / "v.npy")
    with pytest.raises(ValueError, match=message) as info:
        load_voxel_folder(tmp_path, size=8)
    assert "\n" not in str(info.value)


def test_an_empty_or_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no .npy volumes"):
        load_voxel_folder(tmp_path, size=8)
    with pytest.raises(ValueError, match="nowhere does not exist"):
        load_voxel_folder(tmp_path / "nowhere", size=8)


# --- pictures and files ---------------------------------------------------------------------------


def test_save_volume_png_writes_a_png(tmp_path):
    v = sphere_volumes(20, size=8, seed=0).float() / 127.5 - 1
    path = tmp_path / "v.png"
    assert volumes.save_volume_png(v, path, max_samples=3) == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="one channel, got 2"):
        volumes.save_volume_png(torch.zeros(1, 2, 8, 8, 8), path)


def test_save_volume_png_never_leaves_a_partial_file(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    path = tmp_path / "v.png"
    path.write_bytes(b"old picture")
    v = torch.zeros(2, 1, 8, 8, 8)

    def broken_savefig(self, *args, **kwargs):
        raise RuntimeError("drawing failed")

    with monkeypatch.context() as m:
        m.setattr(Figure, "savefig", broken_savefig)
        with pytest.raises(RuntimeError, match="drawing failed"):
            volumes.save_volume_png(v, path)
    assert path.read_bytes() == b"old picture"

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "fsync", broken_fsync)
        with pytest.raises(OSError, match="cannot write"):
            volumes.save_volume_png(v, path)
    assert path.read_bytes() == b"old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.png"]  # no temporary left behind
