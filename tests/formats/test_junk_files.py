"""Every loader owns its failures: junk in any file a run reads ends in one ValueError line, never a traceback.

Specification: for each loader (checkpoints, autoencoders, a checkpoint's autoencoder link, ONNX U-Nets and
exported decoders, trusted TorchScript, engine metadata, image folders, .npy volumes), a seeded generator of
junk (empty, text, empty and junk zips, truncated and bit-flipped real files, huge headers) is refused with a
one-line ValueError naming the file; no other exception escapes. Only the junk each test lists may load, and
it must load as the real file does: bits flipped in a weight or a voxel are data no loader can tell from the
real thing without a checksum (the same structure, other values: safetensors and .npy files have none; a zip's
entries have CRC-32s, so a flipped bit in a checkpoint loads only where no reader reads it), and a file whose
cut-off last byte nothing needed (a JSON file's final newline, a PNG's end-chunk checksum) is the real file.
Zip inputs are also held to their directory: an entry that inflates far beyond the file is refused unread.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import re
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_SCHEDULE, needs_onnx, perturbed_unet, tiny_unet_config
from PIL import Image

import tensorrt_integration
from ddpm.backends.artifacts import Artifact, load_artifact
from ddpm.data.datasets import ImageSet, load_images
from ddpm.formats.checkpoints import FORMAT_VERSION, save_checkpoint
from ddpm.formats.exporters import save_torchscript, trace_torchscript
from ddpm.formats.unet_io import artifact_metadata
from ddpm.latent.autoencoder import Autoencoder, AutoencoderConfig, checkpoint_state, load_autoencoder
from ddpm.util.safe_files import atomic_write

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
CPU = torch.device("cpu")
CONFIG = tiny_unet_config(image_size=8)


def junk_versions(real: bytes, *, seed: int) -> list[tuple[str, bytes]]:
    """Junk a careless user or an attacker could hand a loader in place of ``real``."""
    rng = random.Random(seed)
    empty_zip, junk_zip = io.BytesIO(), io.BytesIO()
    zipfile.ZipFile(empty_zip, "w").close()
    with zipfile.ZipFile(junk_zip, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02junk")
        archive.writestr("archive/version", b"3\n")
        archive.writestr("archive/data/0", bytes(rng.randrange(256) for _ in range(64)))
    versions = [
        ("empty", b""),
        ("text", b"hello, not a model\n"),
        ("empty zip", empty_zip.getvalue()),
        ("junk zip", junk_zip.getvalue()),
        ("random bytes", bytes(rng.randrange(256) for _ in range(4096))),
        ("first half", real[: len(real) // 2]),
        ("first 100 bytes", real[:100]),
        ("last byte cut", real[:-1]),
    ]
    for i in range(6):  # a few bytes flipped, anywhere in the file
        flipped = bytearray(real)
        for _ in range(8):
            flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        versions.append((f"bit flips #{i}", bytes(flipped)))
    return versions


# What junk that loads must load as: the real file's structure (configs, tensor names, shapes and dtypes) with
# other values, or the real file exactly.
SAME_STRUCTURE, SAME = "the real file's structure", "the real file"


def structure(loaded) -> tuple:
    """What a loaded file is, its weights' and voxels' values aside."""
    if isinstance(loaded, ImageSet):
        return ("images", tuple(loaded.images.shape), loaded.images.dtype, loaded.class_names)
    if isinstance(loaded, Artifact):
        configs = (loaded.kind, loaded.model_config, loaded.schedule_config, loaded.class_names, loaded.dataset)
    else:  # an autoencoder
        configs = (loaded.config, loaded.latent_scale)
    return (*configs, tuple((k, tuple(v.shape), v.dtype) for k, v in loaded.model.state_dict().items()))


def values(loaded) -> list[torch.Tensor]:
    return [loaded.images] if isinstance(loaded, ImageSet) else list(loaded.model.state_dict().values())


def one_line_or_loads(load, path, name: str, *, may_load: str | None = None, reference=None) -> None:
    """``load(path)`` is refused in one ValueError line; or, where ``may_load`` says so, loads as ``reference``
    (the real file, loaded the same way) does: with its structure (SAME_STRUCTURE) or exactly (SAME)."""
    try:
        loaded = load(path)
    except ValueError as exc:
        assert "\n" not in str(exc).strip() and str(exc), f"{name}: {exc!r}"
        return
    except Exception as exc:  # noqa: BLE001 -- anything else is the failure this test exists for
        pytest.fail(f"{name}: {type(exc).__name__}: {exc}")
    assert may_load is not None, f"{name}: loaded, but junk of this kind must be refused"
    assert structure(loaded) == structure(reference), f"{name}: loaded as something else than the real file"
    if may_load == SAME:
        assert all(torch.equal(a, b) for a, b in zip(values(loaded), values(reference))), f"{name}: other values"


def fuzz(load, real_path, tmp_path, *, seed: int = 0, name: str | None = None, may_load: dict | None = None) -> None:
    """Each junk version of ``real_path``, written where ``load`` reads it: refused in one line, unless
    ``may_load`` ({kind of junk: SAME_STRUCTURE or SAME}, kinds as junk_versions names them, "bit flips" for
    all six) lets that kind load as the real file does."""
    real, path, may_load = real_path.read_bytes(), tmp_path / (name or real_path.name), may_load or {}
    path.write_bytes(real)
    reference = load(path) if may_load else None  # the real file, read as the junk will be
    for what, data in junk_versions(real, seed=seed):
        path.write_bytes(data)
        allowed = next((v for k, v in may_load.items() if what.startswith(k)), None)
        one_line_or_loads(load, path, f"{real_path.name} as {what}", may_load=allowed, reference=reference)


def write_checkpoint(path, **extra) -> None:
    state = perturbed_unet(CONFIG).state_dict()
    save_checkpoint(
        path,
        {
            "format_version": FORMAT_VERSION,
            "model_config": dataclasses.asdict(CONFIG),
            "schedule_config": dataclasses.asdict(TINY_SCHEDULE),
            "model": state,
            "ema": state,
            "step": 0,
            **extra,
        },
    )


def write_autoencoder(path) -> None:
    torch.manual_seed(0)
    ae = Autoencoder(AutoencoderConfig(image_size=8, in_channels=1, latent_channels=2, downsample=2, base_channels=8))
    state = checkpoint_state(ae, latent_scale=1.5, dataset="digits", metrics={}, step=0)
    atomic_write(path, lambda f: torch.save(state, f))


def test_junk_checkpoints_end_in_one_line(tmp_path):
    write_checkpoint(tmp_path / "real.pt")
    fuzz(
        lambda p: load_artifact(p, device=CPU),
        tmp_path / "real.pt",
        tmp_path,
        name="junk.pt",
        may_load={"bit flips": SAME},  # bits no reader reads (a timestamp); a weight's bytes fail their CRC-32
    )


def inflating(real: bytes, *, inflated: int) -> bytes:
    """``real`` (a PyTorch zip) with its ``data.pkl`` deflated from ``inflated`` bytes (the real pickle, then
    zeros): a small file whose directory says, truly, that it inflates to far more than it holds. Built in
    1 MiB chunks, so the test never holds the inflated bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(real)) as source, zipfile.ZipFile(out, "w") as bomb:
        for entry in source.infolist():
            if not entry.filename.endswith("/data.pkl"):
                bomb.writestr(entry, source.read(entry))
                continue
            deflated = zipfile.ZipInfo(entry.filename, date_time=entry.date_time)
            deflated.compress_type = zipfile.ZIP_DEFLATED
            with bomb.open(deflated, "w") as pickle_file:
                pickle_file.write(source.read(entry))
                for _ in range(inflated >> 20):
                    pickle_file.write(bytes(1 << 20))
    return out.getvalue()


