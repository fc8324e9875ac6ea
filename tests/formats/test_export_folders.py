"""A diffusers export's folder: recognised as this tool's own by the marker it writes, never by its file names, and
never left half-made by a failed run (issue 67).

    pytest tests/formats/test_export_folders.py
"""

from __future__ import annotations

import errno
import os

import pytest
from helpers import (
    assert_user_error,
    folder_bytes,
    perturbed_unet,
    run_here,
    save_weights_only,
    tiny_unet_config,
)

from ddpm.formats.diffusers_io import EXPORT_MARKER


@pytest.fixture
def checkpoint(tmp_path):
    return save_weights_only(tmp_path / "m.pt", perturbed_unet(tiny_unet_config(norm_groups=8), std=0.1))


def _export(output, *flags: str) -> list[str]:
    return ["--mode", "export", "--format", "diffusers", "--model_path", "m.pt", "--output", str(output), *flags]


def test_a_folder_saved_by_diffusers_itself_is_never_replaced_even_with_overwrite(checkpoint, tmp_path):
    """Found by the adversarial pass: DDPMPipeline.save_pretrained writes the names an export writes, so the folder
    was taken for an earlier export and --overwrite replaced the user's model."""
    diffusers = pytest.importorskip("diffusers")
    unet = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        norm_num_groups=8,
    )
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler()).save_pretrained(tmp_path / "theirs")
    before = folder_bytes(tmp_path / "theirs")
    for flags in ([], ["--overwrite"]):
        result = run_here(*_export("theirs", *flags), cwd=tmp_path)
        assert_user_error(result, "which --format diffusers did not write")
        assert "even with --overwrite" in result.stderr
    assert folder_bytes(tmp_path / "theirs") == before


def test_an_export_whose_files_were_changed_since_is_no_longer_its_own(checkpoint, tmp_path):
    """The marker records what each file held: a file changed by another tool is not replaced."""
    assert run_here(*_export("out"), cwd=tmp_path).returncode == 0
    assert (tmp_path / "out" / EXPORT_MARKER).is_file()
    config = tmp_path / "out" / "unet" / "config.json"
    config.write_bytes(config.read_bytes().replace(b'"dropout"', b'"dropout" '))
    before = folder_bytes(tmp_path / "out")
    assert_user_error(run_here(*_export("out", "--overwrite"), cwd=tmp_path), "holds unet/config.json, which")
    assert folder_bytes(tmp_path / "out") == before
    config.unlink()  # back to the export's own files
    assert run_here(*_export("out", "--overwrite"), cwd=tmp_path).returncode == 0


def test_an_interrupted_replacement_leaves_a_folder_the_next_export_still_recognises(checkpoint, tmp_path, monkeypatch):
    """A replacement stopped between two files (a full disk) leaves old and new files; the marker records both, so
    the next --overwrite finishes it rather than refusing the folder."""
    assert run_here(*_export("out"), cwd=tmp_path).returncode == 0
    replace, moved = os.replace, []

    def full_after_one(source, destination):
        if ".tmp-" not in str(destination) and "unet" in str(destination):  # a new file moved into the folder
            if moved:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            moved.append(destination)
        replace(source, destination)

    monkeypatch.setattr(os, "replace", full_after_one)
    result = run_here(*_export("out", "--overwrite", "--no_ema"), cwd=tmp_path)
    assert_user_error(result, "cannot write out: No space left on device; it holds part of the new export")
    monkeypatch.setattr(os, "replace", replace)
    assert run_here(*_export("out", "--overwrite"), cwd=tmp_path).returncode == 0


def test_a_failed_export_leaves_no_folder_it_created(checkpoint, tmp_path, monkeypatch):
    """Found by the adversarial pass: an export meeting a full disk said nothing partial was left, and left an
    empty (or half-written) folder, and the folders above it it had made."""
    fsync = os.fsync

    def full(fd):  # a full disk met when the buffered data reach it (fsync reports ENOSPC)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    try:
        result = run_here(*_export("new/deeper/out"), cwd=tmp_path)
    finally:
        monkeypatch.setattr(os, "fsync", fsync)
    assert_user_error(result, "cannot write new/deeper/out: No space left on device; no folder was created")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