def flipped(real: bytes) -> bytes:
    """``real`` (a PyTorch zip) with one bit flipped in the middle of its largest tensor's bytes: a valid zip,
    the same structure, one weight changed (a failing disk, a bad copy)."""
    with zipfile.ZipFile(io.BytesIO(real)) as archive:
        entry = max((e for e in archive.infolist() if "/data/" in e.filename), key=lambda e: e.file_size)
    name_length, extra_length = struct.unpack_from("<HH", real, entry.header_offset + 26)  # its local header
    at = entry.header_offset + 30 + name_length + extra_length + entry.file_size // 2
    data = bytearray(real)
    data[at] ^= 0x10
    return bytes(data)


ZIP_INPUTS = ("checkpoint", "autoencoder", "torchscript")


def real_zip(kind: str, folder) -> tuple:
    """The real file of ``kind`` (one of ZIP_INPUTS) in ``folder`` and how a run loads it."""
    if kind == "checkpoint":
        write_checkpoint(folder / "real.pt")
        return folder / "real.pt", lambda p: load_artifact(p, device=CPU)
    if kind == "autoencoder":
        write_autoencoder(folder / "real.pt")
        return folder / "real.pt", lambda p: load_autoencoder(p, device=CPU)
    meta = artifact_metadata(model_config=CONFIG, schedule_config=TINY_SCHEDULE, weights="ema", traced_on="cpu")
    save_torchscript(trace_torchscript(perturbed_unet(CONFIG)), folder / "real.ts", metadata=meta)
    return folder / "real.ts", lambda p: load_artifact(p, device=CPU, trust_torchscript=True)


@pytest.mark.parametrize("kind", ZIP_INPUTS)
def test_an_inflating_zip_is_refused_from_its_directory_before_anything_inflates(tmp_path, monkeypatch, kind):
    """A small zip whose data.pkl inflates to 64 MiB (the issue's 1.5 MB file inflated to 1.5 GB, taking 14 s
    and 3.5 GB before it was refused): refused in one line from its directory's sizes; torch never reads it."""
    real, load = real_zip(kind, tmp_path)
    bomb = inflating(real.read_bytes(), inflated=64 << 20)
    assert len(bomb) < (1 << 20)  # a small file
    (tmp_path / f"bomb{real.suffix}").write_bytes(bomb)

    def inflated(*args, **kwargs):
        raise AssertionError("torch read the inflating zip")

    monkeypatch.setattr(torch, "load", inflated)
    monkeypatch.setattr(torch.jit, "load", inflated)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"would inflate to 6\d\.\d MiB .* refused before inflating it") as info:
        load(Path(f"bomb{real.suffix}"))
    assert "\n" not in str(info.value) and f"bomb{real.suffix}" in str(info.value)


@pytest.mark.parametrize("kind", ZIP_INPUTS)
def test_a_bit_flipped_zip_is_refused_by_its_crc_before_use(tmp_path, monkeypatch, kind):
    """One bit flipped in a weight inside a valid zip (it loaded and trained): refused by the entry's CRC-32 in
    one line naming the file as given, never the machine's absolute path."""
    real, load = real_zip(kind, tmp_path)
    (tmp_path / f"flipped{real.suffix}").write_bytes(flipped(real.read_bytes()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"flipped\.\w+ is corrupt .*fails its CRC-32 check") as info:
        load(Path(f"flipped{real.suffix}"))
    assert "\n" not in str(info.value) and str(tmp_path) not in str(info.value)


def test_a_zip_directory_too_large_to_parse_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    """zipfile builds an object per directory entry (~10x its bytes): a directory over the bound is refused from
    the size its end record gives, before zipfile or torch parses it (here the bound is lowered under the real
    checkpoint's 8 KiB directory)."""
    from ddpm.formats import torch_files

    write_checkpoint(tmp_path / "real.pt")
    monkeypatch.setattr(torch_files, "MAX_ZIP_DIRECTORY_BYTES", 256)

    def parsed(*args, **kwargs):
        raise AssertionError("the directory was parsed")

    monkeypatch.setattr(zipfile, "ZipFile", parsed)
    monkeypatch.setattr(torch, "load", parsed)
    with pytest.raises(ValueError, match=r"real\.pt: its zip directory is [\d.]+ KiB, over the 256 B") as info:
        load_artifact(tmp_path / "real.pt", device=CPU)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("step", -1, "records step -1"),
        ("step", 10**30, "a checkpoint's step is 0 to"),
        ("step", 1.5, "records step 1.5"),
        ("ema", "inf", "its EMA weights hold NaN or inf"),
        ("model", "nan", "its weights hold NaN or inf"),
    ],
)
def test_a_checkpoint_whose_fields_lie_is_refused_at_load(tmp_path, field, value, match):
    """A hand-edited checkpoint (step -1 ended in a ZeroDivisionError traceback on --resume; inf weights
    trained two steps, then failed with exit 1): refused when read, in one line."""
    state = perturbed_unet(CONFIG).state_dict()
    checkpoint = {
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(CONFIG),
        "schedule_config": dataclasses.asdict(TINY_SCHEDULE),
        "model": state,
        "ema": dict(state),
        "step": 0,
    }
    if field == "step":
        checkpoint["step"] = value
    else:
        checkpoint[field] = {k: v.clone().fill_(float(value)) if v.is_floating_point() else v for k, v in state.items()}
    atomic_write(tmp_path / "lying.pt", lambda f: torch.save(checkpoint, f))
    with pytest.raises(ValueError, match=re.escape(match)) as info:
        load_artifact(tmp_path / "lying.pt", device=CPU)
    assert "\n" not in str(info.value)


def test_junk_safetensors_files_and_diffusers_folders_end_in_one_line(tmp_path):
    from ddpm.backends import artifacts
    from ddpm.formats import safetensors_io
    from ddpm.formats.unet_io import artifact_metadata

    model = perturbed_unet(tiny_unet_config(image_size=8, norm_groups=8, attention_resolutions=(4,)))
    meta = artifact_metadata(model_config=model.config, schedule_config=TINY_SCHEDULE, weights="ema")
    safetensors_io.write_safetensors(model, tmp_path / "real.safetensors", metadata=meta)
    fuzz(
        lambda p: load_artifact(p, device=CPU),
        tmp_path / "real.safetensors",
        tmp_path,
        name="junk.safetensors",
        may_load={"bit flips": SAME_STRUCTURE},  # the header is JSON, checked; the rest is weights
    )
    artifacts.write_diffusers_folder(model, TINY_SCHEDULE, tmp_path / "folder", source="test")
    reference = load_artifact(tmp_path / "folder", device=CPU)
    for part, may_load in (
        ("unet/diffusion_pytorch_model.safetensors", {"bit flips": SAME_STRUCTURE}),
        ("unet/config.json", {"last byte cut": SAME}),  # the final newline
        ("scheduler/scheduler_config.json", {"last byte cut": SAME}),
    ):
        real = tmp_path / "folder" / part
        kept = real.read_bytes()
        assert kept.endswith(b"\n") or not part.endswith(".json")
        for what, data in junk_versions(kept, seed=1):
            real.write_bytes(data)
            allowed = next((v for k, v in may_load.items() if what.startswith(k)), None)
            one_line_or_loads(
                lambda p: load_artifact(p, device=CPU),
                tmp_path / "folder",
                f"{part} as {what}",
                may_load=allowed,
                reference=reference,
            )
        real.write_bytes(kept)


def test_junk_autoencoders_end_in_one_line_directly_and_through_a_link(tmp_path):
    write_autoencoder(tmp_path / "ae.pt")
    fuzz(
        lambda p: load_autoencoder(p, device=CPU),
        tmp_path / "ae.pt",
        tmp_path,
        name="junk_ae.pt",
        may_load={"bit flips": SAME},
    )
    # A checkpoint whose link names an arbitrary file: refused in one line, whatever that file holds.
    write_checkpoint(tmp_path / "linked.pt", autoencoder={"path": str(tmp_path / "junk_ae.pt"), "sha256": "0" * 64})
    fuzz(
        lambda p: load_artifact(tmp_path / "linked.pt", device=CPU),
        tmp_path / "ae.pt",
        tmp_path,
        name="junk_ae.pt",
        seed=1,
    )


@needs_onnx
def test_junk_onnx_files_and_decoders_end_in_one_line(tmp_path, latent_export):
    folder, _ = latent_export  # a latent model exported by the CLI, lat.onnx beside lat.decoder.onnx (conftest.py)
    for name in ("lat.onnx", "lat.decoder.onnx"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    real_unet, real_decoder = (tmp_path / "lat.onnx").read_bytes(), (tmp_path / "lat.decoder.onnx").read_bytes()
    (tmp_path / "real.onnx").write_bytes(real_unet)
    fuzz(lambda p: load_artifact(p, device=CPU), tmp_path / "real.onnx", tmp_path, name="junk.onnx")
    # The decoder is hashed in the U-Net's metadata: junk in its place is refused by its hash. A decoder graph
    # that matches the hash still passes the U-Net graph's checks (tests/backends/test_artifacts.py).
    (tmp_path / "real.decoder.onnx").write_bytes(real_decoder)
    fuzz(
        lambda p: load_artifact(tmp_path / "lat.onnx", device=CPU),
        tmp_path / "real.decoder.onnx",
        tmp_path,
        name="lat.decoder.onnx",
    )


def test_junk_trusted_torchscript_and_engine_metadata_end_in_one_line(tmp_path):
    traced = torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2))
    traced.save(str(tmp_path / "real.ts"))
    fuzz(lambda p: load_artifact(p, device=CPU, trust_torchscript=True), tmp_path / "real.ts", tmp_path, name="junk.ts")
    (tmp_path / "x.engine").write_bytes(b"engine")
    meta = {
        "metadata_version": 1,
        "sha256": "ab" * 32,
        "batch_range": [1, 8, 64],
        "tensorrt_version": "10.9.0",
        "gpu_name": "H100",
        "compute_capability": "9.0",
        "model_config": dataclasses.asdict(CONFIG),
        "schedule_config": dataclasses.asdict(TINY_SCHEDULE),
    }
    (tmp_path / "real.json").write_text(json.dumps(meta))
    fuzz(
        lambda p: tensorrt_integration.read_engine_metadata(tmp_path / "x.engine"),
        tmp_path / "real.json",
        tmp_path,
        name="x.engine.json",
    )


def test_junk_images_and_volumes_end_in_one_line(tmp_path):
    images, volumes = tmp_path / "images", tmp_path / "volumes"
    images.mkdir()
    volumes.mkdir()
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).save(tmp_path / "real.png")
    np.save(tmp_path / "real.npy", np.linspace(0, 1, 8**3).reshape(8, 8, 8))
    assert len((tmp_path / "real.png").read_bytes()) <= 100  # so its "first 100 bytes" are all of it
    fuzz(
        lambda p: load_images("folder", data_dir=images, image_size=8, channels=1),
        tmp_path / "real.png",
        images,
        may_load={"first 100 bytes": SAME, "last byte cut": SAME},  # the end chunk's checksum: PIL does not need it
    )
    fuzz(
        lambda p: load_images("voxels", data_dir=volumes, image_size=8),
        tmp_path / "real.npy",
        volumes,
        may_load={"bit flips": SAME_STRUCTURE},  # voxel values
    )
    # Huge headers: a PNG claiming 2^31 - 1 pixels a side, a .npy claiming 10^12 elements.
    png = (tmp_path / "real.png").read_bytes()
    ihdr = png.index(b"IHDR") + 4
    (images / "real.png").write_bytes(png[:ihdr] + struct.pack(">II", 2**31 - 1, 2**31 - 1) + png[ihdr + 8 :])
    one_line_or_loads(lambda p: load_images("folder", data_dir=p, image_size=8, channels=1), images, "a huge PNG")
    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (1000000, 1000000), }"
    (volumes / "real.npy").write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header) + 1) + header + b"\n")
    one_line_or_loads(lambda p: load_images("voxels", data_dir=p, image_size=8), volumes, "a huge .npy")


def test_an_image_over_pils_pixel_limit_is_refused_in_one_line_without_a_warning(tmp_path, monkeypatch, recwarn):
    Image.fromarray(np.zeros((64, 64), dtype=np.uint8)).save(tmp_path / "big.png")
    monkeypatch.setattr(
        Image, "MAX_IMAGE_PIXELS", 64 * 64 - 1
    )  # over the warning limit, under twice it (no error in PIL)
    with pytest.raises(ValueError, match="cannot read image .*big.png"):
        load_images("folder", data_dir=tmp_path, image_size=8, channels=1)
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]
